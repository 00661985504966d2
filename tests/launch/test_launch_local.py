"""experiments/launch_local.py: N processes of one command under jax.distributed's environment."""
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "experiments" / "launch_local.py"


def _launch(*args, timeout=180):
    return subprocess.run([sys.executable, str(LAUNCH), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def test_two_processes_join_one_run_and_validate_its_config():
    out = _launch("--num_processes", "2", "--cpu_devices", "4", "--", sys.executable, "experiments/train.py",
                  "--gin_file=experiments/configs/stragglers.gin", "--gin_param=ExperimentConfig.mesh_data=2",
                  "--gin_param=ExperimentConfig.mesh_expert=4", "--validate_only")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for p in range(2):   # both joined: each sees the 8 global devices the 2 x 4 mesh needs
        assert f"[p{p}] sfrrl-train: config valid (rl, model tiny-moe, process {p} of 2)" in out.stdout


# A tiny run of the straggler workload (pipelined, tool-bound), small enough for CPU collectives.
TINY = ["--gin_file=experiments/configs/stragglers.gin", "--gin_param=ExperimentConfig.mesh_data=2",
        "--gin_param=ExperimentConfig.mesh_expert=4", "--gin_param=TrainerConfig.early_groups=0",
        "--gin_param=ExperimentConfig.checkpoint_every=1", "--gin_param=ExperimentConfig.progress_bar=False",
        "--gin_param=ExperimentConfig.model_overrides={'max_seq_len': 128}",
        "--gin_param=WorkloadConfig.num_prompts=4", "--gin_param=WorkloadConfig.max_turns=2",
        "--gin_param=WorkloadConfig.max_response=16", "--gin_param=WorkloadConfig.response_median=4.0",
        "--gin_param=WorkloadConfig.tool_latency_median_s=0.01", "--gin_param=TrainerConfig.groups_per_step=2",
        "--gin_param=TrainerConfig.group_size=2", "--gin_param=TrainerConfig.max_len=128",
        "--gin_param=TrainerConfig.buckets=(16, 32)", "--gin_param=TrainerConfig.seq_bucket=32"]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_train_checkpoint_and_resume_what_one_process_trains(tmp_path):
    """sfrrl-train as 2 processes x 4 devices: 1 step, then --resume to 2 (from the checkpoint the
    2 processes wrote); both rows match 1 process x 8 devices training 2 steps straight."""
    train = [sys.executable, "experiments/train.py", *TINY]
    one = subprocess.Popen(train + ["--cpu_devices", "8", "--gin_param=ExperimentConfig.num_steps=2",
                                    f"--run_dir={tmp_path / 'one'}"], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    two = ["--num_processes", "2", "--cpu_devices", "4", "--", *train, f"--run_dir={tmp_path / 'two'}"]
    out = _launch(*two, "--gin_param=ExperimentConfig.num_steps=1", timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    out = _launch(*two, "--gin_param=ExperimentConfig.num_steps=2", "--resume", timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "[p0] resumed from checkpoint step 1" in out.stdout and "[p1] resumed from checkpoint step 1" in out.stdout
    log = one.communicate(timeout=400)[0]
    assert one.returncode == 0, log[-4000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["resumed_from"] == 1 and summary["steps_done"] == 2 and summary["devices"] == 8
    got, want = _rows(tmp_path / "two"), _rows(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1]   # metrics written once
    for a, b in zip(got, want):
        for k in ("rollout/generated_tokens", "train/trained_tokens", "policy/on_policy_fraction"):
            assert a[k] == b[k], k
        assert abs(a["reward/mean"] - b["reward/mean"]) <= 1e-6
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5   # pipelined: gradient sums add in another order
    assert got[1]["time/hidden_train_share"] > 0   # micro-steps ran in the engine's idle ticks


def test_a_failing_process_stops_the_others_and_its_status_is_returned():
    code = ("import os, sys, time\n"
            "p = int(os.environ['JAX_PROCESS_ID'])\n"
            "assert os.environ['JAX_NUM_PROCESSES'] == '3' and os.environ['JAX_COORDINATOR_ADDRESS'].startswith('localhost:')\n"
            "print('up', p, flush=True)\n"
            "time.sleep(0.5)\n"
            "sys.exit(5) if p == 1 else time.sleep(120)\n")
    t0 = time.monotonic()
    out = _launch("--num_processes", "3", "--grace_s", "2", "--", sys.executable, "-c", code)
    assert out.returncode == 5, out.stdout + out.stderr
    assert time.monotonic() - t0 < 60           # the sleepers were stopped, not waited for
    assert all(f"[p{p}] up {p}" in out.stdout for p in range(3))
    assert _launch("--num_processes", "2").returncode == 2   # no command
