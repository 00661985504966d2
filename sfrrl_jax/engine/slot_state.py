"""What the device holds per slot, as pytrees the jitted engine steps (`engine.steps`) take and
return: a request's decoding settings (`SlotRequest`), every slot's cache and counters
(`DecodeState`), one prompt's prefilled cache (`Prefix`) and a step's per-slot results
(`ResultTokens`)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from sfrrl_jax.checks import check_int, check_number, check_seed
from sfrrl_jax.engine.sampling import SamplingParams

MAX_STOP_IDS = 8
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotRequest:
    """One request's decoding settings (scalars, or [slots] inside DecodeState)."""

    sampling: SamplingParams
    max_new: jax.Array        # tokens to generate in this call
    stop_ids: jax.Array       # [..., MAX_STOP_IDS] int32, -1 = unused

    @staticmethod
    def make(temperature=0.0, top_k=0, top_p=1.0, seed=0, max_new=16, stop_ids=()) -> "SlotRequest":
        """One request's settings as the device holds them; raises ValueError naming a bad one.

        top_k at or past the vocabulary keeps every token (the sampler's `min(top_k, vocab)`), and
        max_new past the cache ends where the cache does, so values past int32 mean the same as
        INT32_MAX and are clamped to it (np.int32 would raise OverflowError).
        """
        # Checked on the host: inside the jitted sampler a nan temperature or top_p silently
        # turns every logprob into nan, a temperature past float32 becomes inf, and a negative
        # seed does not fit the uint32 it becomes.
        check_number("temperature", temperature, 0)
        if temperature > FLOAT32_MAX:
            raise ValueError(f"temperature must be at most float32's largest value, {FLOAT32_MAX:g}, got "
                             f"{temperature!r} (it would sample as inf)")
        check_number("top_p", top_p, 0, 1, lo_open=True)
        check_int("top_k", top_k, 0)
        check_seed("seed", seed)
        check_int("max_new_tokens", max_new, 1)
        top_k, max_new = min(int(top_k), INT32_MAX), min(int(max_new), INT32_MAX)
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}")
        for i, t in enumerate(stop_ids):
            check_int(f"stop_ids[{i}]", t, 0, 2**31 - 1)
        stops = np.full((MAX_STOP_IDS,), -1, np.int32)
        stops[: len(stop_ids)] = stop_ids
        sp = SamplingParams(
            temperature=np.float32(temperature), top_k=np.int32(top_k), top_p=np.float32(top_p),
            seed=np.uint32(seed),
        )
        return SlotRequest(sampling=sp, max_new=np.int32(max_new), stop_ids=stops)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """All slots' decoding state. Dense cache: cache_k/v [layers, slots, max_len, kv_heads,
    head_dim], page_table None. Paged (`engine.paged`): cache_k/v [units, page_size, kv_heads,
    head_dim] (every layer's pages and scratch page) and page_table [slots, kinds,
    pages_per_slot] int32. cache_v's last dim is cfg.value_cache_dim: 0 with latent attention,
    whose values are read from cache_k."""

    cache_k: jax.Array
    cache_v: jax.Array
    lengths: jax.Array     # [slots] tokens held in the cache
    last_token: jax.Array  # [slots] sampled, not yet in the cache (fed by the next generate)
    generated: jax.Array   # [slots] tokens generated in the current call
    draws: jax.Array       # [slots] random draws made by the request (its random stream index)
    active: jax.Array      # [slots] bool: decoding
    request: SlotRequest   # fields [slots, ...]
    page_table: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """One prompt's prefilled KV cache, what `prefill` returns and `insert` writes into a slot (positions
    0..bucket-1 of the slot's cache; cast to the engine's cache dtype there). A pytree.

    Attributes:
      cache_k: `[layers, 1, bucket, kv_heads, head_dim]`, the keys of the prompt padded to its bucket length.
      cache_v: `[layers, 1, bucket, kv_heads, cfg.value_cache_dim]`, the values, likewise.
      true_length: scalar, the prompt's real length (positions past it are padding).
    """

    cache_k: jax.Array
    cache_v: jax.Array
    true_length: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ResultTokens:
    """Per slot: the token produced this step, its logprobs, whether it is real, whether done."""

    tokens: jax.Array
    logprobs: jax.Array      # under the sampling distribution actually used (0 for greedy)
    raw_logprobs: jax.Array  # under the policy at temperature 1
    valid: jax.Array         # bool: the slot produced a token this step
    done: jax.Array          # bool: this token ended the call (stop id, max_new, or cache full)
    # record_routes only (else None): the experts of the tokens fed in this step, [moe layers,
    # top_k] per token (`model_step.routes_dtype`): prefill / append [bucket, moe layers, top_k]
    # (rows past true_length are padding), generate [slots, moe layers, top_k] per step
    routes: jax.Array | None = None
