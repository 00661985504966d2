"""Continuous batching on the host, with an asyncio face: `await engine.complete(request)`.

One driver task owns the device state. It admits queued requests into free slots (prefill +
insert) or into their own parked slot (append-prefill of a tool observation), then runs decode
chunks of `decode_steps` tokens for every running slot, streaming tokens into each request's
buffer. A finished request leaves its slot *parked*: the KV cache stays so the next turn of the
same trajectory appends to it; `release(handle)` frees the slot. Device work runs in a worker
thread so tool coroutines keep running on the event loop meanwhile; consecutive decode chunks (and
the decode after an admission) run there back to back until a slot finishes or something arrives
for the driver, so the device does not wait on the event loop between them.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from sfrrl_jax.agents.protocols import Completion, GenerationRequest
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.steps import SlotRequest, engine_steps
from sfrrl_jax.models.api import mesh_of


def _fields(x) -> dict:
    """A dataclass's fields as a dict, without `dataclasses.asdict`'s deep copy of device arrays."""
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


@dataclasses.dataclass(frozen=True)
class SlotHandle:
    slot: int
    serial: int  # tells a stale handle from the slot's next occupant


@dataclasses.dataclass
class _Job:
    request: GenerationRequest
    future: asyncio.Future
    slot_req: SlotRequest
    slot: int | None = None
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    raw_logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EngineStats:
    decode_steps: int = 0
    slot_steps_active: int = 0       # sum over decode steps of running slots
    slot_steps_total: int = 0        # sum over decode steps of max_slots
    generated_tokens: int = 0
    prefills: int = 0
    appends: int = 0
    device_seconds: float = 0.0      # wall time inside device steps (block-until-ready)

    @property
    def slot_occupancy(self) -> float:
        return self.slot_steps_active / max(self.slot_steps_total, 1)


class Engine:
    """Rollout engine over the training params (`set_params` after each optimizer update)."""

    def __init__(self, cfg: ModelConfig, params, *, max_slots: int = 8, max_len: int = 256,
                 buckets=None, decode_steps: int = 1, cache_dtype: str | None = None):
        self.cfg = cfg
        self.params = params
        self.steps = engine_steps(cfg, mesh_of(params), max_slots, max_len,
                                  None if buckets is None else tuple(buckets), cache_dtype)
        self.decode_steps = decode_steps
        self.state = None
        self.stats = EngineStats()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: dict[int, _Job] = {}
        self._parked: dict[int, int] = {}          # slot -> serial
        self._free = list(range(max_slots))
        self._serial = 0
        self._serials: dict[int, int] = {}
        self._to_free: list[int] = []               # cancelled slots awaiting a device reset
        self._last_token: dict[int, int] = {}      # parked slot -> its last token (not cached yet)
        self._cached_len: dict[int, int] = {}      # slot -> tokens in its KV cache
        self._task: asyncio.Task | None = None
        self._kicks = 0
        self._wake: asyncio.Event | None = None
        self._wake_loop = None
        # Idle work (pipelined training): a callable returning a blocking device job or None.
        # The driver runs one job when no slot is decoding, or before a decode chunk when at
        # most `underfull_slots` slots are decoding; decode keeps priority otherwise.
        self.idle_work: Callable[[], Callable[[], None] | None] | None = None
        self.underfull_slots: int = 0
        self.idle_seconds = 0.0  # time idle work took inside the driver
        self.trace = None        # optional Timeline: spans of device work

    # -- lifecycle --------------------------------------------------------------------------
    def set_params(self, params) -> None:
        self.params = params

    def allocate(self) -> None:
        """Allocates the KV cache (also done lazily by the first request)."""
        if self.state is None:
            self.state = self.steps.init_decode_state()

    def release_memory(self) -> None:
        """Deletes the KV cache so training gets the memory; every slot must be free."""
        if self._running or self._parked or self._queue:
            raise RuntimeError(
                f"release_memory with {len(self._running)} running, {len(self._parked)} parked, "
                f"{len(self._queue)} queued requests: finish and release them first")
        if self.state is not None:
            for leaf in jax.tree.leaves(self.state):
                leaf.delete()
            self.state = None
        self._free.extend(self._to_free)  # a fresh state has no stale slots to reset
        self._to_free = []

    @property
    def occupancy(self) -> dict:
        return {"running": len(self._running), "parked": len(self._parked),
                "free": len(self._free), "queued": len(self._queue)}

    # -- async face -------------------------------------------------------------------------
    async def complete(self, request: GenerationRequest) -> Completion:
        slot_req = SlotRequest.make(
            temperature=request.temperature, top_k=request.top_k or 0,
            top_p=1.0 if request.top_p is None else request.top_p, seed=request.seed,
            max_new=request.max_new_tokens, stop_ids=tuple(request.stop_token_ids),
        )
        self.steps.pad(request.tokens)  # validates ids and length now, in the caller
        h = request.slot_handle
        if h is not None and self._parked.get(h.slot) != h.serial:
            raise ValueError(f"slot handle {h} is not parked on this engine (released or stale)")
        if h is not None and self._cached_len[h.slot] + 1 + len(request.tokens) > self.steps.max_len:
            raise ValueError(
                f"appending {len(request.tokens)} tokens to a slot holding {self._cached_len[h.slot] + 1} "
                f"exceeds the engine's max_len={self.steps.max_len}")
        job = _Job(request, asyncio.get_running_loop().create_future(), slot_req)
        self._queue.append(job)
        self._kick()
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    async def release(self, slot_handle: Any) -> None:
        if slot_handle is None:
            return
        if self._parked.get(slot_handle.slot) == slot_handle.serial:
            del self._parked[slot_handle.slot]
            self._free.append(slot_handle.slot)
            self._kick()

    async def wait_idle(self) -> None:
        """Returns once the driver has nothing left to do (its task has ended)."""
        while self._task is not None and not self._task.done():
            await asyncio.wait([self._task])

    def notify_idle_work(self) -> None:
        """New idle work is ready: make sure the driver is awake to run it."""
        self._kick()

    # -- driver -----------------------------------------------------------------------------
    def _kick(self):
        self._kicks += 1  # read by a decode chain on the worker thread: something needs the loop
        loop = asyncio.get_running_loop()
        if self._wake is None or self._wake_loop is not loop:  # a new asyncio.run: new primitives
            self._wake, self._wake_loop = asyncio.Event(), loop
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _cancel(self, job: _Job):
        if job in self._queue:
            self._queue.remove(job)
        elif job.slot is not None and self._running.get(job.slot) is job:
            # Stop decoding it; the driver frees the slot on the device between two device steps
            # (a step may be running on the worker thread right now), then it rejoins the pool.
            del self._running[job.slot]
            self._serials.pop(job.slot, None)
            self._to_free.append(job.slot)
            self._kick()

    async def _run(self):
        try:
            while True:
                if self._to_free:
                    slots, self._to_free = self._to_free, []
                    await asyncio.to_thread(self._free_on_device, slots)
                    self._free.extend(slots)
                admitted = self._take_admissible()
                if admitted:
                    firsts, chunks = await asyncio.to_thread(self._admit_on_device, admitted)
                    for job, first in zip(admitted, firsts):
                        self._push(job, first["tokens"], first["logprobs"], first["raw_logprobs"],
                                   bool(first["done"]))
                    if chunks:
                        self._distribute(chunks)
                        continue
                if self._running:
                    if len(self._running) <= self.underfull_slots:
                        await self._run_idle_job()
                    self._distribute(await asyncio.to_thread(self._decode_chain))
                elif await self._run_idle_job():
                    continue
                elif self._queue:
                    self._wake.clear()       # every slot parked: wait for a release
                    await self._wake.wait()
                else:
                    return
        except Exception as e:  # a device failure fails every waiting request, visibly
            for job in list(self._queue) + list(self._running.values()):
                if not job.future.done():
                    job.future.set_exception(e)
            self._queue.clear()
            self._running.clear()
            raise

    async def _run_idle_job(self) -> bool:
        job = self.idle_work() if self.idle_work is not None else None
        if job is None:
            return False
        t0 = time.perf_counter()
        await asyncio.to_thread(job)
        self.idle_seconds += time.perf_counter() - t0
        return True

    def _take_admissible(self) -> list[_Job]:
        out, keep = [], collections.deque()
        while self._queue:
            job = self._queue.popleft()
            h = job.request.slot_handle
            if h is not None:
                if self._parked.get(h.slot) == h.serial:
                    del self._parked[h.slot]
                    job.slot = h.slot
                    out.append(job)
                else:
                    job.future.set_exception(ValueError(f"slot handle {h} was released"))
            elif self._free:
                job.slot = self._free.pop(0)
                out.append(job)
            else:
                keep.append(job)
        self._queue = keep
        for job in out:
            self._running[job.slot] = job
            if job.request.slot_handle is None:
                self._serial += 1
                self._serials[job.slot] = self._serial
        return out

    def _admit_on_device(self, jobs: list[_Job]):
        self.allocate()
        t0 = time.perf_counter()
        firsts = []
        for job in jobs:
            tokens = list(job.request.tokens)
            if job.request.slot_handle is None:
                padded = self.steps.pad(tokens)
                prefix, first = self.steps.prefill(self.params, padded, len(tokens), job.slot_req)
                self.state = self.steps.insert(prefix, self.state, job.slot, job.slot_req, first)
                self.stats.prefills += 1
                self._cached_len[job.slot] = len(tokens)
            else:
                # The slot's last generated token is not in its cache yet: it leads the append.
                tokens = [self._last_token.pop(job.slot)] + tokens
                padded = self.steps.pad(tokens)
                self.state, first = self.steps.append_prefill(
                    self.params, self.state, job.slot, padded, len(tokens), job.slot_req)
                self.stats.appends += 1
                self._cached_len[job.slot] += len(tokens)
            # One multi-device program in flight at a time: XLA:CPU aborted (an all-gather
            # rendezvous that one device never joined) with a burst of 64 admissions dispatched
            # back to back. On GPU the programs run in stream order anyway, so this costs only the
            # host's wait for an admission.
            jax.block_until_ready(self.state)
            firsts.append(first)
        firsts = jax.device_get([_fields(f) for f in firsts])
        self._account("prefill", t0)
        # The loop would decode next (unless an underfull batch gives idle work a turn first):
        # start at once rather than after a round trip through the event loop.
        decoding = len(self._running) - sum(bool(f["done"]) for f in firsts)
        return firsts, (self._decode_chain() if decoding > self.underfull_slots else [])

    def _decode_chain(self) -> list[dict]:
        """Decode chunks back to back on the worker thread for as long as the loop has nothing to
        act on: no slot finished (its trajectory's tool call should start), no `_kick` (a request,
        release, cancel or idle work arrived) and the batch is not underfull (idle work's turn).
        Each round trip through the event loop costs host time in which the device idles, ms per
        chunk while tool coroutines run. The tokens are the same: sampling is keyed per slot.
        Returns each chunk's results, in order."""
        kicks = self._kicks
        chunks = [self._decode_on_device()]
        while (not chunks[-1]["done"].any() and self._kicks == kicks
               and len(self._running) > self.underfull_slots):
            chunks.append(self._decode_on_device())
        return chunks

    def _free_on_device(self, slots: list[int]) -> None:
        for slot in slots:
            self.state = self.steps.free_resource(self.state, slot)
        jax.block_until_ready(self.state)  # one program in flight (see _admit_on_device)

    def _decode_on_device(self):
        t0 = time.perf_counter()
        self.state, results = self.steps.generate(self.params, self.state, self.decode_steps)
        results = jax.device_get(_fields(results))
        self._account("decode", t0)
        # counted here, not when the tokens reach their requests: a chain delivers those at its end
        self.stats.decode_steps += self.decode_steps
        self.stats.slot_steps_total += self.decode_steps * self.steps.max_slots
        self.stats.slot_steps_active += int(np.sum(results["valid"]))
        return results

    def _account(self, name: str, t0: float) -> None:
        t1 = time.perf_counter()
        self.stats.device_seconds += t1 - t0
        if self.trace is not None:
            self.trace.add(name, "engine", t0, t1)

    def _distribute(self, chunks: list[dict]):
        for results in chunks:
            self._distribute_chunk(results)

    def _distribute_chunk(self, results):
        for step in range(self.decode_steps):
            for slot in np.nonzero(results["valid"][step])[0]:
                job = self._running.get(int(slot))
                if job is None:
                    continue
                self._push(job, results["tokens"][step][slot], results["logprobs"][step][slot],
                           results["raw_logprobs"][step][slot], bool(results["done"][step][slot]))

    def _push(self, job: _Job, token, logprob, raw, done):
        job.tokens.append(int(token))
        job.logprobs.append(float(logprob))
        job.raw_logprobs.append(float(raw))
        self.stats.generated_tokens += 1
        if not done:
            return
        del self._running[job.slot]
        self._cached_len[job.slot] += len(job.tokens) - 1  # all but the last were fed back
        serial = self._serials[job.slot]
        self._parked[job.slot] = serial
        self._last_token[job.slot] = int(token)
        stop = int(token) in job.request.stop_token_ids
        if not job.future.done():
            job.future.set_result(Completion(
                tokens=job.tokens, logprobs=job.logprobs, finish_reason="stop" if stop else "length",
                slot_handle=SlotHandle(job.slot, serial), raw_logprobs=job.raw_logprobs))
