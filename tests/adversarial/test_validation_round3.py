"""Validation that validates (issue #48 points 5 and 7, a hostile round's table): each attack as it
was tried, through `cli.main([...])`, `gin_bindings.load_job` or the engine's async face.

- `--validate_only` with the HF directory (or its config.json, or a shard) missing said "config
  valid", and the real run then failed with a traceback; so did a tokenizer directory or a tool
  endpoint that is not there. Now each is named by its config key and path, exit 2.
- a gin file binding one parameter twice with different values: the last one won silently. Now an
  error naming both places (file:line); a --gin_param over a file (or a later one) still overrides.
- engine: `top_k=10**12` raised OverflowError, a garbage `slot_handle` AttributeError; a handle of
  another engine was taken as this engine's own. Now they run (top_k, max_new_tokens past int32
  mean "no limit") or fail with a ValueError naming the argument.

Nothing here trains: validate_only allocates nothing, and the engine tests run a tiny model.
"""
import asyncio
import functools
import json
import sys
import shutil
from pathlib import Path

import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.protocols import GenerationRequest
from sfrrl_jax.agents.tasks.builtin_kinds import generate_arithmetic_tasks
from sfrrl_jax.agents.tasks.records import save_tasks_jsonl
from sfrrl_jax.engine import Engine, LockstepEngine
from sfrrl_jax.engine.slot_state import SlotRequest
from sfrrl_jax.launch import cli, gin_bindings

from model_fixtures import TINY

REPO = Path(__file__).resolve().parents[2]
STRAGGLERS = str(REPO / "experiments/configs/stragglers.gin")

# The 'tiny-moe' preset read from an HF directory (config.json + six shards), on the 8 devices
# conftest gives. `ExperimentConfig.model` names the preset, so today's validation let the preset
# stand in for a directory that is not there.
HF_BASE_GIN = """
import sfrrl_jax.testing.workload
Job.kind = 'rl'
Job.experiment = @ExperimentConfig()
ExperimentConfig.model = 'tiny-moe'
ExperimentConfig.mesh_expert = 8
ExperimentConfig.num_devices = 8
ExperimentConfig.trainer = @TrainerConfig()
ExperimentConfig.progress_bar = False
TrainerConfig.groups_per_step = 1
TrainerConfig.group_size = 2
TrainerConfig.max_slots = 2
TrainerConfig.max_len = 1024
TrainerConfig.buckets = (256,)
TrainerConfig.seq_bucket = 1024
"""
HF_GIN = HF_BASE_GIN + "ExperimentConfig.rollout = @WorkloadRollout()\n"

# HF_GIN's experiment on agentic RL: a task file, the tokenizer beside the weights
AGENTIC_GIN = HF_BASE_GIN + """
ExperimentConfig.rollout = @AgenticRollout()
AgenticRollout.agent = @AgentConfig()
AgentConfig.max_turns = 2
AgentConfig.max_new_tokens_per_turn = 16
AgentConfig.max_total_tokens = 512
"""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tok_dir):
    """A complete HF directory: the tiny-moe preset saved in six shards, the tiny tokenizer beside it."""
    from sfrrl_jax.checkpoints.hf.saver import save_hf
    directory = tmp_path_factory.mktemp("hf") / "tiny"
    cfg = S.ModelConfig.preset("tiny-moe")
    save_hf(cfg, S.init_params(cfg, S.make_mesh(data=1, expert=8), seed=0), directory, max_shard_bytes=200_000)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, directory / name)
    assert len(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    return directory


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory):
    return save_tasks_jsonl(generate_arithmetic_tasks(4, seed=0), tmp_path_factory.mktemp("tasks") / "arith.jsonl")


def _copy(hf_dir, tmp_path) -> Path:
    out = tmp_path / "hf"
    shutil.copytree(hf_dir, out)
    return out


