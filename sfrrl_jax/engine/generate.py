"""`sfrrl_jax.generate`: batch generation for notebooks, over the continuous-batching engine."""
from __future__ import annotations

import asyncio
import functools
import warnings
from typing import TYPE_CHECKING, Callable, Sequence

from sfrrl_jax.aio import run_sync

from sfrrl_jax.checks import check_int, check_seed
from sfrrl_jax.generation_types import Completion, GenerationRequest
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.driver import Engine
from sfrrl_jax.mesh import memory_limit

if TYPE_CHECKING:
    from sfrrl_jax.models.transformer import Params

# Share of the device's (CPU: the host's available) memory a `generate` call's KV cache may take
# by default: the params and the activations need the rest.
DEFAULT_KV_SHARE = 0.5


def _budget(kv_budget_bytes: float | None) -> float:
    if kv_budget_bytes is not None:
        return float(kv_budget_bytes)
    limit, _ = memory_limit()
    return DEFAULT_KV_SHARE * limit


def slots_within_budget(bytes_per_slot: float, wanted: int, kv_budget_bytes: float | None = None) -> int:
    """How many of `wanted` slots of `bytes_per_slot` KV cache each fit the budget (at least 1).

    Args:
      bytes_per_slot: one slot's KV cache (keys and values, every layer), bytes.
      wanted: the slots asked for.
      kv_budget_bytes: the budget (None: `DEFAULT_KV_SHARE` of `mesh.memory_limit()`).
    """
    return max(1, min(wanted, int(_budget(kv_budget_bytes) // max(bytes_per_slot, 1.0))))


def fit_slots_to_budget(engine: Engine, build: Callable[..., Engine], who: str,
                        kv_budget_bytes: float | None = None, stacklevel: int = 3) -> Engine:
    """`engine`, or where its KV cache (`engine.steps.cache_bytes()`, all slots) exceeds the budget
    `build(max_slots=n)` with the most slots that fit, after a warning naming the figures. The
    cache is allocated on first use, so an engine given back unused allocated nothing.

    Args:
      engine: the engine as asked for (its `max_slots` the slots wanted).
      build: `build(max_slots=n) -> Engine` with the same other settings.
      who: the caller, for the warning (e.g. "generate: 32 prompts").
      kv_budget_bytes: the budget (None: `DEFAULT_KV_SHARE` of `mesh.memory_limit()`).
    """
    slots, cache = engine.steps.max_slots, engine.steps.cache_bytes()
    fitting = slots_within_budget(cache / slots, slots, kv_budget_bytes)
    if fitting >= slots:
        return engine
    warnings.warn(f"{who} at max_len={engine.steps.max_len} need a KV cache of {cache / 2**30:.2f} GiB for "
                  f"{slots} slots, more than the budget {_budget(kv_budget_bytes) / 2**30:.2f} GiB "
                  f"(kv_budget_bytes): decoding {fitting} at a time", stacklevel=stacklevel)
    return build(max_slots=fitting)


def generate(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, stop_token_ids: Sequence[int] = (), max_slots: int | None = None,
             max_len: int | None = None, decode_steps: int = 4,
             kv_budget_bytes: float | None = None) -> list[Completion]:
    """Completions for token-id prompts, in prompt order (`.tokens`, `.logprobs`,
    `.raw_logprobs`, `.finish_reason`). Request i uses seed `seed + i`.

    Every prompt decodes at once: the engine gets one slot per prompt (`max_slots=None`), unless
    their KV cache would not fit `kv_budget_bytes` (None: half the device's memory, on CPU half
    the host's available memory, `mesh.memory_limit`); then as many slots as fit decode together
    and the rest wait for a free slot, and a warning names the budget and the split. An explicit
    `max_slots` caps the slots too.

    Args:
      cfg: the model config.
      params: the model's (sharded) params, a nested dict of `jax.Array`.
      prompts: token-id sequences (not text).
      max_new_tokens: per prompt.
      temperature: sampling temperature; 0 (the default) is greedy.
      top_k: keep only the k most likely tokens (None: off).
      top_p: nucleus sampling's probability mass, in (0, 1] (None: off).
      seed: request i samples from seed `seed + i`.
      stop_token_ids: token ids that end a completion ('stop'; the stop token is included).
      max_slots: caps the slots that decode together (None: one per prompt, within the budget).
      max_len: the engine's cache length per slot (None: the longest prompt + max_new_tokens rounded up
        to a power of two, at most cfg.max_seq_len).
      decode_steps: tokens each decode chunk generates per running slot.
      kv_budget_bytes: the KV cache budget (None: half the device's memory, see above).
    Returns:
      One `Completion` per prompt, in prompt order ([] for no prompts).
    Raises:
      ValueError: when `prompts` (or one of them) is text rather than token ids, or a setting is out of range.
    """
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
    check_int("max_slots", max_slots, 1, optional=True)
    slots = min(len(prompts), max_slots) if max_slots is not None else len(prompts)
    engine = fit_slots_to_budget(
        Engine(cfg, params, max_slots=slots, max_len=max_len, decode_steps=decode_steps),
        functools.partial(Engine, cfg, params, max_len=max_len, decode_steps=decode_steps),
        f"generate: {len(prompts)} prompts", kv_budget_bytes, stacklevel=3)

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
