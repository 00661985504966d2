"""How the `Engine` driver admits work into slots: new requests, appends to parked slots, and
(paged) restores of evicted or preempted trajectories, then their device calls.

`_take_admissible` (on the event loop) decides who gets a slot and pages now, first come first
served for new requests, appends looked at independently (`engine.page_policy` says how pages are
found). `_admit_on_device` (on the worker thread) runs what was decided: new prompts of one
prompt bucket share one `prefill_many` call (rows padded to a power of two; a lone prompt is a
call of one row; a prompt several requests share is computed once), appends of one bucket share
one `append_many` call (each row reads its own slot's cache), and restores go one call each.
"""
from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np

from sfrrl_jax.engine.jobs import Job
from sfrrl_jax.engine.prefix_cache import page_keys
from sfrrl_jax.engine.recovery import SlotLog, restorer_for
from sfrrl_jax.engine.slot_state import SlotRequest


def _token_key(tokens) -> tuple:
    """A prompt as a hashable key."""
    return tuple(np.asarray(tokens).reshape(-1).tolist())


def _results_by_slot(first: dict, group: list[Job]) -> dict[int, dict]:
    """A batched step's first results on the host (fields [rows, ...], row i job i's) per slot."""
    return {job.slot: {k: None if v is None else v[i] for k, v in first.items()} for i, job in enumerate(group)}


def host_fields(x) -> dict:
    """A dataclass's fields as a dict, without `dataclasses.asdict`'s deep copy of device arrays."""
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