def _validate(tmp_path, capsys, *params, gin=HF_GIN) -> tuple[int, str]:
    gin_file = tmp_path / "job.gin"
    gin_file.write_text(gin)
    capsys.readouterr()
    code = cli.main([f"--gin_file={gin_file}", f"--run_dir={tmp_path / 'run'}", "--validate_only"]
                    + [f"--gin_param={p}" for p in params])
    out = capsys.readouterr()
    return code, out.out + out.err


def _shards(directory: Path) -> list[str]:
    return sorted(set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values()))


# -- --validate_only checks the files ------------------------------------------------------------

def test_validate_only_passes_a_complete_hf_directory(hf_dir, tasks_file, tmp_path, capsys):
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(hf_dir)!r}")
    assert code == 0 and "config valid" in out, out
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(hf_dir)!r}",
                          f"AgenticRollout.tasks = {str(tasks_file)!r}", gin=AGENTIC_GIN)
    assert code == 0 and "config valid" in out, out


def test_validate_only_refuses_a_missing_hf_directory(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(missing)!r}")
    # was: exit 0, "config valid" (the preset stood in for the directory)
    assert code == 2 and "config invalid" in out, out
    assert f"ExperimentConfig.hf_path={str(missing)!r}" in out and "no such directory" in out


def test_validate_only_refuses_a_missing_config_json(hf_dir, tmp_path, capsys):
    directory = _copy(hf_dir, tmp_path)
    (directory / "config.json").unlink()
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(directory)!r}")
    assert code == 2 and "config invalid" in out, out   # was: exit 0, "config valid"
    assert f"ExperimentConfig.hf_path={str(directory)!r}" in out and "no config.json" in out


def test_validate_only_refuses_a_missing_shard_naming_each(hf_dir, tmp_path, capsys):
    directory = _copy(hf_dir, tmp_path)
    shards = _shards(directory)
    (directory / shards[1]).unlink()
    (directory / shards[3]).unlink()
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(directory)!r}")
    assert code == 2 and "config invalid" in out, out   # was: exit 0, "config valid"
    assert f"ExperimentConfig.hf_path={str(directory)!r}" in out and "model.safetensors.index.json" in out
    assert shards[1] in out and shards[3] in out and shards[0] not in out


def test_validate_only_refuses_a_truncated_shard(hf_dir, tmp_path, capsys):
    directory = _copy(hf_dir, tmp_path)
    shard = directory / _shards(directory)[2]
    shard.write_bytes(shard.read_bytes()[:6])   # not even the header's length
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(directory)!r}")
    assert code == 2 and "ExperimentConfig.hf_path" in out and shard.name in out, out   # was: "config valid"


def test_validate_only_refuses_a_missing_single_file_checkpoint(hf_dir, tmp_path, capsys):
    directory = _copy(hf_dir, tmp_path)
    for name in _shards(directory) + ["model.safetensors.index.json"]:
        (directory / name).unlink()
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(directory)!r}")
    assert code == 2 and "model.safetensors" in out and "ExperimentConfig.hf_path" in out, out


def test_validate_only_refuses_a_missing_tokenizer_directory(hf_dir, tasks_file, tmp_path, capsys):
    missing = tmp_path / "no_tokenizer"
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(hf_dir)!r}",
                          f"AgenticRollout.tasks = {str(tasks_file)!r}",
                          f"AgenticRollout.tokenizer_path = {str(missing)!r}", gin=AGENTIC_GIN)
    # was: exit 0 (a tokenizer directory not on this machine was skipped)
    assert code == 2 and f"AgenticRollout.tokenizer_path={str(missing)!r}" in out, out


def test_validate_only_refuses_a_bad_tokenizer_config_naming_the_file(hf_dir, tasks_file, tmp_path, capsys):
    directory = _copy(hf_dir, tmp_path)
    (directory / "tokenizer_config.json").write_text("{'chat_template': ")
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(directory)!r}",
                          f"AgenticRollout.tasks = {str(tasks_file)!r}", gin=AGENTIC_GIN)
    # was: a JSONDecodeError naming no file
    assert code == 2 and "tokenizer_config.json" in out and "not valid JSON" in out, out


