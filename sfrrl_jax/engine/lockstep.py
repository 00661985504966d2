"""The engine across processes: every process launches the same device programs in the same order.

Multi-controller JAX runs one process per host over one global mesh, and each device program
must be launched by every process, in the same order. The engine's schedule is data-dependent
(which request is admitted, when a slot parks on a tool) and its inputs are host events that
differ between hosts: each process runs the agent loops and tools of its own trajectories.
`LockstepEngine` keeps the processes in lockstep by *ticks* (docs/multihost.md):

1. Each driver tick starts with an exchange: every process sends the events that arrived on it
   since its last tick (new requests and appends with their tokens, releases, cancellations, and
   whether it still has work in flight) and receives everyone's, in process order.
2. Every process applies all events in that order to its copy of the scheduler (queue, slots,
   page table, token logs). The copies start equal and see the same events in the same order,
   so they stay equal: no leader, no broadcast of decisions.
3. Every process then runs the same device work: admissions, then one decode chunk
   (`decode_steps` tokens). The results are replicated over the mesh (`EngineSteps`), so each
   process reads every slot's tokens from its own devices and resolves the requests it owns;
   it keeps the others' token logs too (its scheduler copy needs their lengths).

Idle work (the pipelined schedule's gradient micro-steps) is a tick event too: each process
says whether it has a micro-step ready; when any has one and the replicated scheduler says the
engine would idle, every process runs one (its own, or `filler`: its share of the micro-step
without rows of its own), so the same programs run everywhere (`set_idle_work`). Work whose
state every process holds alike (`shared_work`: e.g. an early sample's micro-step, whose queue
is replicated) runs in a tick where no process has work of its own.

Application events ride the same ticks: `publish(data)` (JSON) reaches every process's
`set_event_handler` callback at the same tick, in process order, before that tick's device work,
so replicated trainer state changes at the same point everywhere.

The drivers stop together at the first tick where no process has work in flight and nothing is
queued or running; a process whose own trajectories finished keeps ticking while others decode.
A rollout phase that must run on every process although one may have nothing to generate opens
`async with engine.session():` on each (the trainer does): a process in a session counts as
having work, so the others never wait on one whose driver has stopped.

Failure is loud: a process that does not send its tick within `tick_timeout_s` (it died, or it
left the run) fails every request with `LockstepError` naming it, and a device fault (which
single-process recovery would repair locally, diverging from the peers) fails the engine.
Ticks go through an `Exchange`; `KeyValueExchange` uses the `jax.distributed` coordination
service's key-value store (small messages, host-side, with timeouts), `LocalExchange` is the
one-process identity.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Protocol, Sequence

from sfrrl_jax.engine.driver import Engine, _DeviceFault
from sfrrl_jax.engine.jobs import Job, SlotHandle, check_slot_handle, slot_request_of
from sfrrl_jax.engine.recovery import EngineFailure
from sfrrl_jax.generation_types import Completion, GenerationRequest


class LockstepError(EngineFailure):
    """The processes can no longer agree: a peer did not send its tick in time, or a device
    step failed (which would be repaired locally and diverge)."""


class Exchange(Protocol):
    """All-gather of one small message per process per tick, in process order."""

    process_index: int
    process_count: int

    def allgather(self, tick: int, payload: bytes) -> list[bytes]: ...

    def with_prefix(self, prefix: str) -> "Exchange":
        """An exchange between the same processes whose ticks are numbered apart from this one's."""
        ...


class LocalExchange:
    """One process: the tick's only message is its own."""

    process_index, process_count = 0, 1

    def allgather(self, tick: int, payload: bytes) -> list[bytes]:
        return [payload]

    def with_prefix(self, prefix: str) -> "LocalExchange":
        return LocalExchange()


