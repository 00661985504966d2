"""Silent trouble in runs and configs (issue #24 D): each attack as it was tried, through
`cli.main([...])`, `gin_bindings.load_job` or the request/config constructors. Each must end in a
clear error naming what is wrong (binding, field, step, tensor) and lose nothing on disk.

One tiny real run (1 step, 8 fake devices, in process) backs the run-dir attacks; the attacks
themselves fail before anything compiles.
"""
import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from sfrrl_jax.launch import cli, gin_bindings
from sfrrl_jax.agents.protocols import GenerationRequest
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.slot_state import SlotRequest
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.checkpoints.orbax_store import Checkpointer
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import shared_train_step
from sfrrl_jax.trainer.run_logger import read_metrics
from sfrrl_jax.launch.runner import ExperimentConfig, abstract_params_and_opt_state, validate_experiment
from sfrrl_jax.testing.workload import WorkloadConfig

REPO = Path(__file__).resolve().parents[2]
STRAGGLERS = str(REPO / "experiments/configs/stragglers.gin")

# The smallest run: one group of two one-turn samples, one step, on the 8 devices conftest gives.
# It binds no ExperimentConfig.loss, so LossConfig bindings are unused here.
TINY_GIN = """
import sfrrl_jax.testing.workload
Job.kind = 'rl'
Job.experiment = @ExperimentConfig()
ExperimentConfig.model = 'tiny-moe'
ExperimentConfig.model_overrides = {'max_seq_len': 64, 'n_layers': 1}
ExperimentConfig.mesh_expert = 8
ExperimentConfig.num_devices = 8
ExperimentConfig.rollout = @WorkloadRollout()
WorkloadRollout.workload = @WorkloadConfig()
ExperimentConfig.trainer = @TrainerConfig()
ExperimentConfig.num_steps = 1
ExperimentConfig.checkpoint_every = 1
ExperimentConfig.async_checkpoint = False
ExperimentConfig.progress_bar = False
ExperimentConfig.tensorboard = False
WorkloadConfig.num_prompts = 2
WorkloadConfig.max_turns = 1
WorkloadConfig.response_median = 3.0
WorkloadConfig.max_response = 4
TrainerConfig.mode = 'sync'
TrainerConfig.groups_per_step = 1
TrainerConfig.group_size = 2
TrainerConfig.max_slots = 2
TrainerConfig.max_len = 32
TrainerConfig.buckets = (16,)
TrainerConfig.seq_bucket = 32
"""


@pytest.fixture(scope="module")
def tiny_gin(tmp_path_factory):
    path = tmp_path_factory.mktemp("gin") / "tiny.gin"
    path.write_text(TINY_GIN)
    return str(path)


