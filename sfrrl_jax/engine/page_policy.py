"""How the driver spends a paged KV cache's pages (`Engine(page_size=..., num_pages=...)`).

Accounting is in pages, never in slots x max_len. A slot holds the pages for its cached tokens
plus the next decode chunk, taken as it grows and returned when it ends; of a sliding-window
layer's pool it holds only the pages of the window the next step reads (`engine.pages`), and
each decode chunk's reservation returns those the window has left behind:

* Admission. A new request takes a free slot and the pages for its prompt + one decode chunk
  (`decode_steps` tokens); an append (tool observation) grows its parked slot by the observation
  + one chunk. What cannot get its pages waits in the queue: never an overflow, never another
  slot's page. New requests are admitted first come, first served (one that waits holds back the
  new ones behind it, so a long prompt is not starved by short ones); appends to parked slots are
  looked at independently, as continuing trajectories.
* Decode. Before each decode chunk the driver reserves, for every running slot, the pages that
  chunk can write (cached tokens + decode_steps); a chain of chunks stops at the first chunk it
  cannot reserve and goes back to the event loop. Decode never starts a chunk without its pages.
* Making room (on the loop, only when a chunk's pages are short, or an append/resume cannot get
  pages): first *evict* the least recently parked slot: its pages and slot return to the pool,
  its token log stays on the host, and its next append restores it by recompute (the fault
  restorer's prefill over the log) into whichever slot is free; the trajectory's handle keeps
  working (its serial names it). Only with nothing parked left, *preempt* the youngest running
  request by recompute: its slot is freed, it is requeued at the front and restored from its log
  (same sampling keys: seed and draw index) when pages return. New requests never evict or
  preempt anything: they wait.
  Restores recompute the KV by one prefill over the log, so a restored sequence's later
  logprobs may differ from an uninterrupted one's in float rounding (as after a fault).
* Returns. A slot's pages go back when its trajectory is released, when a cancelled request's
  slot is reset on the device, on eviction/preemption, and when fault recovery drops a slot;
  a fault's refill puts each kept slot back into the pages it already owns.

Shared pages (issue #47): a page several slots hold (a group's prompt, a cached prefix) returns
only with its last holder; eviction and preemption just drop one holder. With the prefix cache on
(`Engine(prefix_cache_pages=n)`), a slot's full pages are named by their tokens before they go
back (release, eviction, preemption), and at most n pages nobody holds are kept for a later
request or a restore with the same prefix (least recently released first to go, and only once
no free page is left). A restore maps what it finds and recomputes only the rest.

Liveness: one sequence of max_len tokens always fits (`check_paging`), running requests always
progress (preemption), and every parked trajectory's append can evict the others.
"""
from __future__ import annotations

import numpy as np

from sfrrl_jax.engine.pages import PageTable
from sfrrl_jax.engine.prefix_cache import page_keys
from sfrrl_jax.engine.recovery import SlotLog


