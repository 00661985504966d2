"""experiments/launch_local.py: N processes of one command under jax.distributed's environment."""
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
    # training across processes is refused by name, not left to hang
    out = _launch("--num_processes", "2", "--cpu_devices", "4", "--", sys.executable, "experiments/train.py",
                  "--gin_file=experiments/configs/stragglers.gin")
    assert out.returncode == 2 and "training as 2 processes is not built yet" in out.stdout


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