class AdmissionMixin:
    """The `Engine` driver's admission (its queues, slots and logs live on the Engine)."""

    def _take_admissible(self) -> list[Job]:
        """Jobs that get their slot (and, paged, their pages) now; the rest stay queued. New
        requests and resumed ones are first come, first served; appends go independently."""
        out, keep = [], collections.deque()
        fifo_blocked = False
        prompts: dict[tuple, Job] = {}   # this round's computed prompts (paged: sharers take their pages)
        while self._queue:
            job = self._queue.popleft()
            h = job.request.slot_handle
            if job.resume is None and h is not None:
                if not self._take_append(job, h):
                    keep.append(job)
                elif not job.future.done():
                    out.append(job)
                continue
            log = job.resume or SlotLog(list(job.request.tokens))
            cached = len(log.context) - (job.resume is not None)  # a resumed log's last is pending
            # A resumed request may evict parked slots (it was running); a new one only waits.
            slot = None if fifo_blocked else self._free_slot(evict=job.resume is not None)
            twin, keys = self._shareable(job, log, prompts)
            # a twin's slot shares its full pages (prefilled in the same call)
            pages = None if twin is None else self._pt.full_pages(twin.slot, len(log.context) // self._pt.page_size)
            shared = None if slot is None else self._fits_or_evict(slot, cached, evict=job.resume is not None,
                                                                   pages=pages, keys=keys)
            if shared is None:
                fifo_blocked = True
                keep.append(job)
                continue
            # tokens whose cache the slot took from the prefix cache; a twin is computed with the
            # prompt it repeats, from where that one starts
            job.hit = twin.hit if twin is not None else shared * self._pt.page_size if shared else 0
            if job.resume is None and prompts.setdefault(_token_key(log.context), job) is job \
                    and self.prefix_cache_pages and not job.hit:
                # Named now: its prefill runs before the rest of any prompt that maps cached pages
                # (`_admit_on_device`), so a prompt of this round with the same head maps them.
                self._pt.register(slot, page_keys(log.context, self._pt.page_size))
            self._free.remove(slot)
            job.slot = slot
            self._logs[slot] = log
            self._slot_weights[slot] = self._weights_version
            out.append(job)
        self._queue = keep
        for job in out:
            self._running[job.slot] = job
            if job.serial is not None:  # a resumed or restored trajectory keeps its serial
                self._serials[job.slot] = job.serial
            elif job.request.slot_handle is None:
                self._serial += 1
                self._serials[job.slot] = self._serial
        return out

    def _shareable(self, job: Job, log: SlotLog, prompts: dict) -> tuple[Job | None, list | None]:
        """What a new or resumed job's slot may take from other slots' pages (paged, full-attention
        pool): (the job of this round with the same prompt, whose full pages it shares, or None;
        `page_keys` of the tokens it may find in the prefix cache, or None). A new prompt looks up
        all but its last token (the prefill computes at least one, for its first logits); a
        resumed one its whole cached context."""
        if self._pt is None or self._pt.full_kind is None:
            return None, None
        if job.resume is None:
            twin = prompts.get(_token_key(log.context)) if self.share_prompts else None
            if twin is not None:
                return twin, None
        return None, (page_keys(log.context[:-1], self._pt.page_size) if self.prefix_cache_pages else None)

    def _remember_prompts(self, jobs: list[Job]) -> None:
        """After their prefill: names the full pages of the new prompts just computed in the prefix
        cache (on the loop, in admission order, so every lockstep replica names them alike): those
        computed from a cached head (a prompt computed whole was named at its admission)."""
        if not self.prefix_cache_pages:
            return
        for job in jobs:
            if job.hit and job.request.slot_handle is None and job.resume is None and self._running.get(job.slot) is job:
                self._pt.register(job.slot, page_keys(np.asarray(job.request.tokens).reshape(-1), self._pt.page_size))

    def _take_append(self, job: Job, h) -> bool:
        """Admits an append into its parked slot, or (paged) restores an evicted trajectory into a
        free slot first; False when it must wait for pages or a slot. A released handle fails
        the job (and returns True: it leaves the queue)."""
        job.hit = 0
        if self._parked.get(h.slot) == h.serial:
            log = self._logs[h.slot]
            if self._fits_or_evict(h.slot, len(log.context) + len(job.request.tokens), keep=h.slot) is None:
                return False
            del self._parked[h.slot]
            job.slot = h.slot
        elif h.serial in self._evicted:
            log, slot = self._evicted[h.serial], self._free_slot(evict=True)
            keys = page_keys(log.context[:-1], self._pt.page_size) if self.prefix_cache_pages else None
            shared = None if slot is None else self._fits_or_evict(
                slot, len(log.context) + len(job.request.tokens), start=len(log.context) - 1,  # restore, then append
                keys=keys)
            if shared is None:
                return False
            job.hit = shared * self._pt.page_size
            del self._evicted[h.serial]
            self._free.remove(slot)
            job.slot, job.serial = slot, h.serial
            job.restore = SlotLog(list(log.context), log.draws)  # the slot before this append
            self._logs[slot] = log
            self._slot_weights[slot] = self._weights_version
        else:
            job.future.set_exception(ValueError(f"GenerationRequest.slot_handle {h} was released before its "
                                                "append was admitted"))
            return True
        # The slot's last sampled token is not cached yet: it leads the append.
        job.feed = [log.context[-1]] + list(job.request.tokens)
        log.context.extend(job.request.tokens)
        return True

    def _admit_on_device(self, jobs: list[Job]):
        self.allocate()
        self._sync_pages()
        t0 = time.perf_counter()
        firsts = {}
        # New prompts of one bucket share one prefill call (a call per prompt cost ~0.7 ms each
        # on CPU at batch 32, a fifth of a short generation's wall), appends of one bucket one
        # append call; restores go one by one.
        groups: dict[int, list[Job]] = {}
        cached: dict[int, list[Job]] = {}   # new prompts whose head the prefix cache holds
        for job in jobs:
            if job.feed is None and job.resume is None and job.restore is None:
                if job.hit:
                    cached.setdefault(self.steps.bucket_for(len(job.request.tokens) - job.hit), []).append(job)
                else:
                    groups.setdefault(self.steps.bucket_for(len(job.request.tokens)), []).append(job)
        for group in groups.values():
            firsts.update(self._prefill_group(group))
        for group in cached.values():   # after the prefills: a cached page may be one they write
            firsts.update(self._prefill_group(group))
        appends: dict[int, list[Job]] = {}
        for job in jobs:
            if job.slot in firsts:
                continue
            if job.resume is not None or job.restore is not None:
                # paged: a preempted request (then it decodes on) or an evicted trajectory (then
                # its append follows) comes back by recompute from its log
                running = job.resume is not None
                self.state = restorer_for(self.steps).restore(
                    self.params, self.state, job.slot, job.resume or job.restore,
                    len(job.tokens) if running else 0, running, job.slot_req if running else SlotRequest.make(),
                    start=job.hit)   # what the prefix cache held is not recomputed
                self.stats.restored_slots += 1
                self.stats.prefill_tokens += len((job.resume or job.restore).context) - 1 - job.hit
                self.stats.prefix_hit_tokens += job.hit
                # One multi-device program in flight at a time: XLA:CPU aborted (an all-gather
                # rendezvous that one device never joined) with a burst of 64 admissions
                # dispatched back to back. On GPU the programs run in stream order anyway, so
                # this costs only the host's wait for an admission.
                jax.block_until_ready(self.state)
                if running:
                    firsts[job.slot] = None
                    continue
            # an append (after its restore, for an evicted trajectory)
            appends.setdefault(self.steps.bucket_for(len(job.feed)), []).append(job)
        for group in appends.values():
            firsts.update(self._append_group(group))
        firsts = [firsts[job.slot] for job in jobs]
        self._account("prefill", t0)
        # The loop would decode next (unless an underfull batch gives idle work a turn first):
        # start at once rather than after a round trip through the event loop.
        decoding = len(self._running) - sum(bool(f["done"]) for f in firsts if f is not None)
        if decoding <= self.underfull_slots:
            return firsts, []
        # the first tokens reach their jobs after this chain: it counts them itself
        return firsts, self._decode_chain({job.slot: 1 for job, f in zip(jobs, firsts) if f is not None})

    def _append_group(self, group: list[Job]) -> dict[int, dict]:
        """Appends of one bucket into their parked slots: one `append_many` call for several (each
        call reads the weights once: a burst of tool results no longer costs a call each), the
        `append_prefill` of one slot for a lone one. {slot: its first results}."""
        if len(group) == 1:
            job = group[0]
            self.state, first = self.steps.append_prefill(
                self.params, self.state, job.slot, self.steps.pad(job.feed), len(job.feed), job.slot_req)
        else:
            self.state, first = self.steps.append_many(
                self.params, self.state, [job.slot for job in group],
                np.concatenate([self.steps.pad(job.feed) for job in group]), [len(job.feed) for job in group],
                [job.slot_req for job in group])
        jax.block_until_ready(self.state)  # one program in flight (see _admit_on_device)
        self.stats.appends += len(group)
        self.stats.prefill_tokens += sum(len(job.feed) for job in group)
        self.stats.append_calls += 1
        first = jax.device_get(host_fields(first))
        if len(group) == 1:   # the fields of one slot, as a row of one
            first = {k: None if v is None else np.asarray(v)[None] for k, v in first.items()}
        return _results_by_slot(first, group)

    def _prefill_group(self, group: list[Job]) -> dict[int, dict]:
        """One prefill call for new prompts of one bucket (one prompt too: the driver compiles no
        other prefill): {slot: its first results}. A prompt several jobs share (the G samples of a
        GRPO group, admitted together) is computed once for all of them (the step's sources): at 8
        prompts x 8 samples prefill was a third of the rollout. A group of prompts whose first
        `job.hit` tokens the slots' cached pages hold (`_admit_on_device` keeps them apart) computes
        only the rest (`prefill_at_many`)."""
        rows: dict[tuple, int] = {}
        # Engine(share_prompts=False): every job its own row (keyed apart by its slot)
        sources = [rows.setdefault(_token_key(job.request.tokens)
                                   + (() if self.share_prompts else (-1 - job.slot,)), len(rows))
                   for job in group]
        owner: dict[int, Job] = {}
        for job, source in zip(group, sources):
            owner.setdefault(source, job)
        owners = [owner[r] for r in range(len(rows))]
        rests = [np.asarray(o.request.tokens).reshape(-1)[o.hit:] for o in owners]
        slots, requests = [job.slot for job in group], [job.slot_req for job in group]
        tokens, lengths = np.concatenate([self.steps.pad(r) for r in rests]), [len(r) for r in rests]
        if group[0].hit:
            self.state, first = self.steps.prefill_at_many(self.params, self.state, slots, tokens,
                                                           [o.hit for o in owners], lengths, requests, sources=sources)
        else:
            self.state, first = self.steps.prefill_many(self.params, self.state, slots, tokens, lengths, requests,
                                                        sources=sources)
        jax.block_until_ready(self.state)  # one program in flight (see _admit_on_device)
        self.stats.prefills += len(group)
        self.stats.prefill_calls += 1
        self.stats.prefill_rows += len(rows)
        computed = sum(lengths)   # each distinct prompt's rest once; its sharers are served it
        self.stats.prefill_tokens += computed
        self.stats.prefix_hit_tokens += sum(len(job.request.tokens) for job in group) - computed
        return _results_by_slot(jax.device_get(host_fields(first)), group)