class PagingMixin:
    """The `Engine` driver's page bookkeeping (`self._pt` is None for the dense cache)."""

    _pt: PageTable | None

    def _sync_pages(self) -> None:
        """Uploads the host page table into the state if it changed (on the worker thread,
        before a device step: the loop only ever changes the table between steps' uses)."""
        if self._pt is None or self.state is None:
            return
        version, table = self._pt.snapshot()
        if version != self._table_version or self.state.page_table is None:
            self.state.page_table = self.steps.upload_table(table)
            self._table_version = version

    def _return_slots(self, slots) -> None:
        """Slots back to the free pool, with their pages."""
        for slot in slots:
            if self._pt is not None:
                self._pt.release(slot)
            self._free.append(slot)

    def _fits(self, slot: int, tokens: int, start: int | None = None, pages=None, keys=None) -> int | None:
        """Gives `slot` the pages for `tokens` cached tokens + one decode chunk; returns how many
        of its first full-attention pages it shares, or None when they cannot be had now.
        start: where the admitted step's queries start (window layers keep the keys before it they
        read); default the parked slot's cache length (an append), else `tokens` (a prefill or a
        restore reads no key it does not write itself). pages: pages of another slot the new one
        shares (an identical prompt prefilled in the same call); keys: `page_keys` of tokens the
        slot may take from the prefix cache (looked up now: what an eviction just released may
        be among them)."""
        if self._pt is None:
            return 0
        if start is None:
            start = len(self._logs[slot].context) - 1 if slot in self._logs else tokens
        shared = list(pages) if pages is not None else self._pt.lookup(keys) if keys else []
        if not self._pt.ensure(slot, tokens + self.decode_steps, start=start, cached=tokens, shared=shared):
            return None
        return len(shared)

    def _remember(self, slot: int) -> None:
        """Names `slot`'s full pages in the prefix cache by the tokens they hold (before its pages
        go back: a later request or this trajectory's restore may find them). Not a slot filled
        before the last `set_params`: its pages hold keys of other weights."""
        if self.prefix_cache_pages and slot in self._logs and self._slot_weights.get(slot) == self._weights_version:
            self._pt.register(slot, page_keys(self._logs[slot].context[:-1], self._pt.page_size))

    def _handle_log(self, h) -> SlotLog | None:
        """The log of the trajectory a handle names: parked in its slot, or evicted (paged)."""
        if self._parked.get(h.slot) == h.serial:
            return self._logs[h.slot]
        return self._evicted.get(h.serial)

    def _free_slot(self, evict: bool) -> int | None:
        if not self._free and evict and self._pt is not None:
            self._evict_lru_parked()
        return self._free[0] if self._free else None

    def _fits_or_evict(self, slot: int, tokens: int, evict: bool = True, keep: int | None = None,
                       start: int | None = None, pages=None, keys=None) -> int | None:
        """`_fits`, evicting least recently parked slots (not `keep`) while `evict` allows."""
        while (shared := self._fits(slot, tokens, start, pages, keys)) is None:
            if not evict or not self._evict_lru_parked(keep=keep if keep is not None else slot):
                return None
        return shared

    def _evict_lru_parked(self, keep: int | None = None) -> bool:
        """Evicts the least recently parked slot other than `keep`; False if there is none."""
        for slot in self._parked:
            if slot != keep:
                serial = self._parked.pop(slot)
                self._remember(slot)
                self._evicted[serial] = self._logs.pop(slot)
                self._return_slots([slot])
                self.stats.evictions += 1
                return True
        return False

    def _reserve_chunk(self) -> bool:
        """Pages for the next decode chunk of every running slot (worker thread, between chunks)."""
        if self._pt is None:
            return True
        lengths = np.asarray(self.state.lengths)  # the device's truth mid-chain
        return self._pt.ensure_many({s: self._chunk_want(int(lengths[s])) for s in list(self._running)})

    def _chunk_want(self, length: int) -> tuple[int, int, int]:
        """A decode chunk's page needs from `length` cached tokens: (tokens, start, cached) as
        `PageTable.ensure` takes them; window pages behind the chunk's first window go back."""
        return length + self.decode_steps, length, length

    def _make_room_for_decode(self) -> None:
        """Evicts parked slots, then preempts the youngest running ones, until every running slot
        has the pages for its next chunk (on the loop, no device step in flight)."""
        if self._pt is None:
            return
        while True:
            wants = {s: self._chunk_want(len(self._logs[s].context) - 1) for s in self._running}
            if self._pt.ensure_many(wants):
                return
            if self._evict_lru_parked():
                continue
            if len(self._running) < 2:  # check_paging guarantees one sequence fits
                raise AssertionError(f"one running slot cannot get its pages: {wants}")
            slot, job = list(self._running.items())[-1]  # admitted last
            del self._running[slot]
            job.serial = self._serials.pop(slot)
            self._remember(slot)
            job.resume = self._logs.pop(slot)
            job.slot = None
            # Its pages return now; the slot itself only after its device reset (it is still
            # active there): the next upload points its row at scratch, so until that reset its
            # discarded decoding writes only the scratch page.
            self._pt.release(slot)
            self._to_free.append(slot)
            self._queue.appendleft(job)
            self.stats.preemptions += 1
