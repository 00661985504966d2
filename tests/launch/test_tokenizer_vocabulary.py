"""A tokenizer with more ids than the model's embedding rows (AgenticRollout's check): allowed
only where the ids past the rows are added special tokens that neither the chat template nor a
stop token writes, as Gemma 3's <image_soft_token> (id 262144) past gemma-3-1b's 262144 rows."""
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from sfrrl_jax.launch.agentic import _check_vocabulary
from sfrrl_jax.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
from hf_tokenizer_fixtures import QWEN3_STYLE_TEMPLATE, build_qwen3_style_tokenizer  # noqa: E402


def _with_token_appended(directory: Path, content: str, special: bool, template: str = QWEN3_STYLE_TEMPLATE):
    directory.mkdir(parents=True, exist_ok=True)
    build_qwen3_style_tokenizer(directory, template)
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rows = hf.get_vocab_size(with_added_tokens=True)
    hf.add_tokens([AddedToken(content, special=special, normalized=False)])
    hf.save(str(directory / "tokenizer.json"))
    tok = load_tokenizer(directory)
    assert tok.vocab_size == rows + 1
    return tok, rows


def test_an_unused_special_token_past_the_rows_is_allowed_and_nothing_else(tmp_path):
    tok, rows = _with_token_appended(tmp_path / "special", "<image_soft_token>", special=True)
    _check_vocabulary(tok, "dir", rows)           # Gemma 3 1B's case
    _check_vocabulary(tok, "dir", rows + 1)
    with pytest.raises(ValueError, match=r"ModelConfig.vocab_size=\d+: .* 1 of them, from id \d+, are not added"):
        _check_vocabulary(tok, "dir", rows - 1)   # a vocabulary token past the rows
    plain, rows = _with_token_appended(tmp_path / "plain", "soft_token_word", special=False)
    with pytest.raises(ValueError, match="not added special tokens"):
        _check_vocabulary(plain, "dir", rows)


def test_a_special_token_past_the_rows_that_the_template_writes_is_refused(tmp_path):
    template = QWEN3_STYLE_TEMPLATE.replace("{% if add_generation_prompt %}<|im_start|>assistant\n",
                                            "{% if add_generation_prompt %}<|im_start|>assistant\n<image_soft_token>")
    assert template != QWEN3_STYLE_TEMPLATE
    tok, rows = _with_token_appended(tmp_path, "<image_soft_token>", special=True, template=template)
    with pytest.raises(ValueError, match=r"writes ids \[\d+\] \(\['<image_soft_token>'\]\) in its chat template"):
        _check_vocabulary(tok, "dir", rows)
