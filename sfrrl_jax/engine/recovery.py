"""Rebuilding the decode state after an engine fault, from what the host already knows.

A device step can fail (an XLA runtime error, a lost device buffer, an injected fault in tests).
Its `DecodeState` is then unusable: the failing step may have consumed the donated input. The
driver does not fail the requests: it keeps, per occupied slot, a `SlotLog` of every token of
that slot's sequence (the host saw them all: prompts and appended observations on admission,
sampled tokens as they were distributed) and the count of random draws the slot made. With a
fresh state, `SlotRestorer.restore` refills each slot's KV cache by one prefill over the logged
tokens and sets its decoding fields back: the pending token, tokens generated in the current
call, the draw counter, active or parked. Decoding then continues where the host's view stopped:
tokens a lost step had computed but not delivered are generated again, with the same sampling
keys (seed, draw index), on the same params, so the trajectory stays on-policy and seeded.

Invariant of a log (see the driver): `context[:-1]` is in the slot's KV cache and `context[-1]`
is the pending token the next decode step feeds (a parked slot's last sampled token, a running
request's newest token, or the last token of a request admitted but not sampled from yet).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sfrrl_jax.generation_types import EngineError
from sfrrl_jax.engine.slot_state import DecodeState, SlotRequest
from sfrrl_jax.engine.steps import EngineSteps


@dataclasses.dataclass
class SlotLog:
    """The host's record of one occupied slot: enough to rebuild its device state."""

    context: list[int]  # the slot's whole sequence: cached tokens, then the pending one
    draws: int = 0      # tokens sampled since the slot's prefill (its random stream index)


class EngineFailure(EngineError):
    """The engine gave up: device steps kept failing after rebuilding the state. Every waiting
    request fails with this error (its `__cause__` is the last device error)."""


class SlotRestorer:
    """Jitted refill of one slot from its `SlotLog` (compiled once per prefill bucket)."""

    def __init__(self, steps: EngineSteps):
        self.steps = steps
        self._fill = jax.jit(self._fill_impl, donate_argnums=(1,))
        self._set = jax.jit(self._set_impl, donate_argnums=(0,))

    def restore(self, params, state: DecodeState, slot: int, log: SlotLog, generated: int, active: bool,
                request: SlotRequest, start: int = 0) -> DecodeState:
        """`state` with `slot` holding `log`: cache = context[:-1], pending token = context[-1].

        generated: tokens of the current call already delivered (counts toward its max_new);
        active: True for a request still decoding, False for a parked slot. start: positions
        before it are in the slot's cache already (paged: shared or cached pages), only the rest
        is recomputed."""
        if not log.context:
            raise ValueError(f"slot {slot}: an empty log cannot be restored")
        cached = log.context[:-1]
        if not 0 <= start <= len(cached):
            raise ValueError(f"slot {slot}: restore from position {start} of a {len(cached)}-token cache")
        with jax.set_mesh(self.steps.mesh):
            if len(cached) > start:
                state = self._fill(params, state, np.int32(slot), self.steps.pad(cached[start:]), np.int32(start),
                                   np.int32(len(cached)))
            return self._set(state, np.int32(slot), np.int32(len(cached)), np.int32(log.context[-1]),
                             np.int32(generated), np.int32(log.draws), np.bool_(active), request)

    def _fill_impl(self, params, state: DecodeState, slot, tokens, start, true_length):
        # through the steps' cache access, so a paged cache refills the slot's own pages
        _, state = self.steps._extend_slot(params, state, slot, tokens, start, true_length, cast=True,
                                           logits_at=jnp.zeros((1,), jnp.int32))  # logits unused: one row
        return state

    @staticmethod
    def _set_impl(state: DecodeState, slot, length, last_token, generated, draws, active, request):
        upd = lambda arr, v: arr.at[slot].set(v)
        state.lengths = upd(state.lengths, length)
        state.last_token = upd(state.last_token, last_token)
        state.generated = upd(state.generated, generated)
        state.draws = upd(state.draws, draws)
        state.active = upd(state.active, active)
        state.request = jax.tree.map(upd, state.request, request)
        return state


@functools.lru_cache(maxsize=32)
def restorer_for(steps: EngineSteps) -> SlotRestorer:
    """One `SlotRestorer` per `EngineSteps`, so engines built alike share its compilations."""
    return SlotRestorer(steps)
