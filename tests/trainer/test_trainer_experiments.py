"""Experiments: gin configs parse and validate, bad bindings are named, kill -9 + --resume is exact."""
import fcntl
import json
import math
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfrrl_jax.launch import cli, gin_bindings
from experiments.recipes.quickstart import QuickstartRecipe
from sfrrl_jax.launch.runner import ExperimentConfig, comparable_metrics, validate_experiment
from sfrrl_jax.trainer.run_logger import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "experiments" / "configs").glob("*.gin"))
TRAIN = REPO / "experiments" / "train.py"

# Tiny and deterministic: one group per step (one micro-step: the gradient sum has one order),
# one_step_off so the carried-over micro-batch must come back from the checkpoint too.
TINY_GIN = """
import sfrrl_jax.testing.workload
Job.kind = 'rl'
Job.experiment = @ExperimentConfig()
ExperimentConfig.model = 'tiny-moe'
ExperimentConfig.model_overrides = {'max_seq_len': 64}
ExperimentConfig.mesh_data = 1
ExperimentConfig.mesh_expert = 2
ExperimentConfig.num_devices = 2
ExperimentConfig.rollout = @WorkloadRollout()
WorkloadRollout.workload = @WorkloadConfig()
ExperimentConfig.trainer = @TrainerConfig()
ExperimentConfig.optimizer = @OptimizerConfig()
ExperimentConfig.num_steps = 6
ExperimentConfig.checkpoint_every = 1
ExperimentConfig.keep_checkpoints = 3
ExperimentConfig.progress_bar = False
ExperimentConfig.tensorboard = False
WorkloadConfig.num_prompts = 3
WorkloadConfig.max_turns = 2
WorkloadConfig.response_median = 4.0
WorkloadConfig.response_sigma = 0.5
WorkloadConfig.max_response = 8
WorkloadConfig.tool_latency_median_s = 0.01
WorkloadConfig.tool_latency_sigma = 0.3
WorkloadConfig.difficulty_sigma = 0.5
WorkloadConfig.redraw_each_replay = True  # resume must restore the replay counts
TrainerConfig.mode = 'one_step_off'
TrainerConfig.groups_per_step = 1
TrainerConfig.group_size = 2
TrainerConfig.max_slots = 2
TrainerConfig.max_len = 64
TrainerConfig.buckets = (16,)
TrainerConfig.seq_bucket = 64
OptimizerConfig.learning_rate = 1e-3
OptimizerConfig.total_steps = 6
"""


# -- configs -------------------------------------------------------------------------------------

def test_every_shipped_gin_parses_and_validates():
    names = {p.name for p in CONFIGS}
    assert gin_bindings.load_job([str(REPO / "experiments/configs/quickstart.gin")]).kind == "quickstart"
    assert {"quickstart.gin", "stragglers.gin", "qwen3_moe_30b_a3b.gin", "gpt_oss_120b_16xh200.gin"} <= names
    seen = {}
    for path in CONFIGS:
        job = gin_bindings.load_job([str(path)])
        exp = job.experiment
        if job.kind == "rl":
            n = exp.num_devices if exp.num_devices is not None else exp.mesh_size
            model = gin_bindings.validate_job(job, num_devices=n)
            assert model.n_experts % exp.mesh_expert == 0
            assert exp.mesh_size == n
            seen[path.name] = (model, exp)
        elif job.kind in ("smollm2_rl", "smollm2_tool_rl"):   # the real model's runs: the 'rl' path after
            exp = job.recipe.experiment                        # converting the weights (and a warm start)
            assert exp.hf_path and exp.rollout.eval_tasks and exp.eval_every and job.run_dir
            assert gin_bindings.validate_job(job) is None
        else:
            assert job.kind == "quickstart" and isinstance(job.recipe, QuickstartRecipe) and job.run_dir
            assert gin_bindings.validate_job(job) is None
        assert "Job.kind" in gin_bindings.operative_config()
    model, exp = seen["gpt_oss_120b_16xh200.gin"]
    assert model.name == "gpt-oss-120b" and model.n_experts == 128 and exp.num_devices == 16
    assert (exp.mesh_data, exp.mesh_expert, exp.mesh_tensor) == (2, 8, 1) and exp.hf_path
    model, exp = seen["qwen3_moe_30b_a3b.gin"]
    assert model.name == "qwen3-moe-30b-a3b" and model.n_experts == 128 and exp.hf_path
    # the real configs train agentic RL on real task sets (the workload stays for benchmarks)
    from sfrrl_jax.launch.agentic import AgenticRollout
    from sfrrl_jax.testing.workload import WorkloadRollout
    for name, (model, exp) in seen.items():
        assert isinstance(exp.rollout, WorkloadRollout) == (name == "stragglers.gin"), name
        if name != "stragglers.gin":
            assert isinstance(exp.rollout, AgenticRollout) and exp.rollout.tasks, name
    # the validation is real: the same config on a mesh that does not fit is refused, by name
    with pytest.raises(ValueError, match=r"n_experts=128 \(gpt-oss-120b\) is not divisible by ExperimentConfig.mesh_expert=3"):
        validate_experiment(ExperimentConfig(run_dir="/x", model="gpt-oss-120b", mesh_expert=3), num_devices=3)
    with pytest.raises(ValueError, match="= 16 devices, but the run has 8"):
        gin_bindings.validate_job(gin_bindings.load_job([str(REPO / "experiments/configs/gpt_oss_120b_16xh200.gin")]),
                                  num_devices=8)


