"""What the engine's driver keeps per request and per engine: the request's device settings, its
job (tokens so far, slot, paging state), the handle of a parked slot, and the engine's counters."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import numbers
from typing import Any

import numpy as np

from sfrrl_jax.engine.recovery import SlotLog
from sfrrl_jax.engine.slot_state import SlotRequest
from sfrrl_jax.generation_types import GenerationRequest


def slot_request_of(request: GenerationRequest) -> SlotRequest:
    """A request's per-slot device settings (raises naming a bad sampling setting)."""
    return SlotRequest.make(temperature=request.temperature, top_k=request.top_k or 0,
                            top_p=1.0 if request.top_p is None else request.top_p, seed=request.seed,
                            max_new=request.max_new_tokens, stop_ids=tuple(request.stop_token_ids))


# Each Engine's own number: a handle carries its engine's, so another engine refuses it (two
# engines count slots and serials alike, and would take each other's handles for their own).
_ENGINE_IDS = itertools.count(1)


def new_engine_id() -> int:
    """A number no other engine of this process has (`SlotHandle.engine`)."""
    return next(_ENGINE_IDS)


@dataclasses.dataclass(frozen=True)
class SlotHandle:
    """A parked slot (`Completion.slot_handle`): the slot, the serial of the trajectory in it (tells
    a stale handle from the slot's next occupant), and the engine that returned it (None: rebuilt
    from a lockstep peer's message, or made by hand; not compared)."""

    slot: int
    serial: int
    engine: int | None = dataclasses.field(default=None, compare=False)


def check_slot_handle(handle: Any, engine_id: int, where: str) -> None:
    """Raises ValueError naming `where` unless `handle` is a SlotHandle this engine may have returned.

    Args:
      handle: what the caller passed; engine_id: the engine's `new_engine_id()`;
      where: the argument's name in messages ('GenerationRequest.slot_handle').
    Raises:
      ValueError: not a SlotHandle (a str, a tuple, another engine type's handle), fields that are
      not ints, or a handle another engine returned. Whether it is still parked is the caller's to
      check (a released handle is an error for `complete`, a no-op for `release`).
    """
    if not isinstance(handle, SlotHandle):
        raise ValueError(f"{where} must be the Completion.slot_handle of an earlier call on this engine (or None), "
                         f"got {type(handle).__name__} {repr(handle)[:80]}")
    for name in ("slot", "serial"):
        value = getattr(handle, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{where} {handle!r}: its {name} must be an int, got {type(value).__name__}")
    if handle.engine is not None and handle.engine != engine_id:
        raise ValueError(f"{where} {handle!r} was returned by another engine (engine {handle.engine}; this is "
                         f"engine {engine_id}): a slot handle continues a trajectory on the engine that holds it")


@dataclasses.dataclass
class Job:
    """One request in the driver: queued, running in `slot`, or resolved through `future`."""

    request: GenerationRequest
    future: asyncio.Future
    slot_req: SlotRequest
    slot: int | None = None
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    raw_logprobs: list = dataclasses.field(default_factory=list)
    feed: list | None = None  # an append's tokens for the device: the slot's pending token + the new ones
    # paged cache (engine.page_policy): a preempted request's log to restore and keep decoding,
    # an evicted trajectory's log to restore before its append, and the serial either keeps
    resume: SlotLog | None = None
    restore: SlotLog | None = None
    serial: int | None = None
    # paged, prefix cache on: leading tokens of the prompt (or of a restored log) whose keys and
    # values the slot took from cached pages at its admission (they are not computed)
    hit: int = 0
    # record_routes: the experts of the tokens this call fed so far, in feed order, as arrays
    # [n, moe layers, top_k] (the prefill's or append's tokens, then one per decode step)
    routes: list = dataclasses.field(default_factory=list)
    # engine.lockstep: the (owner process, key) naming this job in every process's replica, and
    # the serial of the slot it parked when it finished (released by a later cancel)
    lockstep_key: tuple[int, int] | None = None
    parked_serial: int | None = None

    def add_admission_routes(self, first: dict) -> None:
        """Keeps the routes of the tokens its prefill or append fed (`first`: the step's results
        on the host; its routes [bucket, moe layers, top_k] hold padding past those tokens)."""
        if first.get("routes") is not None:
            fed = self.feed if self.feed is not None else self.request.tokens
            self.routes.append(np.asarray(first["routes"][: len(fed)]))

    def routes_array(self) -> np.ndarray:
        """Every token fed by this call, [fed, moe layers, top_k] (the Completion's routes)."""
        return np.concatenate(self.routes, axis=0)


@dataclasses.dataclass
class EngineStats:
    """An engine's running counters (`Engine.stats`), cumulative since the engine was built; a caller takes
    differences between two snapshots (`dataclasses.replace(engine.stats)`).

    Attributes:
      decode_steps: decode steps run (each decode chunk counts its `decode_steps` tokens per slot).
      slot_steps_active: sum over decode steps of running slots (the valid ones).
      slot_steps_total: sum over decode steps of max_slots.
      generated_tokens: tokens generated and streamed into requests.
      prefills: prompts admitted by prefill.
      prefill_calls: prefill device calls (one per prompt bucket of an admission).
      prefill_rows: distinct prompts those calls computed (shared prompts once).
      prefill_tokens: tokens the engine ran through the model to fill caches: prompts computed in
        prefill (a shared prompt once), appended observations, and contexts recomputed by a restore.
      prefix_hit_tokens: prompt tokens a slot got without computing them: the cache rows of a prompt
        another slot of the same admission computed (the samples of a GRPO group), and (paged,
        `Engine(prefix_cache_pages=n)`) the tokens of cached pages a prompt or a restore mapped.
      peak_pages: paged: the most pages held at once over all pools (a shared page once).
      appends: observations appended to parked slots.
      append_calls: append device calls (one per bucket of an admission's appends).
      device_seconds: wall time inside device steps (block-until-ready).
      faults: device steps that raised; each rebuilt the state.
      restored_slots: slots refilled from their token logs after a fault.
      evictions: paged: parked slots evicted to the host (restored on append).
      preemptions: paged: running requests preempted (restored by recompute).
      cache_swaps: swap_cache: idle jobs run with the KV cache in host memory.
      swap_seconds: swap_cache: wall time moving the cache out and back.
    """

    decode_steps: int = 0
    slot_steps_active: int = 0
    slot_steps_total: int = 0
    generated_tokens: int = 0
    prefills: int = 0
    prefill_calls: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    appends: int = 0
    append_calls: int = 0
    device_seconds: float = 0.0
    faults: int = 0
    restored_slots: int = 0
    evictions: int = 0
    preemptions: int = 0
    peak_pages: int = 0
    cache_swaps: int = 0
    swap_seconds: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """The share of cache-filling tokens served without compute: `prefix_hit_tokens / (prefix_hit_tokens +
        prefill_tokens)` (0 before any)."""
        return self.prefix_hit_tokens / max(self.prefix_hit_tokens + self.prefill_tokens, 1)

    @property
    def slot_occupancy(self) -> float:
        """The share of slot-steps that ran a request: `slot_steps_active / slot_steps_total` (0 before any)."""
        return self.slot_steps_active / max(self.slot_steps_total, 1)
