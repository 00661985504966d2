"""Tokenizers: the tiny built-in BPE tokenizer and a loader for HF tokenizer directories."""
from sfrrl_jax.tokenizer.builder import TINY_VOCAB_SIZE, build_tiny_tokenizer
from sfrrl_jax.tokenizer.chat_template import COMPACT_CHAT_TEMPLATE, ChatTemplateError
from sfrrl_jax.tokenizer.tokenizer import TemplateDeltaError, Tokenizer, load_tokenizer

__all__ = [
    "COMPACT_CHAT_TEMPLATE", "ChatTemplateError", "TINY_VOCAB_SIZE", "TemplateDeltaError", "Tokenizer",
    "build_tiny_tokenizer", "load_tokenizer",
]
