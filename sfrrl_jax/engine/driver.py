"""Continuous batching on the host, with an asyncio face: `await engine.complete(request)`.

One driver task owns the device state. It admits queued requests into free slots (prefill +
insert) or into their own parked slot (append-prefill of a tool observation), then runs decode
chunks of `decode_steps` tokens for every running slot, streaming tokens into each request's
buffer. A finished request leaves its slot *parked*: the KV cache stays so the next turn of the
same trajectory appends to it; `release(handle)` frees the slot. Device work runs in a worker
thread so tool coroutines keep running on the event loop meanwhile; consecutive decode chunks (and
the decode after an admission) run there back to back until a slot finishes or something arrives
for the driver, so the device does not wait on the event loop between them.

With `page_size` set the KV cache is paged (`engine.paged`): admission and decode account in
pages, and a request that cannot get its pages waits; `engine.page_policy` states the policy
(eviction of parked slots, preemption by recompute of the youngest running request).
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.generation_types import Completion, GenerationRequest
from sfrrl_jax.config import ModelConfig, PagedAttention
from sfrrl_jax.mesh import HOST_MEMORY, moved, with_memory_kind
from sfrrl_jax.engine.admission import AdmissionMixin
from sfrrl_jax.engine.decode_chain import DecodeChainMixin
from sfrrl_jax.engine.page_policy import PagingMixin
from sfrrl_jax.engine.pages import PageTable, check_paging
from sfrrl_jax.engine.prefix_cache import check_prefix_cache
from sfrrl_jax.engine.recovery import EngineFailure, SlotLog, restorer_for  # noqa: F401 (re-export)
from sfrrl_jax.engine.paged import engine_steps
from sfrrl_jax.engine.jobs import (EngineStats, Job, SlotHandle, check_slot_handle,  # noqa: F401 (re-export)
                                   new_engine_id, slot_request_of)
from sfrrl_jax.engine.slot_state import SlotRequest
from sfrrl_jax.models.api import mesh_of


IdleWork = Callable[[], Callable[[], None] | None]  # () -> a blocking device job, or None


class _DeviceFault(Exception):
    """A device step raised (its `__cause__`); the driver rebuilds the state and goes on."""


class Engine(AdmissionMixin, PagingMixin, DecodeChainMixin):
    """Rollout engine over the training params (`set_params` after each optimizer update).

    KV cache: dense (`page_size=None`, the default: max_slots x max_len tokens reserved), or paged
    (`page_size` tokens a page, `num_pages` pages shared by all slots; None = as many tokens as
    the dense cache), where a trajectory holds only the pages of its tokens so far and max_slots
    can exceed what the dense cache would fit. See `engine.page_policy` for admission, eviction
    and preemption. paged_attention: how a paged cache's decode attends: 'auto' (the paged
    kernel on a GPU where the layout allows, else 'gather'), 'gather' or 'pallas'
    (`engine.paged.use_paged_kernel`).

    Fault tolerance: a device step that raises does not fail the requests. The driver drops the
    state, builds a fresh one and refills every occupied slot from the host's token log
    (`engine.recovery`), then goes on decoding; `stats.faults` counts these. Only
    `max_consecutive_faults` faults in a row without a successful step in between make it give
    up: every waiting request then fails with `EngineFailure`.

    Hooks, given to the constructor or set later (never assigned from outside): `idle_work` and
    `underfull_slots` (`set_idle_work`: device jobs run when decode would idle) and `trace`
    (`set_trace`: where spans of device work go).

    swap_cache: while an idle job runs (a training micro-step), the KV cache waits in pinned host
    memory and the job has its device memory; it comes back before the next device step. Costs
    two host transfers of the cache per idle job (`stats.swap_seconds`); what lets a long-context
    micro-step (77 GB of cache a device for gpt-oss-120b at 16 x 1M tokens) share the devices with
    a rollout that is still going. Needs devices with 'pinned_host' memory.

    record_routes (a MoE model): each `Completion.routes` holds the experts of every token the
    call fed (routing replay in training). It needs max_consecutive_faults=0: a fault's rebuild
    refills slots by recompute and would lose the routes of a running request's fed tokens.

    share_prompts (default True): requests admitted together with the same prompt (the G samples of a
    GRPO group) prefill it once; each slot gets that row's cache and last logits and samples its
    own first token (`EngineSteps.prefill_many`'s sources; `stats.prefix_hit_tokens` counts the
    tokens served so); with a paged cache their slots also hold the prompt's full pages once
    (reference-counted; each slot's partly filled last page is its own copy), so a group of G
    takes about 1/G of the prompt pages. False computes and stores every request's prompt itself
    (the baseline of `experiments/bench/prefix_sharing.py`). Bitwise: tokens and logprobs equal
    the unshared engine's.

    prefix_cache_pages (paged, full-attention layers; default 0 = off): a prefix cache across
    requests. A slot's full pages are named by the chained hash of the tokens they hold
    (`engine.prefix_cache`); a later prompt or restore starting with the same tokens maps them
    and computes only the rest (prompts admitted together with a common head too: the first is
    computed whole, the others map its head after it); pages nobody holds any more stay cached,
    at most this many, least recently released reused first (they count as free). New weights
    (`set_params`) and a lost state forget the cache. Off by default because a hit is exact only to float rounding
    (<= 1e-5 in logprobs on CPU): the rest of the prompt reads the prefix's keys from the cache
    instead of computing them in the same call.

    decode_buckets: the cache lengths a decode chunk may read (default max_len / 8, / 4, / 2 and
    max_len, none below 128); each chunk reads the smallest that holds every running slot's
    cache at the chunk's end, so short trajectories do not pay attention over the whole cache.
    Each bucket compiles the decode chunk once.
    """

    def __init__(self, cfg: ModelConfig, params, *, max_slots: int = 8, max_len: int = 256,
                 buckets=None, decode_steps: int = 1, cache_dtype: str | None = None,
                 max_consecutive_faults: int = 3, idle_work: IdleWork | None = None,
                 underfull_slots: int = 0, trace=None, page_size: int | None = None,
                 num_pages: int | None = None, record_routes: bool = False, decode_buckets=None,
                 swap_cache: bool = False, paged_attention: PagedAttention = "auto", share_prompts: bool = True,
                 prefix_cache_pages: int = 0):
        if max_consecutive_faults < 0:
            raise ValueError(f"max_consecutive_faults must be >= 0, got {max_consecutive_faults}")
        if record_routes and max_consecutive_faults:
            raise ValueError("record_routes=True needs max_consecutive_faults=0: fault recovery refills "
                             f"slots by recompute and does not record routes (got {max_consecutive_faults})")
        self.record_routes = bool(record_routes)
        if not isinstance(swap_cache, bool):
            raise ValueError(f"Engine(swap_cache=...) must be True or False, got {swap_cache!r}")
        self.swap_cache = swap_cache
        if not isinstance(share_prompts, bool):
            raise ValueError(f"Engine(share_prompts=...) must be True or False, got {share_prompts!r}")
        self.share_prompts = share_prompts
        if swap_cache:   # refuse early, naming the switch, where the devices have no host memory
            with_memory_kind(NamedSharding(mesh_of(params), P()), HOST_MEMORY, "Engine(swap_cache)")
        paging = check_paging(page_size, num_pages, max_len, max_slots, cfg.layer_windows, decode_steps)
        self.prefix_cache_pages = check_prefix_cache(prefix_cache_pages, paging, self.record_routes)
        self.cfg = cfg
        self.params = params
        self._engine_id = new_engine_id()   # in the handles it returns (`jobs.check_slot_handle`)
        self.steps = engine_steps(cfg, mesh_of(params), max_slots, max_len,
                                  None if buckets is None else tuple(buckets), cache_dtype, paging,
                                  self.record_routes, decode_buckets, paged_attention)
        self._pt = None if paging is None else PageTable(max_slots, max_len, *paging,
                                                         keep_pages=self.prefix_cache_pages)
        self._table_version = -1                    # the page table version the state holds
        self._evicted: dict[int, SlotLog] = {}      # paged: serial -> an evicted trajectory's log
        self._weights_version = 0                   # set_params calls so far
        self._slot_weights: dict[int, int] = {}     # occupied slot -> the weights version it was filled with
        self.decode_steps = decode_steps
        self.max_consecutive_faults = max_consecutive_faults
        self.state = None
        self.stats = EngineStats()
        self.fault_messages: collections.deque[str] = collections.deque(maxlen=32)
        self._queue: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}
        self._parked: dict[int, int] = {}          # slot -> serial
        self._free = list(range(max_slots))
        self._serial = 0
        self._serials: dict[int, int] = {}
        self._to_free: list[int] = []               # cancelled slots awaiting a device reset
        self._logs: dict[int, SlotLog] = {}         # occupied slot -> its tokens (see engine.recovery)
        self._faults_in_a_row = 0
        self._needs_rebuild = False                 # after giving up: the parked slots need a refill
        self._task: asyncio.Task | None = None
        self._kicks = 0
        self._wake: asyncio.Event | None = None
        self._wake_loop = None
        self._idle_work: IdleWork | None = None
        self._underfull_slots = 0
        self.set_idle_work(idle_work, underfull_slots=underfull_slots)
        self.idle_seconds = 0.0  # time idle work took inside the driver
        self._last_fetch = 0.0   # when the last decode chunk's results reached the host
        self._trace = None
        self.set_trace(trace)

    # -- lifecycle --------------------------------------------------------------------------
    def set_params(self, params) -> None:
        """The weights the next device steps use (the trainer's, after an update). New weights
        make every cached prefix stale: the prefix cache forgets them (slots keep their pages),
        whatever `params` is (the same pytree may hold new arrays)."""
        if self._pt is not None:
            self._pt.forget_cached()
        self._weights_version += 1   # the slots filled so far are not named in the cache any more
        self.params = params

    def set_idle_work(self, idle_work: IdleWork | None, *, underfull_slots: int | None = None) -> None:
        """The idle-work hook (pipelined training): `idle_work()` returns a blocking device job, or
        None when there is none. The driver runs one job when no slot is decoding, or before a
        decode chunk when at most `underfull_slots` slots are decoding; decode keeps priority
        otherwise. `None` removes the hook; `underfull_slots=None` keeps the current value."""
        if idle_work is not None and not callable(idle_work):
            raise TypeError(f"idle_work must be callable or None, got {type(idle_work).__name__}")
        if underfull_slots is not None:
            if isinstance(underfull_slots, bool) or not isinstance(underfull_slots, int) or underfull_slots < 0:
                raise ValueError(f"underfull_slots must be an int >= 0, got {underfull_slots!r}")
            self._underfull_slots = underfull_slots
        self._idle_work = idle_work

    @property
    def idle_work(self) -> IdleWork | None:
        """The idle-work hook (read-only: set it with `set_idle_work` or the constructor)."""
        return self._idle_work

    @property
    def underfull_slots(self) -> int:
        return self._underfull_slots

    def set_trace(self, trace) -> None:
        """Where spans of device work go: an object with `add(name, lane, t0, t1)` (a
        `trainer.timeline.Timeline`; lane 'engine', perf_counter seconds), or None for none."""
        if trace is not None and not callable(getattr(trace, "add", None)):
            raise TypeError(f"trace must have an add(name, lane, t0, t1) method or be None, got "
                            f"{type(trace).__name__}")
        self._trace = trace

    @property
    def trace(self):
        """The span sink (read-only: set it with `set_trace` or the constructor)."""
        return self._trace

    def allocate(self) -> None:
        """Allocates the KV cache (also done lazily by the first request)."""
        if self.state is None:
            self.state = self.steps.init_decode_state()
            self._table_version = -1

    def release_memory(self) -> None:
        """Deletes the KV cache so training gets the memory; every slot must be free."""
        if self._running or self._parked or self._queue:
            raise RuntimeError(
                f"release_memory with {len(self._running)} running, {len(self._parked)} parked, "
                f"{len(self._queue)} queued requests: finish and release them first")
        self._discard_state()
        self._return_slots(self._to_free)  # a fresh state has no stale slots to reset
        self._to_free = []
        self._logs.clear()

    @property
    def occupancy(self) -> dict:
        """Slots by state; paged: also free pages and evicted trajectories."""
        out = {"running": len(self._running), "parked": len(self._parked),
               "free": len(self._free), "queued": len(self._queue)}
        if self._pt is not None:
            out.update(pages_free=self._pt.free_count, evicted=len(self._evicted))
        return out

    # -- async face -------------------------------------------------------------------------
    async def complete(self, request: GenerationRequest) -> Completion:
        slot_req = self._admissible(request)
        job = Job(request, asyncio.get_running_loop().create_future(), slot_req)
        self._queue.append(job)
        self._kick()
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    def _admissible(self, request: GenerationRequest) -> SlotRequest:
        """The request's device-side settings, after the checks that can fail in the caller:
        sampling settings, token ids and length, and an append's handle and room."""
        slot_req = slot_request_of(request)
        self.steps.pad(request.tokens)
        h = request.slot_handle
        if h is not None:
            check_slot_handle(h, self._engine_id, "GenerationRequest.slot_handle")
            log = self._handle_log(h)
            if log is None:
                raise ValueError(f"GenerationRequest.slot_handle {h} is not parked on this engine: it was released "
                                 "(or is stale: its trajectory ended and the slot went on)")
            if len(log.context) + len(request.tokens) > self.steps.max_len:
                raise ValueError(f"appending {len(request.tokens)} tokens to a slot holding {len(log.context)} "
                                 f"exceeds the engine's max_len={self.steps.max_len}")
        return slot_req

    async def release(self, slot_handle: Any) -> None:
        """Frees the parked slot `slot_handle` names. None, or a handle released already, is a no-op
        (a cancelled call's slot may have been freed by the engine); a handle that is no handle of
        this engine raises ValueError (`jobs.check_slot_handle`)."""
        if slot_handle is not None:
            check_slot_handle(slot_handle, self._engine_id, "Engine.release(slot_handle)")
        self._release_parked(slot_handle)

    async def wait_idle(self) -> None:
        """Returns once the driver has nothing left to do (its task has ended); raises the error
        that ended it, if one did (the requests it failed have seen it too)."""
        while self._task is not None and not self._task.done():
            await asyncio.wait([self._task])
        if self._task is not None and not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()

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

    def _release_parked(self, slot_handle: Any) -> None:
        if slot_handle is not None and self._parked.get(slot_handle.slot) == slot_handle.serial:
            del self._parked[slot_handle.slot]
            self._logs.pop(slot_handle.slot, None)
            # Its pages can go at once: a parked slot is inactive on the device, and the next
            # step's table upload points its row at scratch before any new owner writes them.
            self._return_slots([slot_handle.slot])
            self._kick()
        elif slot_handle is not None and self._evicted.pop(getattr(slot_handle, "serial", None), None):
            self._kick()

    def _stop_running(self, job: Job) -> None:
        """Stop decoding a running job; its slot is freed on the device between two device steps
        (a step may be running on the worker thread right now), then rejoins the pool."""
        del self._running[job.slot]
        self._serials.pop(job.slot, None)
        self._logs.pop(job.slot, None)
        self._to_free.append(job.slot)

    def _cancel(self, job: Job):
        if job.future.done():
            # The result was set, but the caller was cancelled before it resumed: nobody will
            # ever release the parked slot it names, so release it here.
            if not job.future.cancelled() and job.future.exception() is None:
                self._release_parked(job.future.result().slot_handle)
        elif job in self._queue:
            self._queue.remove(job)
        elif job.slot is not None and self._running.get(job.slot) is job:
            self._stop_running(job)
            self._kick()
        if not job.future.done():
            job.future.cancel()  # nobody awaits it any more; nothing may set it later

    async def _device(self, fn, *args):
        """Runs a device step on the worker thread; its failure becomes a `_DeviceFault`."""
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as e:
            raise _DeviceFault() from e

    async def _run(self):
        try:
            while True:
                # Cleared before looking at the queues: whatever arrives from here on (a request,
                # release, cancel) sets it again, so the wait below can never miss a wake-up.
                self._wake.clear()
                try:
                    if await self._cycle():
                        continue
                except _DeviceFault as fault:
                    await self._recover(fault.__cause__)
                    continue
                if await self._run_idle_job():
                    continue
                if self._queue or self._to_free:
                    if not self._wake.is_set() and not self._to_free:
                        await self._wake.wait()  # every slot parked: wait for a release
                    continue
                return
        except Exception as e:  # the engine gave up (or idle work failed): fail every waiter, visibly
            for job in list(self._queue) + list(self._running.values()):
                if not job.future.done():
                    job.future.set_exception(e)
            self._queue.clear()
            for slot in self._running:
                self._logs.pop(slot, None)
                self._to_free.append(slot)
            self._running.clear()
            if isinstance(e, EngineFailure):
                # The state is lost: the next driver run rebuilds the parked slots first (their
                # trajectories may still append), from scratch rather than from a stale count.
                self._discard_state()
                self._return_slots(self._to_free)
                self._to_free = []
                self._faults_in_a_row = 0
                self._needs_rebuild = True
            raise

    async def _cycle(self) -> bool:
        """One round of device work; False when there was none to do."""
        if self._needs_rebuild:
            self._needs_rebuild = False
            await self._device(self._rebuild_on_device, self._rebuild_plan())
        if self._to_free:
            slots, self._to_free = self._to_free, []
            try:
                await self._device(self._free_on_device, slots)
            except _DeviceFault:
                self._return_slots(slots)  # the rebuilt state starts with them free
                raise
            self._return_slots(slots)
        admitted = self._take_admissible()
        if admitted:
            firsts, chunks = await self._device(self._admit_on_device, admitted)
            self._faults_in_a_row = 0
            self._remember_prompts(admitted)
            for job, first in zip(admitted, firsts):
                job.resume = job.restore = None
                job.hit = 0
                if self._running.get(job.slot) is not job or first is None:
                    continue  # cancelled while its prefill ran (its slot is in _to_free), or resumed
                job.add_admission_routes(first)
                self._push(job, [first["tokens"]], [first["logprobs"]], [first["raw_logprobs"]], bool(first["done"]))
            self._distribute(chunks)
            return True
        if not self._running:
            return False
        if len(self._running) <= self.underfull_slots:
            await self._run_idle_job()
        if self._running:
            self._make_room_for_decode()
            self._distribute(await self._device(self._decode_chain))
            self._faults_in_a_row = 0
        return True

    async def _recover(self, error: BaseException) -> None:
        """A device step failed: rebuild the state from the token logs (see `engine.recovery`)."""
        self.stats.faults += 1
        self._faults_in_a_row += 1
        self.fault_messages.append(f"{type(error).__name__}: {error}")
        if self._faults_in_a_row > self.max_consecutive_faults:
            raise EngineFailure(
                f"{self._faults_in_a_row} device faults in a row (max_consecutive_faults="
                f"{self.max_consecutive_faults}); last: {type(error).__name__}: {error}") from error
        self._discard_state()
        self._return_slots(self._to_free)  # a fresh state has them free already
        self._to_free = []
        try:
            await self._device(self._rebuild_on_device, self._rebuild_plan())
        except _DeviceFault as fault:
            await self._recover(fault.__cause__)

    def _rebuild_plan(self) -> list:
        # A snapshot taken on the loop: cancellations may change the dicts while the worker refills.
        return [(slot, SlotLog(list(log.context), log.draws), self._running.get(slot))
                for slot, log in self._logs.items()]

    def _rebuild_on_device(self, plan) -> None:
        self._discard_state()
        self.allocate()
        self._sync_pages()  # each kept slot is refilled into the pages it owns
        restorer = restorer_for(self.steps)
        t0 = time.perf_counter()
        refilled = set()   # pages written in this rebuild: a slot sharing them refills only the rest
        for slot, log, job in plan:
            running = job is not None
            start = self._refilled_prefix(slot, len(log.context) - 1, refilled)
            self.state = restorer.restore(self.params, self.state, slot, log, len(job.tokens) if running else 0,
                                          running, job.slot_req if running else SlotRequest.make(), start=start)
            jax.block_until_ready(self.state)  # one program in flight (see _admit_on_device)
            self.stats.restored_slots += 1
            self.stats.prefill_tokens += len(log.context) - 1 - start   # recomputed
            self.stats.prefix_hit_tokens += start
        self._account("restore", t0)

    def _refilled_prefix(self, slot: int, cached: int, refilled: set) -> int:
        """A rebuild's refill of `slot` (holding `cached` tokens): the positions its leading full
        pages already refilled by a slot sharing them hold (not rewritten: every holder reads the
        same values); the slot's full pages join `refilled`. Not with sliding-window layers: their
        pages are each slot's own, and a refill from a later position would leave them empty."""
        if self._pt is None or self._pt.windows != (0,):
            return 0
        ps = self._pt.page_size
        pages = self._pt.table[slot, self._pt.full_kind, :cached // ps].tolist()
        done = next((i for i, p in enumerate(pages) if p not in refilled), len(pages))
        refilled.update(pages)
        return done * ps

    def _discard_state(self) -> None:
        if self._pt is not None:
            self._pt.forget_cached()   # the pages' contents go with the state
        if self.state is not None:
            for leaf in jax.tree.leaves(self.state):
                try:
                    leaf.delete()
                except Exception:  # already donated or deleted by the step that failed
                    pass
            self.state = None

    async def _run_idle_job(self) -> bool:
        job = self._idle_work() if self._idle_work is not None else None
        if job is None:
            return False
        t0 = time.perf_counter()
        await asyncio.to_thread(self._run_with_cache_away, job)
        self.idle_seconds += time.perf_counter() - t0
        return True

    def _run_with_cache_away(self, job: Callable[[], Any]) -> None:
        """Runs an idle job (on the worker thread); with swap_cache, the KV cache (dense rows or
        page pools) waits in host memory meanwhile and is back on the devices when this returns,
        whether the job succeeded or raised. No device step runs during an idle job (the driver
        runs one thing at a time), so nothing reads the cache while it is away."""
        state = self.state
        if not self.swap_cache or state is None:
            job()
            return
        t0 = time.perf_counter()
        on_device = (state.cache_k, state.cache_v)
        shardings = jax.tree.map(lambda x: x.sharding, on_device)   # arrays, or per-layer lists
        # the device copy deleted once on the host: the job gets its memory now, not at collection
        on_host = moved(on_device, with_memory_kind(shardings, HOST_MEMORY, "Engine(swap_cache)"))
        state.cache_k, state.cache_v = on_host
        swapped = time.perf_counter() - t0
        try:
            job()
        finally:
            t0 = time.perf_counter()
            state.cache_k, state.cache_v = moved(on_host, shardings)
            self.stats.cache_swaps += 1
            self.stats.swap_seconds += swapped + time.perf_counter() - t0

    def _free_on_device(self, slots: list[int]) -> None:
        if self.state is None:
            return  # no state yet (or dropped): every slot of the next one starts free
        self._sync_pages()
        for slot in slots:
            self.state = self.steps.free_resource(self.state, slot)
        jax.block_until_ready(self.state)  # one program in flight (see _admit_on_device)

    def _account(self, name: str, t0: float) -> None:
        if self._pt is not None:
            self.stats.peak_pages = self._pt.peak_used
        t1 = time.perf_counter()
        self.stats.device_seconds += t1 - t0
        if self._trace is not None:
            self._trace.add(name, "engine", t0, t1)
