"""The engine's own API types: what a caller sends (`GenerationRequest`), what comes back
(`Completion`), the error that means the engine itself is gone (`EngineError`), and the protocol
any engine meets (`EngineProtocol`: the real `Engine`, a scripted one in tests, a remote one).
They sit below the engine (`sfrrl_jax.engine` re-exports them): the agent loop and a process that
only runs tools (a Ray tool actor) import them without the engine and JAX.

Semantics callers (the agent loop) rely on:
* `complete(request)` generates for one trajectory. With `slot_handle=None`, `tokens` is the whole
  prompt (prefill). With a handle returned by an earlier `Completion`, the slot's KV cache holds
  everything so far (including the last generated token) and `tokens` are only the NEW tokens to
  append (append-prefill of the observation delta), never the history again.
* `Completion.tokens` are the newly generated tokens; the stop token that ended the turn is
  included (the policy generated it). `logprobs[i]` is log p(tokens[i]) under the sampling
  distribution actually used. `finish_reason` is 'stop' (a stop token) or 'length' (hit
  `max_new_tokens`). The returned handle keeps the slot parked until the next `complete` or
  `release`.
* `release(handle)` frees a parked slot; the loop calls it exactly once when a trajectory ends.
  If a `complete` is cancelled (wall budget), the engine frees whatever that request allocated;
  the loop still releases the last handle it was given.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sfrrl_jax.checks import check_int, check_number, check_seed

_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One turn of generation. `tokens`: prompt ids, or only the appended ids when continuing.

    `slot_handle`: None, or the `Completion.slot_handle` of this trajectory's previous call on the
    same engine; what a handle is belongs to the engine, which checks it (`Engine` raises
    ValueError naming `GenerationRequest.slot_handle` for anything else, or a released handle).
    """

    tokens: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    slot_handle: Any = None

    def __post_init__(self):
        own = "GenerationRequest"
        check_int(f"{own}.max_new_tokens", self.max_new_tokens, 1)
        # nan/inf sampling settings reach the jitted sampler as nan logprobs, not as an error (a
        # temperature past float32's range is inf there). top_k past the vocabulary keeps every
        # token, as None does; max_new_tokens past the cache stops where the cache ends.
        check_number(f"{own}.temperature", self.temperature, 0)
        if self.temperature > _FLOAT32_MAX:
            raise ValueError(f"{own}.temperature must be at most float32's largest value, {_FLOAT32_MAX:g}, "
                             f"got {self.temperature!r} (it would sample as inf)")
        check_int(f"{own}.top_k", self.top_k, 0, optional=True)
        check_number(f"{own}.top_p", self.top_p, 0, 1, lo_open=True, optional=True)
        check_seed(f"{own}.seed", self.seed)
        _check_token_ids(f"{own}.tokens", self.tokens)
        if len(self.tokens) == 0:
            raise ValueError("GenerationRequest.tokens is empty: there is nothing to prefill or append")
        _check_token_ids(f"{own}.stop_token_ids", self.stop_token_ids)


def _check_token_ids(where: str, ids) -> None:
    """Raises ValueError naming `where` unless `ids` is a flat sequence of integer token ids (a
    list, tuple, set or integer array; not text, not floats or bools, which int() would silently
    turn into other tokens). The vocabulary range is the engine's to check: it knows the model."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{where} must be a sequence of token ids, got text {ids[:40]!r}: tokenize it first")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 and ids.size:
            raise ValueError(f"{where} must be a flat sequence of token ids, got shape {ids.shape}")
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"{where} must hold integer token ids, got a {ids.dtype} array")
        return
    try:
        items = list(ids)
    except TypeError:
        raise ValueError(f"{where} must be a sequence of token ids, got {type(ids).__name__} {ids!r}") from None
    for i, x in enumerate(items):   # each item: a bool among ints would pass a numpy dtype check
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
            raise ValueError(f"{where}[{i}] is {type(x).__name__} {x!r}, not an integer token id")


@dataclasses.dataclass(frozen=True)
class Completion:
    """What one `complete` call generated: tokens[n], logprobs[n] (same n), why it stopped, the slot."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # 'stop' | 'length'
    slot_handle: Any = None
    # log p(tokens[i]) under the policy at temperature 1 (what the train forward computes);
    # None when the engine does not provide it.
    raw_logprobs: list[float] | None = None
    # Routing replay (an engine built with record_routes=True; else None): the experts every
    # token FED to the model in this call used, [fed, moe layers, top_k] int (moe layers in
    # `models.transformer.moe_layer_ids` order). A new request fed its prompt, then each
    # generated token but the last (sampled, never fed): fed = len(prompt) + len(tokens) - 1.
    # A continued request (slot_handle) fed the previous call's last token first (it was
    # pending in the slot), then its appended tokens, then tokens[:-1]: fed = 1 +
    # len(appended) + len(tokens) - 1. Concatenated over a trajectory's calls: the routes of
    # every token of the trajectory but its last.
    routes: np.ndarray | None = None

    def __post_init__(self):
        if self.raw_logprobs is not None and len(self.raw_logprobs) != len(self.tokens):
            raise ValueError(f"Completion has {len(self.tokens)} tokens but {len(self.raw_logprobs)} raw_logprobs")
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs")
        if self.routes is not None:
            r = self.routes
            # every call feeds at least one token of its request before its first sampled one
            if r.ndim != 3 or r.shape[0] < len(self.tokens) or not np.issubdtype(r.dtype, np.integer):
                raise ValueError(f"Completion.routes must be int [fed >= {len(self.tokens)} tokens, moe layers, "
                                 f"top_k], got {r.dtype} {r.shape}")
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"Completion.finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")


class EngineError(RuntimeError):
    """The engine itself failed, not one request: no trajectory can go on. The agent loop lets it
    through (a sample's own failure becomes that sample's error instead; see `agents.loop`)."""


@runtime_checkable
class EngineProtocol(Protocol):
    """What any engine meets (the real `Engine`, a scripted one in tests, a remote one): the agent loop's
    view of generation. Runtime-checkable: `isinstance(x, EngineProtocol)` checks that both methods exist.

    The semantics callers rely on are in the module docstring; each method's contract below.
    """

    async def complete(self, request: GenerationRequest) -> Completion:
        """Generates one turn for one trajectory.

        Args:
          request: with `slot_handle=None`, `tokens` is the whole prompt (prefill). With the handle of this
            trajectory's previous `Completion`, the slot's KV cache holds everything so far (including the last
            generated token) and `tokens` are only the NEW tokens to append, never the history again.
        Returns:
          The `Completion`: the newly generated tokens (the stop token that ended the turn included),
          `logprobs[i]` = log p(tokens[i]) under the sampling distribution actually used, `finish_reason`
          'stop' or 'length', and a `slot_handle` that keeps the slot parked until the next `complete` or
          `release`.
        Raises:
          EngineError: when the engine itself failed (no trajectory can go on).
          asyncio.CancelledError: when the call is cancelled (wall budget); the engine then frees whatever
            the request allocated, and the caller still releases the last handle it was given.
          ValueError: for a request the engine refuses, this request's own error (`Engine`: a handle that is not
            parked on it, an append past its `max_len`, ...; other engines may name their own).
        """
        ...

    async def release(self, slot_handle: Any) -> None:
        """Frees the parked slot `slot_handle` names; the loop calls it exactly once when a trajectory ends.

        Args:
          slot_handle: a `Completion.slot_handle` of this engine. None, or a handle released already, is a no-op
            (a cancelled call's slot may have been freed by the engine already).
        """
        ...