@pytest.fixture(scope="module")
def done_run(tiny_gin, tmp_path_factory):
    """A finished 1-step run. It is started with --resume in a new dir holding a stray metrics row
    (an attempt killed before its first save): no checkpoint, so it starts at step 0, says so and
    drops that row rather than logging step 0 twice."""
    run_dir = tmp_path_factory.mktemp("runs") / "done"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "stale": 1}) + "\n")
    assert cli.main([f"--gin_file={tiny_gin}", f"--run_dir={run_dir}", "--resume"]) == 0
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0] and "stale" not in rows[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1"]
    return run_dir


def _snapshot(run_dir: Path) -> dict:
    """Every file under the run dir with its bytes: what an attack must leave untouched."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


# -- run dirs ------------------------------------------------------------------------------------

def test_resume_with_every_checkpoint_damaged_exits_3_naming_each_step(done_run, tiny_gin, tmp_path, capsys):
    run_dir = _copy(done_run, tmp_path)
    # a second finished step, then both damaged: the state item of one, the host item of the other
    shutil.copytree(run_dir / "checkpoints" / "1", run_dir / "checkpoints" / "2")
    shutil.rmtree(run_dir / "checkpoints" / "1" / "state")
    shutil.rmtree(run_dir / "checkpoints" / "2" / "host")
    before = _snapshot(run_dir)
    capsys.readouterr()
    code = cli.main([f"--gin_file={tiny_gin}", f"--run_dir={run_dir}", "--resume",
                     "--gin_param=ExperimentConfig.num_steps = 3"])
    err = capsys.readouterr().err
    assert code == 3, err   # was: exit 0 from step 0, every metrics row twice
    assert "NoRestorableCheckpointError" in err and str(run_dir / "checkpoints") in err
    assert "step 2: file host/" in err and "step 1: file state/" in err and "is missing" in err
    assert _snapshot(run_dir) == before   # no row appended, nothing quarantined, config not rewritten


def test_new_run_in_an_old_run_dir_is_refused_naming_dir_and_ways_out(done_run, tiny_gin, tmp_path, capsys):
    run_dir = _copy(done_run, tmp_path)
    before = _snapshot(run_dir)
    capsys.readouterr()
    code = cli.main([f"--gin_file={tiny_gin}", f"--run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 3, err   # was: duplicate rows appended, then a crash at the first save
    assert f"ExperimentConfig.run_dir={str(run_dir)!r} already holds an earlier run" in err
    assert "metrics.jsonl" in err and "checkpoints/ (1)" in err
    assert "--resume" in err and "new or empty --run_dir" in err
    assert _snapshot(run_dir) == before


def test_nan_weights_in_a_checkpoint_are_named_at_resume(done_run, tiny_gin, tmp_path, capsys):
    run_dir = _copy(done_run, tmp_path)
    cfg = gin_bindings.load_job([tiny_gin], [f"ExperimentConfig.run_dir = '{run_dir}'"]).experiment
    model_cfg = validate_experiment(cfg)
    mesh = make_mesh(data=cfg.mesh_data, expert=cfg.mesh_expert, tensor=cfg.mesh_tensor, context=cfg.mesh_context)
    abstract = dict(zip(("params", "opt_state"), abstract_params_and_opt_state(
        model_cfg, mesh, cfg.optimizer, shared_train_step(model_cfg, cfg.loss, cfg.optimizer))))
    ckpt = Checkpointer(run_dir / "checkpoints", save_every=1, async_save=False)
    state, host = ckpt.restore(1, abstract)
    ckpt.close()
    emb = state["params"]["embed"]["embedding"]
    state["params"]["embed"]["embedding"] = jax.device_put(emb.at[3, 5].set(np.nan), emb.sharding)
    shutil.rmtree(run_dir / "checkpoints" / "1")
    with Checkpointer(run_dir / "checkpoints", save_every=1, async_save=False) as ckpt:
        assert ckpt.maybe_save(1, state, host)    # a checkpoint that holds nan weights
    before = _snapshot(run_dir)
    capsys.readouterr()
    code = cli.main([f"--gin_file={tiny_gin}", f"--run_dir={run_dir}", "--resume",
                     "--gin_param=ExperimentConfig.num_steps = 2"])
    err = capsys.readouterr().err
    assert code == 3, err   # was: every update skipped, exit 0
    # nan weights are damage like any other (issue #48): with no intact older step, none restores
    assert "NoRestorableCheckpointError" in err and "step 1: holds nan/inf in params.embed.embedding" in err
    assert "opt_state" not in err
    assert _snapshot(run_dir) == before


# -- gin bindings --------------------------------------------------------------------------------

def test_binding_for_an_unreferenced_configurable_fails_validate_only(tiny_gin, tmp_path, capsys):
    # was: the invalid value was dropped silently and --validate_only said "config valid"
    code = cli.main([f"--gin_file={tiny_gin}", f"--run_dir={tmp_path}", "--gin_param=LossConfig.policy_loss = 'ppoo'",
                     "--validate_only"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "never uses" in err and "LossConfig.policy_loss (no LossConfig is built: no binding refers to " \
                                    "@LossConfig())" in err
    # a valid value is just as unused; scopes and macros nothing refers to too, each named
    with pytest.raises(gin_bindings.GinConfigError) as e:
        gin_bindings.load_job([tiny_gin], [f"ExperimentConfig.run_dir = '{tmp_path}'",
                                           "AdvantageConfig.estimator = 'rloo'", "LR = 0.1",
                                           "eval/TrainerConfig.mode = 'pipelined'"])
    msg = str(e.value)
    assert "AdvantageConfig.estimator (no AdvantageConfig is built" in msg
    assert "macro LR (nothing refers to %LR)" in msg
    assert "eval/TrainerConfig.mode (no TrainerConfig is built in scope 'eval')" in msg


def test_invalid_value_in_a_referenced_binding_still_fails_validate_only(capsys):
    code = cli.main([f"--gin_file={STRAGGLERS}", "--gin_param=LossConfig.policy_loss = 'ppoo'", "--validate_only"])
    assert code == 2 and "LossConfig.policy_loss='ppoo'; valid: ['ppo', 'gspo']" in capsys.readouterr().err


def test_cli_run_dir_and_resume_are_not_unused_bindings_of_a_quickstart_job(tmp_path, capsys):
    # --run_dir / --resume bind ExperimentConfig fields, which a quickstart Job never builds
    code = cli.main([f"--gin_file={REPO / 'experiments/configs/quickstart.gin'}", f"--run_dir={tmp_path}",
                     "--resume", "--validate_only"])
    assert code == 0, capsys.readouterr().err


# -- types and ranges ----------------------------------------------------------------------------

@pytest.mark.parametrize("binding, named", [
    ("ExperimentConfig.seed = -5", "ExperimentConfig.seed must be in [0, 4294967295], got -5"),
    ("ExperimentConfig.model_overrides = {'max_seq_len': '128'}",
     "ModelConfig.max_seq_len must be an int >= 1, got '128' (str)"),
    ("TrainerConfig.max_len = '128'", "TrainerConfig.max_len must be an int >= 1, got '128' (str)"),
    ("WorkloadConfig.tool_latency_median_s = -0.05", "WorkloadConfig.tool_latency_median_s must be > 0, got -0.05"),
    ("ExperimentConfig.checkpoint_every = True",
     "ExperimentConfig.checkpoint_every must be an int >= 0, got True (bool)"),
    ("TrainerConfig.longest_first = 'no'", "TrainerConfig.longest_first must be True or False, got 'no' (str)"),
])
def test_wrong_type_or_range_fails_validate_only_naming_the_field(tiny_gin, binding, named, tmp_path, capsys):
    code = cli.main([f"--gin_file={tiny_gin}", f"--run_dir={tmp_path}", f"--gin_param={binding}", "--validate_only"])
    assert code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("make, named", [
    (lambda: WorkloadConfig(tool_latency_sigma=math.nan), "WorkloadConfig.tool_latency_sigma must be >= 0 and finite"),
    (lambda: WorkloadConfig(tool_latency_median_s=0.0), "WorkloadConfig.tool_latency_median_s must be > 0, got 0.0"),
    (lambda: WorkloadConfig(max_tool_latency_s=math.inf), "WorkloadConfig.max_tool_latency_s must be >= 0 and finite"),
    (lambda: WorkloadConfig(seed=-1), "WorkloadConfig.seed must be in [0, 4294967295]"),
    (lambda: LossConfig(kl_coef=math.nan), "LossConfig.kl_coef must be >= 0 and finite, got nan"),
    (lambda: TrainerConfig(seed=-5), "TrainerConfig.seed must be in [0, 4294967295], got -5"),
    (lambda: TrainerConfig(buckets=(16, "32")), "TrainerConfig.buckets[1] must be an int >= 1, got '32' (str)"),
    (lambda: TrainerConfig(max_len=64, decode_buckets=(32, 128)),
     "TrainerConfig.decode_buckets[1] must be in [1, 64], got 128"),
    (lambda: ExperimentConfig(run_dir="/x", num_devices=True), "ExperimentConfig.num_devices must be an int >= 1 "
                                                               "or None, got True (bool)"),
    (lambda: ModelConfig.preset("tiny-moe", rms_eps=math.nan), "ModelConfig.rms_eps must be > 0 and finite"),
    (lambda: ExperimentConfig(run_dir="/x", mesh_context=0), "ExperimentConfig.mesh_context must be >= 1, got 0"),
    (lambda: ExperimentConfig(run_dir="/x", mesh_data=2, mesh_context=4, num_devices=4),
     "mesh_data=2 x mesh_expert=1 x mesh_context=4 x mesh_tensor=1 = 8, but num_devices=4"),
])
def test_nan_negative_and_mistyped_config_values_are_named(make, named):
    with pytest.raises(ValueError) as e:
        make()
    assert named in str(e.value)


# -- sampling settings ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw, named", [
    (dict(temperature=math.nan), "temperature must be >= 0 and finite, got nan"),
    (dict(temperature=math.inf), "temperature must be >= 0 and finite, got inf"),
    (dict(top_p=math.nan), "top_p must be in (0, 1] and finite, got nan"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_k=-1), "top_k must be >= 0, got -1"),
    (dict(top_k=2.5), "top_k must be an int >= 0"),
    (dict(seed=-5), "seed must be in [0, 4294967295], got -5"),
])
def test_nan_or_out_of_range_sampling_settings_are_named(kw, named):
    # was: a nan temperature decoded with nan logprobs
    with pytest.raises(ValueError) as e:
        GenerationRequest(tokens=[1, 2], max_new_tokens=4, **kw)
    assert "GenerationRequest." + named in str(e.value)
    slot_kw = {"max_new": 4, **kw}
    with pytest.raises(ValueError) as e:
        SlotRequest.make(**slot_kw)
    assert named in str(e.value)
