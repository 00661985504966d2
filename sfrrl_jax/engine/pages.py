"""Host-side bookkeeping of a paged KV cache: free lists of pages and the per-slot page tables.

The paged cache (see `engine.paged`) holds keys/values in pools of fixed-size pages of
`page_size` tokens. Layers are grouped into *kinds* by attention window: full-attention layers
(window 0) share one pool, the sliding-window layers of one window size another. Each pool has
its own page ids `0..pool_pages-1` plus one extra *scratch* page (id `pool_pages`) that every
unassigned page-table entry of that kind points at. Slot `s` keeps positions
`i*page_size .. (i+1)*page_size - 1` of its sequence, for the layers of kind `k`, in page
`table[s, k, i]`. Writes a step makes beyond a slot's pages (bucket padding, the pending-token
write of a parked or freed slot, positions a window layer no longer needs) land in the scratch
page, which no valid, visible position ever reads, so they cannot touch another slot's pages.

A full kind holds every position of a slot: its pages are a prefix of the row. A window kind
(window w) holds only what later steps can read: before a step whose queries start at position
`start`, extend the cache to `cached` tokens and then decode up to `tokens`, it holds the pages
covering `[start - w + 1, start)` (the keys the step's first queries read from the cache) and
`[cached - w + 1, tokens)` (the window of every later query, and the decode chunk's writes);
pages wholly below the latter and outside the former go back to the allocator. The step's own
new keys are read from the step itself, not through the table (`engine.model_step`), so an
append or a restore need no pages for positions it writes but nothing later reads.

Pages can be shared (issue #47): the G samples of one prompt point their first full-attention
entries at the same pages (the prefill writes them once, or each slot the same values), and a
later request whose prompt starts with a cached prefix (`engine.prefix_cache`) maps its pages.
Only *full* pages are shared, pages no holder ever writes again (a slot writes only at and past
its length); a prompt's partly filled last page is each slot's own, filled with a copy of the
computed rows (copy-on-write done at the copy). Pages are reference counted: one returns to use
when its last holder lets go.

`PageAllocator` is one pool's free list; `PageTable` is the host mirror of the device page table
[max_slots, kinds, pages_per_slot] int32 plus which pages each slot owns. The driver is the only
writer; it mutates the table on its event loop and reads it from the device worker thread (a
decode chain reserves its next chunk's pages there), hence the lock.
"""
from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import numpy as np

from sfrrl_jax.engine.prefix_cache import PrefixCache


