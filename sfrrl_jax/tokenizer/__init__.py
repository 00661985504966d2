"""Tokenizers: the tiny built-in BPE tokenizer, a loader for HF tokenizer directories, and
`TokenizerProtocol` (what the agent loop and SFT ask of a user's own tokenizer)."""
from sfrrl_jax.tokenizer.builder import TINY_VOCAB_SIZE, build_tiny_tokenizer
from sfrrl_jax.tokenizer.chat_template import COMPACT_CHAT_TEMPLATE, ChatTemplateError
from sfrrl_jax.tokenizer.protocol import TokenizerProtocol
from sfrrl_jax.tokenizer.tokenizer import TemplateDeltaError, Tokenizer, load_tokenizer

__all__ = [
    "COMPACT_CHAT_TEMPLATE", "ChatTemplateError", "TINY_VOCAB_SIZE", "TemplateDeltaError", "Tokenizer",
    "TokenizerProtocol", "build_tiny_tokenizer", "load_tokenizer",
]