def test_validate_only_collects_every_missing_file(hf_dir, tmp_path, capsys):
    directory = _copy(hf_dir, tmp_path)
    shard = _shards(directory)[0]
    (directory / shard).unlink()
    (directory / "tokenizer.json").unlink()
    missing_tasks = tmp_path / "no_tasks.jsonl"
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(directory)!r}",
                          f"AgenticRollout.tasks = {str(missing_tasks)!r}", gin=AGENTIC_GIN)
    assert code == 2, out
    assert shard in out and "tokenizer.json" in out and f"AgenticRollout.tasks={str(missing_tasks)!r}" in out


def test_validate_only_refuses_a_ray_address_that_does_not_resolve(hf_dir, tasks_file, tmp_path, capsys):
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(hf_dir)!r}",
                          f"AgenticRollout.tasks = {str(tasks_file)!r}",
                          "AgenticRollout.environment = @calculator_environment()",
                          "calculator_environment.runner_cfg = @ToolRunnerConfig()",
                          "ToolRunnerConfig.backend = 'ray'",
                          "ToolRunnerConfig.ray_address = 'no-such-host.invalid:6379'", gin=AGENTIC_GIN)
    assert code == 2 and "ToolRunnerConfig.ray_address='no-such-host.invalid:6379'" in out, out
    assert "does not resolve" in out


def test_validate_only_accepts_the_readmes_ray_bindings(hf_dir, tasks_file, tmp_path, capsys):
    """README "Multiple processes": a sandboxed environment's calls on a Ray cluster, by gin."""
    pytest.importorskip("ray")
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(hf_dir)!r}",
                          f"AgenticRollout.tasks = {str(tasks_file)!r}",
                          "AgenticRollout.environment = @code_environment()",
                          "code_environment.runner_cfg = @ToolRunnerConfig()",
                          "ToolRunnerConfig.backend = 'ray'", "ToolRunnerConfig.ray_address = '127.0.0.1:6379'",
                          gin=AGENTIC_GIN)
    assert code == 0, out


def test_validate_only_refuses_the_ray_backend_without_ray(hf_dir, tasks_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)   # as if not installed: `import ray` raises ImportError
    code, out = _validate(tmp_path, capsys, f"ExperimentConfig.hf_path = {str(hf_dir)!r}",
                          f"AgenticRollout.tasks = {str(tasks_file)!r}",
                          "AgenticRollout.environment = @calculator_environment()",
                          "calculator_environment.runner_cfg = @ToolRunnerConfig()",
                          "ToolRunnerConfig.backend = 'ray'", gin=AGENTIC_GIN)
    assert code == 2 and "ToolRunnerConfig.backend='ray'" in out and "sfrrl_jax[ray]" in out, out


def test_a_run_with_a_missing_shard_fails_before_it_starts_naming_it(hf_dir, tmp_path):
    directory = _copy(hf_dir, tmp_path)
    shard = _shards(directory)[-1]
    (directory / shard).unlink()
    gin_file = tmp_path / "job.gin"
    gin_file.write_text(HF_GIN)
    job = gin_bindings.load_job([str(gin_file)], [f"ExperimentConfig.hf_path = {str(directory)!r}",
                                                  f"ExperimentConfig.run_dir = {str(tmp_path / 'run')!r}"])
    with pytest.raises(gin_bindings.PreflightError, match=f"ExperimentConfig.hf_path.*{shard}"):
        gin_bindings.run_job(job, log=lambda line: None)
    assert not (tmp_path / "run").exists()   # nothing started


def test_the_cli_names_a_missing_shard_of_a_real_run_with_exit_2(hf_dir, tmp_path, capsys):
    directory = _copy(hf_dir, tmp_path)
    shard = _shards(directory)[0]
    (directory / shard).unlink()
    gin_file = tmp_path / "job.gin"
    gin_file.write_text(HF_GIN)
    capsys.readouterr()
    code = cli.main([f"--gin_file={gin_file}", f"--run_dir={tmp_path / 'run'}",
                     f"--gin_param=ExperimentConfig.hf_path = {str(directory)!r}"])
    err = capsys.readouterr().err
    assert code == 2 and "config invalid" in err and shard in err, err   # was: a traceback
    assert not (tmp_path / "run").exists()


