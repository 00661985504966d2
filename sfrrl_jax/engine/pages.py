"""Host-side bookkeeping of a paged KV cache: a free list of pages and the per-slot page table.

The paged cache (see `engine.paged`) holds keys/values in a pool of `num_pages` fixed-size pages
of `page_size` tokens, plus one extra *scratch* page (index `num_pages`) that every unassigned
page-table entry points at. Slot `s` keeps positions `i*page_size .. (i+1)*page_size - 1` of its
sequence in page `table[s, i]`. Writes a step makes beyond a slot's pages (bucket padding, the
pending-token write of a parked or freed slot) land in the scratch page, which no valid position
ever reads, so they cannot touch another slot's pages.

`PageAllocator` is the free list; `PageTable` is the host mirror of the device page table
[max_slots, max_pages_per_slot] int32 plus which pages each slot owns. The driver is the only
writer; it mutates the table on its event loop and reads it from the device worker thread (a
decode chain reserves its next chunk's pages there), hence the lock.
"""
from __future__ import annotations

import threading

import numpy as np


class PagesExhausted(RuntimeError):
    """An allocation asked for more pages than are free."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold positions 0..tokens-1."""
    return -(-int(tokens) // page_size)


def check_paging(page_size, num_pages, max_len: int, max_slots: int) -> tuple[int, int] | None:
    """Validates the Engine's `page_size` / `num_pages`; returns (page_size, num_pages) or None
    (dense cache). `num_pages=None` with a page size means as many pages as the dense cache."""
    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    if page_size is None:
        if num_pages is not None:
            raise ValueError(f"num_pages={num_pages!r} needs a page_size (page_size=None is the dense cache)")
        return None
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1 or None, got {page_size!r}")
    if page_size > max_len:
        raise ValueError(f"page_size={page_size} > max_len={max_len}: a page larger than a whole sequence")
    per_slot = pages_for(max_len, page_size)
    if num_pages is None:
        num_pages = max_slots * per_slot
    if not is_int(num_pages) or num_pages < 1:
        raise ValueError(f"num_pages must be an int >= 1 or None, got {num_pages!r}")
    if num_pages < per_slot:
        raise ValueError(
            f"num_pages={num_pages} cannot hold one max_len={max_len} sequence: it needs "
            f"ceil(max_len / page_size={page_size}) = {per_slot} pages")
    return int(page_size), int(num_pages)


class PageAllocator:
    """Free list over pages 0..num_pages-1. Hands out the lowest-numbered free pages first (so a
    test's page numbers are predictable); refuses double frees and foreign pages loudly."""

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = int(num_pages)
        self._free = list(range(self.num_pages - 1, -1, -1))  # popped from the end: lowest first
        self._in_use = np.zeros(self.num_pages, bool)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """`n` pages, or `PagesExhausted` (allocating none) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PagesExhausted(f"{n} pages requested, {len(self._free)} of {self.num_pages} free")
        out = [self._free.pop() for _ in range(n)]
        self._in_use[out] = True
        return out

    def free(self, pages) -> None:
        """Returns `pages`; a page not allocated (double free, or not from this pool) is a
        ValueError and nothing of the call is freed."""
        pages = [int(p) for p in pages]
        seen = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is not in this pool (0..{self.num_pages - 1})")
            if not self._in_use[p] or p in seen:
                raise ValueError(f"page {p} freed twice (it is not allocated)")
            seen.add(p)
        self._in_use[pages] = False
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)


class PageTable:
    """Host mirror of the device page table and per-slot page ownership (thread-safe).

    `table` [max_slots, pages_per_slot] int32: page ids, `scratch` (= num_pages) where unassigned.
    A slot's pages are always a prefix of its row. `version` bumps on every change, so the driver
    uploads the table to the device only when it changed.
    """

    def __init__(self, max_slots: int, max_len: int, page_size: int, num_pages: int):
        self.page_size, self.max_len = page_size, max_len
        self.pages_per_slot = pages_for(max_len, page_size)
        self.allocator = PageAllocator(num_pages)
        self.scratch = num_pages
        self.table = np.full((max_slots, self.pages_per_slot), self.scratch, np.int32)
        self.owned = np.zeros(max_slots, np.int64)  # pages held per slot
        self.version = 0
        self._lock = threading.Lock()

    @property
    def free_count(self) -> int:
        return self.allocator.free_count

    def needed(self, slot: int, tokens: int) -> int:
        """More pages `slot` needs to hold positions 0..tokens-1 (tokens capped at max_len)."""
        return max(0, pages_for(min(tokens, self.max_len), self.page_size) - int(self.owned[slot]))

    def ensure(self, slot: int, tokens: int) -> bool:
        """Gives `slot` the pages for positions 0..tokens-1; False (and nothing allocated) when
        not enough are free."""
        return self.ensure_many({slot: tokens})

    def ensure_many(self, wants: dict[int, int]) -> bool:
        """All of `wants` (slot -> tokens) or none of it."""
        with self._lock:
            need = {s: self.needed(s, t) for s, t in wants.items()}
            if sum(need.values()) > self.allocator.free_count:
                return False
            for s, n in need.items():
                if n:
                    have = int(self.owned[s])
                    self.table[s, have:have + n] = self.allocator.alloc(n)
                    self.owned[s] = have + n
                    self.version += 1
            return True

    def release(self, slot: int) -> None:
        """Returns every page of `slot` and points its row at the scratch page."""
        with self._lock:
            n = int(self.owned[slot])
            if n:
                self.allocator.free(self.table[slot, :n])
                self.table[slot] = self.scratch
                self.owned[slot] = 0
                self.version += 1

    def snapshot(self) -> tuple[int, np.ndarray]:
        """(version, a copy of the table) taken atomically."""
        with self._lock:
            return self.version, self.table.copy()
