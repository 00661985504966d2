"""Build the tiny byte-level BPE tokenizer (<= 512 tokens incl. specials) as a standard HF directory."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sfrrl_jax.tokenizer.chat_template import BOS, COMPACT_CHAT_TEMPLATE, END, EOS, PAD, SPECIAL_TOKENS
from sfrrl_jax.tokenizer.corpus import build_corpus

TINY_VOCAB_SIZE = 512


def build_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = TINY_VOCAB_SIZE) -> Path:
    """Train the tokenizer on the built-in corpus and write tokenizer.json + tokenizer_config.json.

    Deterministic: the same `vocab_size` always yields byte-identical files. Special tokens take
    ids 0..len(SPECIAL_TOKENS)-1 (pad = 0), then the 256 byte symbols, then merges.

    Args:
      path: the output directory (created if needed).
      vocab_size: the vocabulary size, specials included: above `len(SPECIAL_TOKENS) + 256`, at most
        `TINY_VOCAB_SIZE` (512, the default).
    Returns:
      `path`, as a `Path`: a standard HF tokenizer directory (`load_tokenizer` reads it).
    Raises:
      ValueError: when `vocab_size` is out of that range.
    """
    if not len(SPECIAL_TOKENS) + 256 < vocab_size <= TINY_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in ({len(SPECIAL_TOKENS) + 256}, {TINY_VOCAB_SIZE}], got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "end_of_turn_token": END,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 8192,
        "chat_template": COMPACT_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