# -- a parameter bound twice ---------------------------------------------------------------------

def _gin(tmp_path, name, text) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_parameter_bound_twice_in_one_file_is_an_error_naming_both_lines(tmp_path, capsys):
    path = _gin(tmp_path, "twice.gin", Path(STRAGGLERS).read_text() + "\nExperimentConfig.num_steps = 7\n")
    first = next(i for i, line in enumerate(Path(STRAGGLERS).read_text().splitlines(), 1)
                 if line.startswith("ExperimentConfig.num_steps"))
    last = len(Path(path).read_text().splitlines())
    with pytest.raises(gin_bindings.GinConfigError) as e:   # was: num_steps=7, silently
        gin_bindings.load_job([path])
    msg = str(e.value)
    assert "ExperimentConfig.num_steps" in msg and f"twice.gin:{first}" in msg and f"twice.gin:{last}" in msg
    assert cli.main([f"--gin_file={path}", "--validate_only"]) == 2
    assert f"twice.gin:{last}" in capsys.readouterr().err


def test_a_parameter_bound_differently_by_two_files_names_both(tmp_path):
    a = _gin(tmp_path, "a.gin", "Job.kind = 'rl'\nJob.experiment = @ExperimentConfig()\n"
                                "ExperimentConfig.run_dir = '/tmp/x'\nExperimentConfig.seed = 1\n")
    b = _gin(tmp_path, "b.gin", "# b\nsfrrl.ExperimentConfig.seed = 2\n")
    with pytest.raises(gin_bindings.GinConfigError, match=r"ExperimentConfig\.seed.*a\.gin:4.*b\.gin:2"):
        gin_bindings.load_job([a, b])


def test_a_parameter_rebound_by_an_included_file_names_both(tmp_path):
    base = _gin(tmp_path, "base.gin", "Job.kind = 'rl'\nJob.experiment = @ExperimentConfig()\n"
                                      "ExperimentConfig.run_dir = '/tmp/x'\nExperimentConfig.seed = 1\n")
    top = _gin(tmp_path, "top.gin", f"include {base!r}\nExperimentConfig.seed = 3\n")
    with pytest.raises(gin_bindings.GinConfigError, match=r"ExperimentConfig\.seed.*base\.gin:4.*top\.gin:2"):
        gin_bindings.load_job([top])


def test_a_macro_bound_twice_differently_is_an_error(tmp_path):
    path = _gin(tmp_path, "macro.gin", "STEPS = 3\nJob.kind = 'rl'\nJob.experiment = @ExperimentConfig()\n"
                                       "ExperimentConfig.run_dir = '/tmp/x'\nExperimentConfig.num_steps = %STEPS\n"
                                       "STEPS = 4\n")
    with pytest.raises(gin_bindings.GinConfigError, match=r"STEPS.*macro\.gin:1.*macro\.gin:6"):
        gin_bindings.load_job([path])


def test_gin_params_apply_in_order_the_last_one_wins():
    # the CLI's documented order (files, then each --gin_param): a later binding overrides on purpose
    job = gin_bindings.load_job([STRAGGLERS], ["ExperimentConfig.num_steps = 5", "ExperimentConfig.num_steps = 6"])
    assert job.experiment.num_steps == 6


def test_the_same_value_twice_and_a_gin_param_over_a_file_are_fine(tmp_path):
    text = Path(STRAGGLERS).read_text()
    assert "ExperimentConfig.num_steps = 20" in text and "TrainerConfig.buckets = (16, 32, 64)" in text
    # the file's own values bound again (a tuple written another way is the same value)
    path = _gin(tmp_path, "same.gin", text + "\nExperimentConfig.num_steps = 20\nTrainerConfig.buckets = (16,32,64)\n")
    job = gin_bindings.load_job([path], ["ExperimentConfig.num_steps = 50"])   # the README's override
    assert job.experiment.num_steps == 50 and job.experiment.trainer.buckets == (16, 32, 64)
    job = gin_bindings.load_job([STRAGGLERS], ["ExperimentConfig.num_steps = 50", "ExperimentConfig.num_steps = 50"])
    assert job.experiment.num_steps == 50


