"""Attacks on the engine driver: cancellations at the worst moments, and device steps that raise.

Each test is the attack as it was tried on a fresh machine (issue #24, parts B and E): what broke
was a lost wake-up (queued requests stuck), a KeyError that killed the driver task, a parked slot
leaked by a late cancellation, and any device exception failing every request in flight.
"""
import asyncio
import functools
import threading

import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.protocols import GenerationRequest
from sfrrl_jax.engine import Engine
from sfrrl_jax.engine.recovery import EngineFailure
from sfrrl_jax.testing.faults import FlakyEngineSteps

from model_fixtures import TINY, randomize, teacher_forced_logprobs


@functools.lru_cache(maxsize=None)
def _params():
    cfg = TINY.replace(max_seq_len=128)
    return cfg, randomize(S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=0), seed=5, scale=0.3)


def _req(tokens, n, **kw):
    return GenerationRequest(tokens=list(tokens), max_new_tokens=n, temperature=kw.pop("temperature", 0.0), **kw)


def _engine(max_slots=1, **kw):
    cfg, params = _params()
    return Engine(cfg, params, max_slots=max_slots, max_len=64, buckets=(16,), **kw)


def _gate_admission(engine):
    """Holds the next admission on the worker thread until released: the window in which a
    cancellation lands *during* admission."""
    inside, go = threading.Event(), threading.Event()
    admit = engine._admit_on_device

    def gated(jobs):
        inside.set()
        go.wait(30)
        return admit(jobs)
    engine._admit_on_device = gated
    return inside, go


async def _wait_thread_event(event):
    while not event.is_set():
        await asyncio.sleep(0.005)


def _assert_all_free(engine):
    assert engine.occupancy == {"running": 0, "parked": 0, "free": engine.steps.max_slots, "queued": 0}
    assert not engine._logs
    engine.release_memory()  # raises if anything were still held


@pytest.mark.parametrize("first_token_ends_it", [False, True], ids=["long", "max_new_1"])
def test_cancel_during_admission_neither_strands_the_queue_nor_kills_the_driver(first_token_ends_it):
    engine = _engine(max_slots=1)

    async def main():
        # Compile the steps first, so the 20 s below time the wake-up, not XLA on a busy machine.
        warm = await engine.complete(_req([4, 5], 3))
        await engine.release(warm.slot_handle)
        inside, go = _gate_admission(engine)
        a = asyncio.create_task(engine.complete(_req([1, 2, 3], 1 if first_token_ends_it else 40)))
        await _wait_thread_event(inside)
        b = asyncio.create_task(engine.complete(_req([4, 5], 3)))  # queued behind a's only slot
        await asyncio.sleep(0.01)
        a.cancel()
        await asyncio.sleep(0.01)
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await a
        c = await asyncio.wait_for(b, 20)  # was stuck 30 s+ (lost wake-up) or failed (KeyError)
        await engine.release(c.slot_handle)
        await engine.wait_idle()  # raises if the driver task died
        return c

    c = asyncio.run(main())
    assert len(c.tokens) == 3
    _assert_all_free(engine)


def test_cancel_after_the_result_is_set_does_not_leak_the_parked_slot():
    engine = _engine(max_slots=2)
    exercised = 0

    async def attempt():
        nonlocal exercised
        task = asyncio.create_task(engine.complete(_req([7, 8], 1)))
        while engine.occupancy["parked"] == 0:  # the driver has set the result...
            await asyncio.sleep(0)
        if not task.done():                      # ...and the caller has not resumed yet
            task.cancel()
            exercised += 1
        try:
            c = await task
            await engine.release(c.slot_handle)
        except asyncio.CancelledError:
            pass
        await engine.wait_idle()

    async def main():
        for _ in range(10):
            await attempt()

    asyncio.run(main())
    assert exercised >= 1, "the race window was never hit: the test exercised nothing"
    _assert_all_free(engine)


async def _multi_turn(engine, index, turns=3):
    """A trajectory: prompt, then `turns` generations with an observation appended between."""
    sequence = [1 + index % 50, 2, 3]
    pending, handle, generated = list(sequence), None, []
    try:
        for turn in range(turns):
            c = await engine.complete(_req(pending, 5 + (index + turn) % 4, temperature=1.0,
                                           seed=100 * index + turn, slot_handle=handle))
            handle = c.slot_handle
            generated.append((len(sequence), c.tokens, c.raw_logprobs))
            sequence += c.tokens
            pending = [9, 10 + turn]  # the "tool observation"
            if turn + 1 < turns:
                sequence += pending
    finally:
        await engine.release(handle)
    return sequence, generated


def test_random_device_faults_are_recovered_and_every_token_stays_on_policy():
    cfg, params = _params()
    engine = _engine(max_slots=4, decode_steps=2, max_consecutive_faults=8)
    flaky = FlakyEngineSteps(engine.steps, p=0.08, seed=0)
    engine.steps = flaky

    async def main():
        return await asyncio.gather(*(_multi_turn(engine, i) for i in range(12)))

    results = asyncio.run(main())
    assert sum(flaky.injected.values()) >= 5 and engine.stats.faults == sum(flaky.injected.values())
    assert {"prefill_many", "generate", "append_prefill"} <= set(flaky.injected)
    assert engine.stats.restored_slots > 0
    _assert_all_free(engine)
    # Every trajectory finished its three turns with the lengths asked for...
    for i, (sequence, generated) in enumerate(results):
        assert [len(toks) for _, toks, _ in generated] == [5 + (i + t) % 4 for t in range(3)]
    # ...and every token's reported log-prob is the policy's on the whole sequence: resumed
    # trajectories continued from their prefix on the same params (no stale or mixed cache).
    want = teacher_forced_logprobs(cfg, params, [s for s, _ in results])
    for (sequence, generated), lp in zip(results, want):
        for start, toks, raw in generated:
            np.testing.assert_allclose(raw, lp[start - 1:start - 1 + len(toks)], atol=2e-4)


def test_a_fault_that_never_clears_fails_every_request_with_engine_failure_and_leaks_nothing():
    engine = _engine(max_slots=2, max_consecutive_faults=2)
    flaky = FlakyEngineSteps(engine.steps, p=1.0, seed=0, always=True)
    engine.steps = flaky

    async def main():
        outs = await asyncio.gather(*(engine.complete(_req([1, 2], 4)) for _ in range(3)), return_exceptions=True)
        with pytest.raises(EngineFailure, match="3 device faults in a row"):
            await engine.wait_idle()
        return outs

    outs = asyncio.run(main())
    assert all(isinstance(o, EngineFailure) for o in outs)
    assert "injected device fault" in str(outs[0].__cause__)
    assert engine.stats.faults == 3
    engine.steps = flaky.inner  # the device is back: the same engine serves again
    c = asyncio.run(engine.complete(_req([1, 2], 4)))
    asyncio.run(engine.release(c.slot_handle))
    assert len(c.tokens) == 4
    _assert_all_free(engine)