class PagesExhausted(RuntimeError):
    """An allocation asked for more pages than are free."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold positions 0..tokens-1."""
    return -(-int(tokens) // page_size)


def group_pages(prompt_tokens: int, total_tokens: int, group_size: int, page_size: int, shared: bool = True) -> int:
    """Full-attention pages a group of `group_size` samples of one `prompt_tokens`-token prompt
    holds once each sample has `total_tokens` tokens: with `shared`, the prompt's full pages once
    and each sample's own rest (its partial prompt page included), else every sample all of its
    pages (`Engine(share_prompts=...)`)."""
    full = int(prompt_tokens) // page_size if shared else 0
    return full + int(group_size) * (pages_for(total_tokens, page_size) - full)


def span_pages(n: int, page_size: int) -> int:
    """The most pages n consecutive positions can touch (when they start at a page's last slot)."""
    return 0 if n <= 0 else (int(n) - 2) // page_size + 2


class Paging(NamedTuple):
    """A validated paged-cache layout (hashable: `engine.paged.engine_steps` keys its compilations
    on it). page_size; num_pages: the Engine's argument, the full-attention pool; windows [kinds]:
    each pool's attention window, ascending (0 = full attention); pool_pages [kinds]: pages of each
    pool (scratch excluded); layer_kinds [layers]: the kind of each model layer (None: all kind 0)."""

    page_size: int
    num_pages: int
    windows: tuple[int, ...] = (0,)
    pool_pages: tuple[int, ...] | None = None
    layer_kinds: tuple[int, ...] | None = None


def check_paging(page_size, num_pages, max_len: int, max_slots: int, layer_windows=None,
                 decode_steps: int = 1) -> Paging | None:
    """Validates the Engine's `page_size` / `num_pages`; returns the `Paging` layout or None
    (dense cache). `num_pages=None` with a page size means as many pages as the dense cache.

    layer_windows [layers] (cfg.layer_windows; None = all full): layers with a window w < max_len
    get a pool of their own, sized so that every slot can hold its window and next decode chunk
    at once (max_slots x `span_pages(w - 1 + decode_steps)`, the most a decoding slot holds) and
    one slot an append's two ranges, never more than `num_pages`: those layers then never make a
    request wait for pages that the full-attention pool would not. `num_pages` sizes the
    full-attention pool (with no full-attention layer, it caps the window pools)."""
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
    page_size, num_pages = int(page_size), int(num_pages)
    # a window that covers max_len is full attention as far as the cache is concerned
    wins = [0 if not w or w >= max_len else int(w) for w in (layer_windows or (0,))]
    windows = tuple(sorted(set(wins)))
    pool_pages = []
    for w in windows:
        if w == 0:
            pool_pages.append(num_pages)
            continue
        steady = min(per_slot, span_pages(w - 1 + decode_steps, page_size))
        worst = min(per_slot, span_pages(w - 1, page_size) + steady)  # an append's two ranges
        pool_pages.append(min(num_pages, max(worst, max_slots * steady)))
    layer_kinds = None if layer_windows is None else tuple(windows.index(w) for w in wins)
    return Paging(page_size, num_pages, windows, tuple(pool_pages), layer_kinds)


def pool_units(paging: Paging, n_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """How `engine.paged` lays the pools out in one array of [units, page_size, ...] pages: each
    layer owns a run of its kind's pool_pages + 1 units (its scratch page last), the runs of one
    kind's layers in layer order, the kinds one after another. Returns per layer (kind [layers],
    base unit [layers] = the unit of its page 0, scratch unit [layers]) and the unit count. One full
    kind is the [layers, num_pages + 1] layout flattened."""
    kinds = np.asarray(paging.layer_kinds or (0,) * n_layers, np.int32)
    pages = np.asarray(paging.pool_pages or (paging.num_pages,) * len(paging.windows), np.int64)
    base = np.zeros(n_layers, np.int64)
    offset = 0
    for k in range(len(pages)):
        layers = np.nonzero(kinds == k)[0]
        base[layers] = offset + np.arange(len(layers)) * (pages[k] + 1)
        offset += len(layers) * (pages[k] + 1)
    return kinds, base.astype(np.int32), (base + pages[kinds]).astype(np.int32), int(offset)


class PageAllocator:
    """Reference-counted pages 0..num_pages-1. Hands out the lowest-numbered free pages first (so
    a test's page numbers are predictable); refuses double frees and foreign pages loudly.

    A page several slots read (a prompt's full pages shared by the samples of its group, a cached
    prefix) has one reference per holder (`share`) and returns to use only when the last one is
    freed. `cache` (a `PrefixCache`, for the full-attention pool) keeps pages nobody holds for
    their contents; they count as free and go back to use, oldest first, when no other page is."""

    def __init__(self, num_pages: int, cache: PrefixCache | None = None):
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = int(num_pages)
        self.cache = cache
        self._free = list(range(self.num_pages - 1, -1, -1))  # popped from the end: lowest first
        self._refs = np.zeros(self.num_pages, np.int32)

    @property
    def free_count(self) -> int:
        """Pages an `alloc` can hand out: free ones and unreferenced cached ones."""
        return len(self._free) + (self.cache.kept_count if self.cache is not None else 0)

    @property
    def used_count(self) -> int:
        """Pages somebody holds (a shared page once)."""
        return self.num_pages - self.free_count

    def refs(self, page: int) -> int:
        """Holders of `page`."""
        return int(self._refs[page])

    def alloc(self, n: int) -> list[int]:
        """`n` pages with one reference each, or `PagesExhausted` (allocating none) when fewer
        are free. Cached pages are taken (and forgotten) only once no free page is left."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.free_count:
            raise PagesExhausted(f"{n} pages requested, {self.free_count} of {self.num_pages} free")
        out = [self._free.pop() for _ in range(min(n, len(self._free)))]
        out += [self.cache.evict_oldest() for _ in range(n - len(out))]
        self._refs[out] = 1
        return out

    def share(self, pages) -> None:
        """One more reference to each of `pages` (held, or kept by the cache); a page that is
        neither is a ValueError and nothing of the call changes."""
        pages = [int(p) for p in pages]
        for p in pages:
            self._check_page(p)
            if self._refs[p] == 0 and not (self.cache is not None and self.cache.is_kept(p)):
                raise ValueError(f"page {p} is shared but nobody holds it")
        for p in pages:
            if self._refs[p] == 0:
                self.cache.take(p)
            self._refs[p] += 1

    def free(self, pages) -> None:
        """Drops one reference to each of `pages`; a page whose last reference goes returns to
        the free list (or the cache's kept pages). A page not held that often (double free, or
        not from this pool) is a ValueError and nothing of the call is freed."""
        pages = [int(p) for p in pages]
        count = collections.Counter(pages)
        for p, c in count.items():
            self._check_page(p)
            if self._refs[p] < c:
                raise ValueError(f"page {p} freed twice (it is not allocated)")
        back = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                back += self.cache.released(p) if self.cache is not None else [p]
        self._give_back(back)

    def forget_cached(self) -> None:
        """Empties the cache's index (its contents are gone or stale); kept pages become free."""
        if self.cache is not None:
            self._give_back(self.cache.clear())

    def _give_back(self, pages) -> None:
        if pages:
            self._free.extend(pages)
            self._free.sort(reverse=True)

    def _check_page(self, p: int) -> None:
        if not 0 <= p < self.num_pages:
            raise ValueError(f"page {p} is not in this pool (0..{self.num_pages - 1})")


class PageTable:
    """Host mirror of the device page table and per-slot page ownership (thread-safe).

    `table` [max_slots, kinds, pages_per_slot] int32: kind-local page ids, `scratch[kind]` (= that
    pool's size) where unassigned. The layout arguments are a `Paging`'s fields (one full kind by
    default). `version` bumps on every change, so the driver uploads the table to the device only
    when it changed.

    A slot's needs are given as `tokens` (hold positions < tokens), optionally with `start` and
    `cached` for the window kinds (see the module docstring; start None = 0: hold everything,
    cached None = start). Full kinds ignore them.
    """

    def __init__(self, max_slots: int, max_len: int, page_size: int, num_pages: int, windows=(0,),
                 pool_pages=None, layer_kinds=None, *, keep_pages: int = 0):
        self.page_size, self.max_len = page_size, max_len
        self.pages_per_slot = pages_for(max_len, page_size)
        self.windows = tuple(int(w) for w in windows)
        pool_pages = tuple(pool_pages or (num_pages,) * len(self.windows))
        # only the full-attention pool holds whole prefixes: its pages are shared and cached
        self.full_kind = self.windows.index(0) if 0 in self.windows else None
        self.allocators = [PageAllocator(n, PrefixCache(keep_pages) if k == self.full_kind else None)
                           for k, n in enumerate(pool_pages)]
        self.scratch = np.asarray(pool_pages, np.int32)
        self.table = np.empty((max_slots, len(self.windows), self.pages_per_slot), np.int32)
        self.table[:] = self.scratch[None, :, None]
        self.version = 0
        self.peak_used = 0
        self._lock = threading.Lock()

    @property
    def allocator(self) -> PageAllocator:
        """The first kind's free list (the full-attention pool when the model has one)."""
        return self.allocators[0]

    @property
    def free_count(self) -> int:
        """Free pages over all pools."""
        return sum(a.free_count for a in self.allocators)

    @property
    def free_counts(self) -> tuple[int, ...]:
        """Free pages per kind."""
        return tuple(a.free_count for a in self.allocators)

    @property
    def used_count(self) -> int:
        """Pages held over all pools, a page several slots share once."""
        return sum(a.used_count for a in self.allocators)

    @property
    def owned(self) -> np.ndarray:
        """[max_slots, kinds] pages each slot holds of each pool."""
        return (self.table != self.scratch[None, :, None]).sum(axis=2)

    def _plan(self, slot: int, want) -> list[tuple[list[int], list[int]]]:
        """Per kind: (row indices to free, row indices to allocate) for `want`."""
        tokens, start, cached = (tuple(want) + (None, None))[:3] if isinstance(want, tuple) else (want, None, None)
        tokens = min(int(tokens), self.max_len)
        start = 0 if start is None else min(int(start), tokens)
        cached = start if cached is None else min(max(int(cached), start), tokens)
        ps, hi = self.page_size, pages_for(tokens, self.page_size)
        out = []
        for k, w in enumerate(self.windows):
            owned = self.table[slot, k] != self.scratch[k]
            need = np.zeros(self.pages_per_slot, bool)
            free = []
            if w == 0:
                need[:hi] = True
            else:
                lo1 = max(0, start - w + 1) // ps
                need[lo1:pages_for(start, ps)] = True  # the keys the step's first queries read
                lo2 = max(0, cached - w + 1) // ps
                need[lo2:hi] = True                    # the window of every later query
                free = np.nonzero(owned & ~need & (np.arange(self.pages_per_slot) < lo2))[0].tolist()
            out.append((free, np.nonzero(need & ~owned)[0].tolist()))
        return out

    def needed(self, slot: int, tokens, start=None, cached=None) -> int:
        """More pages (all pools) `slot` needs for `tokens` (capped at max_len), see the class."""
        return sum(len(a) for _, a in self._plan(slot, (tokens, start, cached)))

    def ensure(self, slot: int, tokens: int, start: int | None = None, cached: int | None = None,
               shared=None) -> bool:
        """Gives `slot` the pages for `tokens` (and returns its window pages no step reads any
        more); False (and nothing allocated) when not enough are free. shared: full-attention
        pages another slot holds (or the prefix cache keeps) that become this slot's first pages
        (they hold positions 0..len(shared) * page_size - 1, written already or by the same step)."""
        return self.ensure_many({slot: (tokens, start, cached)}, None if shared is None else {slot: shared})

    def ensure_many(self, wants: dict, shared: dict | None = None) -> bool:
        """All of `wants` (slot -> tokens, or (tokens, start, cached)) or none of it, the slots
        of `shared` (slot -> pages, see `ensure`) first taking those pages. Window pages that no
        later step reads are returned either way (they never will be read)."""
        with self._lock:
            taken = self._share(shared or {})
            plans = {s: self._plan(s, w) for s, w in wants.items()}
            for s, plan in plans.items():
                for k, (free, _) in enumerate(plan):
                    if free:
                        self.allocators[k].free(self.table[s, k, free])
                        self.table[s, k, free] = self.scratch[k]
                        self.version += 1
            for k, a in enumerate(self.allocators):
                if sum(len(plan[k][1]) for plan in plans.values()) > a.free_count:
                    self._unshare(taken)
                    return False
            for s, plan in plans.items():
                for k, (_, alloc) in enumerate(plan):
                    if alloc:
                        self.table[s, k, alloc] = self.allocators[k].alloc(len(alloc))
                        self.version += 1
            self.peak_used = max(self.peak_used, self.used_count)
            return True

    def _share(self, shared: dict) -> list[tuple[int, int]]:
        """Points each slot's first full-attention entries at its shared pages; (slot, count) taken."""
        taken = []
        k = self.full_kind
        for s, pages in shared.items():
            pages = [int(p) for p in pages]
            if not pages:
                continue
            if k is None:
                raise ValueError("shared pages need a full-attention pool (this layout has only window layers)")
            if (self.table[s, k, :len(pages)] != self.scratch[k]).any():
                raise ValueError(f"slot {s} already holds pages where shared ones would go")
            self.allocators[k].share(pages)
            self.table[s, k, :len(pages)] = pages
            self.version += 1
            taken.append((s, len(pages)))
        return taken

    def _unshare(self, taken) -> None:
        k = self.full_kind
        for s, n in taken:
            self.allocators[k].free(self.table[s, k, :n])
            self.table[s, k, :n] = self.scratch[k]
            self.version += 1

    def full_pages(self, slot: int, n: int) -> list[int]:
        """The first `n` full-attention pages of `slot` (to share with another slot)."""
        with self._lock:
            row = self.table[slot, self.full_kind, :n]
            if len(row) < n or (row == self.scratch[self.full_kind]).any():
                raise ValueError(f"slot {slot} does not hold {n} full-attention pages")
            return row.tolist()

    def lookup(self, keys) -> list[int]:
        """Pages of the prefix cache holding the longest run of leading `keys` (`page_keys`)."""
        if self.full_kind is None:
            return []
        with self._lock:
            return self.allocators[self.full_kind].cache.lookup(keys)

    def register(self, slot: int, keys) -> None:
        """Names `slot`'s first len(keys) full-attention pages by `keys` (their contents are
        written: the step that wrote them ran or is ordered before any reader)."""
        if self.full_kind is None:
            return
        with self._lock:
            k = self.full_kind
            cache = self.allocators[k].cache
            for i, key in enumerate(keys[:self.pages_per_slot]):
                page = int(self.table[slot, k, i])
                if page == self.scratch[k]:
                    break
                cache.add(page, key)

    def forget_cached(self) -> None:
        """Drops the prefix cache's index (stale weights, or the cache's contents are lost);
        pages kept only for their contents become free."""
        with self._lock:
            for a in self.allocators:
                a.forget_cached()

    def release(self, slot: int) -> None:
        """Returns every page of `slot` and points its row at the scratch pages. The last page
        goes first: the prefix cache reuses the least recently released pages first, so a
        sequence's tail is reused before its head (which later prompts and its restore share)."""
        with self._lock:
            for k, a in enumerate(self.allocators):
                held = self.table[slot, k] != self.scratch[k]
                if held.any():
                    a.free(self.table[slot, k, held][::-1])
                    self.table[slot, k] = self.scratch[k]
                    self.version += 1

    def snapshot(self) -> tuple[int, np.ndarray]:
        """(version, a copy of the table) taken atomically."""
        with self._lock:
            return self.version, self.table.copy()