# -- engine arguments ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _params():
    cfg = TINY.replace(max_seq_len=128)
    return cfg, S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=0)


def _engine():
    cfg, params = _params()
    return Engine(cfg, params, max_slots=2, max_len=64, buckets=(16,))


def _req(tokens=(1, 2, 3), n=3, **kw):
    return GenerationRequest(tokens=list(tokens), max_new_tokens=n, temperature=kw.pop("temperature", 0.0), **kw)


def test_top_k_and_max_new_tokens_past_int32_mean_no_limit():
    # was: OverflowError from np.int32 in SlotRequest.make
    for kw in ({"top_k": 10**12}, {"max_new": 10**12}):
        SlotRequest.make(**kw)
    engine = _engine()

    async def main():
        out = []
        for kw in ({"top_k": 10**12}, {"top_k": None}):
            c = await engine.complete(_req(n=6, temperature=1.0, seed=3, **kw))
            await engine.release(c.slot_handle)
            out.append(c.tokens)
        c = await engine.complete(_req(n=10**12))
        await engine.release(c.slot_handle)
        return out, c
    (huge, off), long = asyncio.run(main())
    assert huge == off   # a k past the vocabulary keeps every token, as no top_k
    assert long.finish_reason == "length" and len(long.tokens) == 64 - 3   # the cache ends it


@pytest.mark.parametrize("kw, named", [
    ({"top_k": -1}, "GenerationRequest.top_k"), ({"top_k": 2.5}, "GenerationRequest.top_k"),
    ({"top_k": True}, "GenerationRequest.top_k"), ({"top_k": "5"}, "GenerationRequest.top_k"),
    ({"temperature": 1e39}, "GenerationRequest.temperature"),
])
def test_bad_sampling_arguments_are_named(kw, named):
    with pytest.raises(ValueError, match=named):
        _req(**kw)


@pytest.mark.parametrize("handle", ["x", object(), 3, (0, 1)], ids=["str", "object", "int", "tuple"])
def test_a_garbage_slot_handle_is_a_named_value_error(handle):
    engine = _engine()

    async def main():
        with pytest.raises(ValueError, match="slot_handle.*Completion.slot_handle"):   # was: AttributeError
            await engine.complete(_req(slot_handle=handle))
        with pytest.raises(ValueError, match="slot_handle"):
            await engine.release(handle)
    asyncio.run(main())
    assert engine.occupancy["queued"] == 0


def test_a_released_or_foreign_slot_handle_is_a_named_value_error():
    one, other = _engine(), _engine()

    async def main():
        c = await one.complete(_req())
        mine = await other.complete(_req())
        assert (c.slot_handle.slot, c.slot_handle.serial) == (mine.slot_handle.slot, mine.slot_handle.serial)
        # was: `other` appended to its own parked trajectory as if the handle were its own
        with pytest.raises(ValueError, match="slot_handle.*another engine"):
            await other.complete(_req([5], slot_handle=c.slot_handle))
        with pytest.raises(ValueError, match="slot_handle.*another engine"):
            await other.release(c.slot_handle)
        await one.release(c.slot_handle)
        with pytest.raises(ValueError, match="slot_handle.*not parked"):
            await one.complete(_req([5], slot_handle=c.slot_handle))
        await one.release(c.slot_handle)   # releasing twice stays harmless (the loop may, after a cancel)
        await other.release(mine.slot_handle)
    asyncio.run(main())
    assert one.occupancy["parked"] == other.occupancy["parked"] == 0


def test_lockstep_release_of_a_garbage_handle_is_named():
    cfg, params = _params()
    engine = LockstepEngine(cfg, params, max_slots=2, max_len=64, buckets=(16,))

    async def main():
        with pytest.raises(ValueError, match="slot_handle"):   # was: AttributeError
            await engine.release("x")
    asyncio.run(main())