class KeyValueExchange:
    """Ticks through the coordination service's key-value store (`jax.distributed`).

    Keys live under `<prefix>/<n>`, n counting the exchanges this process made with that prefix.

    Each process writes `<prefix>/<tick>/<process>` and reads every other process's key with a
    blocking get; a key is deleted two ticks later by its writer (every reader has passed it by
    then: nobody can be at tick t+2 before all have read tick t+1's keys, which needs t's read).
    """

    _made: dict[str, int] = {}

    def __init__(self, prefix: str = "sfrrl/engine", timeout_s: float = 300.0, client=None,
                 process_index: int | None = None, process_count: int | None = None):
        import jax
        from jax._src import distributed
        self.client = client if client is not None else distributed.global_state.client
        if self.client is None:
            raise RuntimeError("KeyValueExchange needs jax.distributed.initialize() first "
                               "(sfrrl_jax.launch.distributed.initialize)")
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        # Each exchange gets its own keys: the n-th exchange a process makes under a prefix is
        # the n-th on every process (they build engines and trainers in the same order), and
        # the last ticks' keys of an earlier one (never deleted) cannot collide with a new one's.
        n = KeyValueExchange._made[prefix] = KeyValueExchange._made.get(prefix, 0) + 1
        self.prefix, self.timeout_s = f"{prefix}/{n}", timeout_s

    def with_prefix(self, prefix: str) -> "KeyValueExchange":
        """Another exchange over the same service, under its own keys (its own tick numbers)."""
        return KeyValueExchange(prefix, self.timeout_s, self.client, self.process_index, self.process_count)

    def allgather(self, tick: int, payload: bytes) -> list[bytes]:
        me = self.process_index
        self.client.key_value_set_bytes(f"{self.prefix}/{tick}/{me}", payload)
        out = []
        for p in range(self.process_count):
            if p == me:
                out.append(payload)
                continue
            try:
                out.append(self.client.blocking_key_value_get_bytes(f"{self.prefix}/{tick}/{p}",
                                                                    int(self.timeout_s * 1000)))
            except Exception as e:  # the service reports a timeout or a lost peer as a status error
                raise LockstepError(
                    f"engine tick {tick}: process {p} of {self.process_count} sent nothing within "
                    f"{self.timeout_s:.0f} s (it died or left the run): {type(e).__name__}: {e}") from e
        if tick >= 2:
            with contextlib.suppress(Exception):
                self.client.key_value_delete(f"{self.prefix}/{tick - 2}/{me}")
        return out


def _request_to_json(r: GenerationRequest) -> dict:
    h = r.slot_handle
    return {"tokens": [int(t) for t in r.tokens], "max_new": r.max_new_tokens, "temperature": r.temperature,
            "top_k": r.top_k, "top_p": r.top_p, "seed": r.seed, "stop": list(r.stop_token_ids),
            "handle": None if h is None else [h.slot, h.serial]}


def _request_from_json(d: dict) -> GenerationRequest:
    h = d["handle"]
    return GenerationRequest(tokens=d["tokens"], max_new_tokens=d["max_new"], temperature=d["temperature"],
                             top_k=d["top_k"], top_p=d["top_p"], seed=d["seed"], stop_token_ids=tuple(d["stop"]),
                             slot_handle=None if h is None else SlotHandle(*h))