@pytest.mark.parametrize("binding, named", [
    ("TrainerConfig.moed = 'sync'", "'moed'"),                      # misspelt parameter
    ("TrainerConfg.mode = 'sync'", "'TrainerConfg'"),               # misspelt configurable
    ("ExperimentConfig.trainer = @TrainerConfg()", "'@TrainerConfg()'"),  # misspelt reference
])
def test_misspelt_binding_fails_naming_it(binding, named, capsys):
    files = [str(REPO / "experiments/configs/stragglers.gin")]
    with pytest.raises(gin_bindings.GinConfigError) as e:
        gin_bindings.load_job(files, [binding])
    assert named in str(e.value) and binding.split(" =")[0].split(".")[0] in str(e.value)
    assert cli.main([f"--gin_file={files[0]}", f"--gin_param={binding}", "--validate_only"]) == 2
    assert named in capsys.readouterr().err


def test_misspelt_binding_in_a_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("Job.kind = 'rl'\nJob.experiment = @ExperimentConfig()\nExperimentConfig.num_step = 3\n")
    with pytest.raises(gin_bindings.GinConfigError, match=r"(?s)'num_step'.*bad\.gin.*line 3"):
        gin_bindings.load_job([str(bad)])
    with pytest.raises(gin_bindings.GinConfigError, match="Job.kind='train'; valid: \\['rl', 'quickstart', 'smollm2_rl', 'smollm2_tool_rl'\\]"):
        gin_bindings.load_job([str(REPO / "experiments/configs/stragglers.gin")], ["Job.kind = 'train'"])


# -- kill -9, resume, truncated checkpoint -------------------------------------------------------

def _env(cache_dir):
    env = dict(os.environ)
    env.update({
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
        # Compiled executables are shared by the runs below, so only the first one compiles.
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "PYTHONWARNINGS": "default",
    })
    return env


def _cmd(gin_file, run_dir, *extra):
    return [sys.executable, str(TRAIN), f"--gin_file={gin_file}", f"--run_dir={run_dir}", *extra]


def _run(cmd, env, timeout=600):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stderr[-4000:]}"
    summary = [line for line in out.stdout.splitlines() if line.startswith("SUMMARY ")]
    return json.loads(summary[-1][len("SUMMARY "):]), out.stderr


def _same(a, b) -> bool:
    # Counts, token totals and rewards repeat exactly. A float metric may differ in its last bits:
    # the pipelined engine's decode batches (which slots step together, the live-cache bucket)
    # depend on timing, and XLA:CPU rounds a row's log-probs differently in a different batch
    # (train/mismatch once differed at 1e-6 relative); a lost or doubled step differs far more.
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    return a == b


