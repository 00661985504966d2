"""`sfrrl_jax.generate`: batch generation for notebooks, over the continuous-batching engine."""
from __future__ import annotations

import asyncio

from sfrrl_jax.aio import run_sync
from typing import Sequence

from sfrrl_jax.checks import check_int, check_seed
from sfrrl_jax.engine.types import Completion, GenerationRequest
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.driver import Engine


def generate(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, stop_token_ids: Sequence[int] = (), max_slots: int = 8,
             max_len: int | None = None, decode_steps: int = 4) -> list[Completion]:
    """Completions for token-id prompts, in prompt order (`.tokens`, `.logprobs`,
    `.raw_logprobs`, `.finish_reason`). Request i uses seed `seed + i`."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be a list of token-id sequences, got text: tokenize it first")
    if not prompts:
        return []
    # used in arithmetic below before any request checks them: named here, not a TypeError
    check_int("max_new_tokens", max_new_tokens, 1)
    check_seed("seed", seed)
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompts[{i}] is text ({p[:40]!r}), not token ids: tokenize it first")
    longest = max(len(p) for p in prompts)
    # Rounded up to a power of two so calls of similar sizes share compilations.
    max_len = max_len or min(cfg.max_seq_len, 1 << (longest + max_new_tokens).bit_length())
    engine = Engine(cfg, params, max_slots=max_slots, max_len=max_len, decode_steps=decode_steps)

    async def run_all():
        reqs = [GenerationRequest(tokens=list(p), max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=seed + i,
                                  stop_token_ids=tuple(stop_token_ids)) for i, p in enumerate(prompts)]

        async def one(r):
            c = await engine.complete(r)
            await engine.release(c.slot_handle)
            return c
        return await asyncio.gather(*(one(r) for r in reqs))

    try:
        return list(run_sync(run_all()))
    finally:
        engine.release_memory()
