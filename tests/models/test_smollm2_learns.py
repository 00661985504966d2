"""Opt-in (`pytest -m real_model tests`, README "Real models"): SmolLM2-135M-Instruct learns one-digit
arithmetic through `experiments/configs/smollm2_learns.gin` in a reduced form (20 RL steps, a held-out
evaluation before and after only), on two seeds, each run as `experiments/train.py` runs it (its own
process, one CPU device). Measured at 20 steps (lr 1e-5): +20.0 (seed 0) and +14.0 points (seed 1)
from 14.5 % (README has the full recipe's table); here each seed must gain, and the two at least 7
points on average (under half the measured: a margin of over two standard errors of the mean gain on
200 tasks).
About 10 minutes per seed on a 2-core CPU."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_model

REPO = pathlib.Path(__file__).resolve().parents[2]


def _summary(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][len("SUMMARY "):])


def test_smollm2_gains_held_out_success_over_two_seeds(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    gains = []
    for seed in (0, 1):
        run_dir = tmp_path / f"seed{seed}"
        params = [f"ExperimentConfig.seed = {seed}", f"AgentConfig.seed = {seed}", "ExperimentConfig.num_steps = 20",
                  "ExperimentConfig.eval_every = 0", f"RUN_DIR = '{run_dir}'"]
        cmd = [sys.executable, str(REPO / "experiments" / "train.py"),
               f"--gin_file={REPO / 'experiments' / 'configs' / 'smollm2_learns.gin'}"]
        cmd += [f"--gin_param={p}" for p in params]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2400, cwd=REPO)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        summary = _summary(out.stdout)
        assert summary["steps_done"] == 20 and [e["step"] for e in summary["evals"]] == [0, 20]
        assert 0.05 <= summary["success_before"] <= 0.40   # the base model: between 5 % and 40 %
        gains.append(summary["success_gain"])
        assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert min(gains) > 0.0 and sum(gains) / len(gains) >= 0.07, gains