def _assert_rows_equal(got_rows, want_rows, steps):
    got = {r["step"]: comparable_metrics(r) for r in got_rows}
    want = {r["step"]: comparable_metrics(r) for r in want_rows}
    for s in steps:
        keys = set(got[s]) | set(want[s])
        differ = {k: (got[s].get(k), want[s].get(k)) for k in keys if not _same(got[s].get(k), want[s].get(k))}
        assert not differ, (s, differ)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # pytest-xdist may give this module's tests to several workers, each with its own module
    # fixture: the uninterrupted run (and the compile cache) lives in the session's shared temp
    # dir, the first worker here runs it, the others wait on the lock and read its outputs
    # (one run per session, not one per worker; every test writes only to its own run dir)
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "experiments"
    root.mkdir(exist_ok=True)
    gin_file = root / "tiny.gin"
    env = _env(root / "jax_cache")
    with open(root / "full.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            done = root / "full.json"
            if not done.exists():
                gin_file.write_text(TINY_GIN)
                t0 = time.perf_counter()
                full, _ = _run(_cmd(gin_file, root / "full"), env)
                done.write_text(json.dumps({"full": full, "full_s": time.perf_counter() - t0}))
            record = json.loads(done.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return {"root": root, "gin": gin_file, "env": env, "full": record["full"], "full_dir": root / "full",
            "full_s": record["full_s"]}


def test_uninterrupted_run_writes_metrics_checkpoints_and_operative_config(runs):
    full, run_dir = runs["full"], runs["full_dir"]
    assert full["steps_done"] == 6 and full["start_step"] == 0 and full["resumed_from"] is None
    assert full["checkpoints"] == [4, 5, 6]   # keep_checkpoints=3
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["checkpoint/blocking_s"] > 0 and r["checkpoint/step"] == r["step"] + 1 for r in rows)
    assert any("checkpoint/total_s" in r for r in rows)   # async: reported once written
    assert [s["step"] for s in full["checkpoint_saves"]] == [1, 2, 3, 4, 5, 6]
    assert all(s["total_s"] >= s["blocking_s"] > 0 for s in full["checkpoint_saves"])
    assert rows[0]["train/microsteps"] == 0 and rows[1]["train/microsteps"] == 1   # one_step_off
    # gin wraps long bindings with a backslash continuation (long tmp paths under xdist)
    operative = re.sub(r"\\\n\s*", "", (run_dir / "operative_config.gin").read_text())
    assert "TrainerConfig.mode = 'one_step_off'" in operative
    assert f"ExperimentConfig.run_dir = '{run_dir}'" in operative
    assert (run_dir / "busy_idle.png").stat().st_size > 1000 and (run_dir / "summary.json").exists()


def test_kill_9_mid_run_then_resume_repeats_the_uninterrupted_metrics(runs):
    run_dir, env = runs["root"] / "killed", runs["env"]
    proc = subprocess.Popen(_cmd(runs["gin"], run_dir), env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (run_dir / "checkpoints" / "2").is_dir():
            assert proc.poll() is None, "the run ended before checkpoint 2 appeared"
            assert time.time() < deadline, "no checkpoint 2 after 300 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_rows = read_metrics(run_dir)
    assert len(killed_rows) < 6, "the run had finished before the kill"

    resumed, _ = _run(_cmd(runs["gin"], run_dir, "--resume"), env)
    start = resumed["resumed_from"]
    assert start is not None and 2 <= start < 6 and resumed["start_step"] == start
    assert resumed["steps_done"] == 6
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(6))   # every step once, none lost or doubled
    _assert_rows_equal(rows, read_metrics(runs["full_dir"]), range(6))
    assert rows[start]["train/microsteps"] == 1          # the carried-over batch came back


def test_truncated_latest_checkpoint_resumes_from_the_previous_with_a_warning(runs):
    import shutil
    run_dir = runs["root"] / "truncated"
    shutil.copytree(runs["full_dir"], run_dir)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_metrics(runs["full_dir"])[:5]))
    step6 = run_dir / "checkpoints" / "6"
    biggest = max((p for p in step6.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    resumed, stderr = _run(_cmd(runs["gin"], run_dir, "--resume"), runs["env"])
    assert "cannot restore checkpoint step 6" in stderr and "falling back to step 5" in stderr
    assert resumed["resumed_from"] == 5 and resumed["steps_done"] == 6
    assert (run_dir / "checkpoints" / "6.damaged").is_dir()
    assert 6 in resumed["checkpoints"]                     # step 6 saved again
    _assert_rows_equal(read_metrics(run_dir), read_metrics(runs["full_dir"]), range(6))


def test_resume_with_a_changed_config_is_refused_naming_the_field(runs):
    run_dir = runs["root"] / "changed"
    import shutil
    shutil.copytree(runs["full_dir"] / "checkpoints", run_dir / "checkpoints")
    out = subprocess.run(_cmd(runs["gin"], run_dir, "--resume", "--gin_param=OptimizerConfig.learning_rate = 2e-3",
                              "--gin_param=ExperimentConfig.num_steps = 7"),
                         env=runs["env"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode != 0
    assert "optimizer.learning_rate: checkpoint 0.001, now 0.002" in out.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_saves_the_current_step_and_exits(runs, signum):
    """SIGTERM, and a real Ctrl-C (SIGINT): the step ends, a checkpoint is saved, exit 128+signal.
    User code's own SystemExit / KeyboardInterrupt are a sample's errors (issue #48); a signal to
    the process still stops the run the documented way."""
    run_dir = runs["root"] / f"signal{int(signum)}"
    # checkpoint_every=0: the only checkpoint is the one the signal causes
    proc = subprocess.Popen(_cmd(runs["gin"], run_dir, "--gin_param=ExperimentConfig.checkpoint_every = 0"),
                            env=runs["env"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, "no metrics row appeared"
            time.sleep(0.02)
        os.kill(proc.pid, signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr[-3000:]
    summary = json.loads([x for x in stdout.splitlines() if x.startswith("SUMMARY ")][-1][8:])
    done = summary["steps_done"]
    assert summary["stopped_by_signal"] == signum and 1 <= done < 6
    assert summary["checkpoints"] == [done] and (run_dir / "checkpoints" / str(done)).is_dir()
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(done))


def test_a_run_names_its_rollout():
    # No synthetic default: a config without a rollout is refused at validation, naming both factories;
    # the old 'workload' string is refused at construction with its replacement.
    with pytest.raises(ValueError, match=r"ExperimentConfig.rollout is not set.*@AgenticRollout\(\).*@WorkloadRollout\(\)"):
        validate_experiment(ExperimentConfig(run_dir="/x", model="tiny-moe"), num_devices=1)
    with pytest.raises(ValueError, match=r"ExperimentConfig.rollout='workload' is not a rollout factory.*@WorkloadRollout\(\)"):
        ExperimentConfig(run_dir="/x", rollout="workload")
    from sfrrl_jax.testing.workload import WorkloadConfig, WorkloadRollout
    with pytest.raises(ValueError, match=r"WorkloadConfig.vocab_size=100000 > ModelConfig.vocab_size"):
        validate_experiment(ExperimentConfig(run_dir="/x", model="tiny-moe",
                                             rollout=WorkloadRollout(WorkloadConfig(vocab_size=100000))), num_devices=1)


def test_per_layer_params_run_as_the_stacked_one(runs):
    """ModelConfig.scan_layers=False (one array per layer's weight, the layers unrolled in the engine
    and the train step): the same run as the stacked layout's, metric for metric (the same function of
    the same params, summed in XLA's orders), writing its checkpoints (their restore:
    tests/models/test_layer_layout.py)."""
    run_dir = runs["root"] / "per_layer"
    layout = "--gin_param=ExperimentConfig.model_overrides = {'max_seq_len': 64, 'scan_layers': False}"
    done, _ = _run(_cmd(runs["gin"], run_dir, layout, "--gin_param=ExperimentConfig.num_steps = 2"), runs["env"])
    assert done["steps_done"] == 2 and done["checkpoints"] == [1, 2]
    _assert_rows_equal(read_metrics(run_dir), read_metrics(runs["full_dir"]), range(2))