class LockstepEngine(Engine):
    """`Engine` whose scheduler is replicated on every process and advanced by exchanged ticks
    (module doc). Same constructor as `Engine`, plus `exchange` (default: `KeyValueExchange()`
    when `jax.process_count() > 1`, else `LocalExchange()`) and `idle_poll_s` (how long a tick
    with nothing to do waits for a local event before exchanging again).
    Idle work: `set_idle_work(idle_work, has_work=..., filler=...)` (module doc).
    """

    def __init__(self, *args, exchange: Exchange | None = None, idle_poll_s: float = 0.002, **kw):
        kw["max_consecutive_faults"] = 0  # a local repair would diverge from the peers
        super().__init__(*args, **kw)
        if exchange is None:
            import jax
            exchange = KeyValueExchange() if jax.process_count() > 1 else LocalExchange()
        self.exchange = exchange
        self.idle_poll_s = idle_poll_s
        self.ticks = 0
        self.exchange_seconds = 0.0                 # wall time inside exchanges (the agreement's cost)
        self._outbox: list[dict] = []
        self._own: dict[int, asyncio.Future] = {}   # key -> the future of a request this process owns
        # (owner, key) -> its job, from its submit until it is cancelled or its parked slot is
        # released or appended to: changed only at ticks, so the same on every process (a
        # cancellation that arrives after the job finished must release its slot everywhere)
        self._jobs: dict[tuple[int, int], Job] = {}
        self._parked_by: dict[tuple[int, int], tuple[int, int]] = {}   # (slot, serial) -> (owner, key)
        self._next_key = 0
        self._sessions = 0
        self._has_idle_work = None
        self._idle_filler = None
        self._shared_work = None
        self._has_shared_work = None
        self._tick_idle = False                     # this tick, some process has a micro-step ready
        self._ran_idle_this_tick = False
        self._event_handler = None

    def set_idle_work(self, idle_work, *, underfull_slots=None, has_work=None, filler=None,
                      shared_work=None, has_shared_work=None) -> None:
        """As `Engine.set_idle_work`, agreed across processes: `has_work()` says (without taking
        it) whether `idle_work()` has a job; `filler()` returns the job this process runs when a
        peer runs idle work and it has none (a micro-step with no rows of its own). All three, or
        only `idle_work=None`. Optionally `shared_work()` (a job or None) and `has_shared_work()`
        over state that is the same on every process (changed only by `publish`ed events): asked
        in a tick where no process has work of its own; every process gets the same answer. One
        idle job runs per tick at most, on every process at once."""
        if idle_work is not None and not (callable(has_work) and callable(filler)):
            raise TypeError("LockstepEngine.set_idle_work needs has_work= and filler= callables with idle_work: "
                            "every process must run a job in a tick where any process runs one")
        if (shared_work is None) != (has_shared_work is None):
            raise TypeError("LockstepEngine.set_idle_work: shared_work= and has_shared_work= go together")
        super().set_idle_work(idle_work, underfull_slots=underfull_slots)
        self._has_idle_work = has_work if idle_work is not None else None
        self._idle_filler = filler if idle_work is not None else None
        self._shared_work = shared_work if idle_work is not None else None
        self._has_shared_work = has_shared_work if idle_work is not None else None

    def set_event_handler(self, handler) -> None:
        """`handler(owner_process, data)` for every `publish`ed event, on every process, at the
        tick it is exchanged (in process order); None removes it."""
        if handler is not None and not callable(handler):
            raise TypeError(f"event handler must be callable or None, got {type(handler).__name__}")
        self._event_handler = handler

    def publish(self, data) -> None:
        """Sends `data` (JSON-able) to every process's event handler at the next tick."""
        self._outbox.append({"kind": "app", "data": data})
        self._kick()

    # -- async face: events go out at the next tick -------------------------------------------------
    @contextlib.asynccontextmanager
    async def session(self):
        """While open, this process counts as having work: the drivers of all processes keep
        ticking (open one on every process around a rollout phase). Leaving the last session
        waits until every process has left its own: the drivers stop at the same tick."""
        self._sessions += 1
        self._kick()
        failed = False
        try:
            yield self
        except BaseException:
            failed = True
            raise
        finally:
            self._sessions -= 1
            self._kick()
            if not self._sessions:
                # This process's devices take part in every tick: it serves the ticks until no
                # process has work left (the drivers end together), even with its own work done.
                try:
                    await self.wait_idle()
                except Exception:
                    if not failed:
                        raise

    async def complete(self, request: GenerationRequest) -> Completion:
        if self.exchange.process_count > 1 and not self._sessions:
            raise RuntimeError("LockstepEngine.complete outside engine.session() on a multi-process run: open "
                               "`async with engine.session():` on every process around the rollout, so no "
                               "process's driver stops while another's still needs it")
        self._admissible(request)  # what can fail, fails now, in the caller
        key, self._next_key = self._next_key, self._next_key + 1
        future = asyncio.get_running_loop().create_future()
        self._own[key] = future
        self._outbox.append({"kind": "submit", "key": key, "request": _request_to_json(request)})
        self._kick()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                self._outbox.append({"kind": "cancel", "key": key})
                future.cancel()
                self._kick()
            elif not future.cancelled() and future.exception() is None:
                await self.release(future.result().slot_handle)  # nobody will release it now
            raise
        finally:
            self._own.pop(key, None)

    async def release(self, slot_handle) -> None:
        if slot_handle is not None:
            check_slot_handle(slot_handle, self._engine_id, "LockstepEngine.release(slot_handle)")   # before it is sent
            self._outbox.append({"kind": "release", "handle": [slot_handle.slot, slot_handle.serial]})
            self._kick()

    # -- the tick ---------------------------------------------------------------------------------
    def _local_work(self) -> bool:
        return bool(self._sessions or self._own or self._outbox or self._idle_ready()
                    or (self._has_shared_work is not None and self._has_shared_work()))

    def _idle_ready(self) -> bool:
        return self._has_idle_work is not None and bool(self._has_idle_work())

    async def _run_idle_job(self) -> bool:
        """Runs one idle job if this tick agreed on one: this process's own, else its filler;
        with no process's own work, the shared work (the same everywhere), if any."""
        if self._ran_idle_this_tick:
            return False
        if not self._tick_idle:
            job = self._shared_work() if self._shared_work is not None else None
            if job is None:
                return False
        else:
            job = self._idle_work() if self._idle_work is not None else None
            if job is None:
                if self._idle_filler is None:
                    raise LockstepError(f"process {self.exchange.process_index}: a peer runs idle work this tick "
                                        "and this process has no idle-work hook (set_idle_work) to join it")
                job = self._idle_filler()
        self._tick_idle, self._ran_idle_this_tick = False, True
        t0 = time.perf_counter()
        await asyncio.to_thread(self._run_with_cache_away, job)
        self.idle_seconds += time.perf_counter() - t0
        return True

    def _exchange_tick(self, payload: bytes) -> list[bytes]:
        t0 = time.perf_counter()
        out = self.exchange.allgather(self.ticks, payload)
        self.exchange_seconds += time.perf_counter() - t0
        self.ticks += 1
        return out

    def _apply(self, messages: Sequence[bytes]) -> bool:
        """Applies every process's events in process order; True if any process has work."""
        busy = False
        self._tick_idle = self._ran_idle_this_tick = False
        loop = asyncio.get_running_loop()
        for owner, raw in enumerate(messages):
            msg = json.loads(raw)
            busy |= msg["busy"]
            self._tick_idle |= msg.get("idle", False)
            for ev in msg["events"]:
                if ev["kind"] == "submit":
                    request = _request_from_json(ev["request"])
                    mine = owner == self.exchange.process_index
                    future = self._own.get(ev["key"]) if mine else None
                    if future is None or future.done():
                        future = loop.create_future()  # a peer's request: its tokens are only logged
                        future.add_done_callback(_consume)
                    job = Job(request, future, slot_request_of(request))
                    job.lockstep_key = (owner, ev["key"])
                    self._jobs[job.lockstep_key] = job
                    self._queue.append(job)
                elif ev["kind"] == "release":
                    self._release_parked(SlotHandle(*ev["handle"]))
                elif ev["kind"] == "app":
                    if self._event_handler is not None:
                        self._event_handler(owner, ev["data"])
                elif ev["kind"] == "cancel":
                    job = self._jobs.pop((owner, ev["key"]), None)
                    if job is not None:
                        self._cancel_at_tick(job)
        return busy

    async def _run(self):
        try:
            while True:
                self._wake.clear()
                events, self._outbox = self._outbox, []
                payload = json.dumps({"busy": self._local_work(), "idle": self._idle_ready(),
                                      "events": events}).encode()
                messages = await asyncio.to_thread(self._exchange_tick, payload)
                busy = self._apply(messages)
                try:
                    worked = await self._cycle()
                except _DeviceFault as fault:
                    e = fault.__cause__
                    raise LockstepError(f"device step failed on process {self.exchange.process_index}: "
                                        f"{type(e).__name__}: {e}") from e
                if not worked:
                    worked = await self._run_idle_job()  # nothing decodes: the agreed micro-step
                if worked or self._queue or self._to_free:
                    continue
                if not busy:
                    return  # every process sees the same: all drivers stop at this tick
                if not self._wake.is_set():  # nothing to do here: wait a little for a local event
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.idle_poll_s)
        except Exception as e:
            if not isinstance(e, EngineFailure):
                e = LockstepError(f"{type(e).__name__}: {e}")
            for job in list(self._queue) + list(self._running.values()):
                if not job.future.done():
                    job.future.set_exception(e)
            for future in self._own.values():
                if not future.done():
                    future.set_exception(e)
            self._queue.clear()
            self._running.clear()
            raise e

    def _cancel_at_tick(self, job: Job) -> None:
        """A cancel event, applied alike on every process from the replicated state alone (the
        owner's future was cancelled already; the peers' may hold a result): a queued job leaves
        the queue, a running one frees its slot, a finished one releases the slot it parked."""
        if job in self._queue:
            self._queue.remove(job)
        elif job.slot is not None and self._running.get(job.slot) is job:
            self._stop_running(job)
        elif job.parked_serial is not None:
            self._release_parked(SlotHandle(job.slot, job.parked_serial))
        if not job.future.done():
            job.future.cancel()

    def _push(self, job: Job, tokens, logprobs, raw, done):
        super()._push(job, tokens, logprobs, raw, done)
        if done and job.slot is not None and self._parked.get(job.slot) is not None:
            # the job parked its slot: remembered until the slot is released or appended to
            job.parked_serial = self._parked[job.slot]
            where = (job.slot, job.parked_serial)
            earlier = self._parked_by.get(where)
            if earlier is not None and earlier != job.lockstep_key:
                self._jobs.pop(earlier, None)   # an append continued it: that job is over
            self._parked_by[where] = job.lockstep_key

    def _release_parked(self, slot_handle) -> None:
        if slot_handle is not None:
            done = self._parked_by.pop((slot_handle.slot, slot_handle.serial), None)
            if done is not None:
                self._jobs.pop(done, None)
        super()._release_parked(slot_handle)

    def _decode_chain(self, undelivered: dict[int, int] | None = None) -> list[dict]:
        """One decode chunk per tick: a longer chain would end on local events, which differ
        between processes (so `undelivered`, which only bounds a chain's length, is not needed)."""
        if not self._reserve_chunk():
            return []
        return [self._decode_on_device()]


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # a peer's request failing is reported on its owner, not here
