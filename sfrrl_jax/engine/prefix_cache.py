"""Which pages of a paged KV cache hold which token prefix, so later requests reuse them (issue #47).

A full page of a sequence is named by the *chained* key of its tokens: page i's key hashes page
i-1's key with the page_size tokens of page i, so equal keys mean equal whole prefixes, not just
equal pages (a page's keys and values depend on every token before it). `page_keys` computes the
chain (blake2b, 16 bytes: deterministic in every process, unlike Python's `hash` of bytes, so the
replicated schedulers of `engine.lockstep` key alike; a collision would need 2**64 pages).

`PrefixCache` is the index of one pool (the full-attention pool: a sliding-window layer keeps
only its window's pages of a sequence, so its pages never hold a whole prefix): key -> page for
pages whose contents a step has written, and the pages nobody references any more but that are
kept for their contents, least recently released first, at most `keep` of them. The allocator
(`engine.pages.PageAllocator`) owns reference counts and free lists; it asks the cache where a
page goes when its last reference drops, and takes the oldest kept page when its free list runs
out. Nothing referenced is ever handed out again.
"""
from __future__ import annotations

import collections
import hashlib

import numpy as np

from sfrrl_jax.checks import check_int

KEY_BYTES = 16


def page_keys(tokens, page_size: int) -> list[bytes]:
    """The chained keys of the full pages of `tokens` (a sequence of token ids from position 0):
    one per page_size tokens, a trailing partial page has none. Returns [len(tokens) // page_size]."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    out, prev = [], b""
    for i in range(len(tokens) // page_size):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(tokens[i * page_size:(i + 1) * page_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


class PrefixCache:
    """Key <-> page index of one pool, plus the LRU of unreferenced pages kept for their contents.

    keep: the most unreferenced pages kept (0: a page is forgotten when its last holder releases
    it; sharing between holders still works). The allocator counts kept pages as free: they go
    back to use, oldest first, when no truly free page is left."""

    def __init__(self, keep: int = 0):
        check_int("PrefixCache keep", keep, 0)
        self.keep = int(keep)
        self._page: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}
        self._kept: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        """Pages with a key (held or kept)."""
        return len(self._key)

    @property
    def kept_count(self) -> int:
        """Unreferenced pages kept for their contents."""
        return len(self._kept)

    def is_kept(self, page: int) -> bool:
        return page in self._kept

    def lookup(self, keys) -> list[int]:
        """The pages of the longest run of leading `keys` that have one (maybe [])."""
        out = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            out.append(page)
        return out

    def add(self, page: int, key: bytes) -> None:
        """Names a referenced, written page by its key. A key already named (another copy of the
        same prefix) or a page already keyed stays as it is."""
        if key not in self._page and page not in self._key:
            self._page[key] = page
            self._key[page] = key

    def take(self, page: int) -> None:
        """A kept page gets a holder again (it leaves the LRU, keeps its key)."""
        del self._kept[page]

    def released(self, page: int) -> list[int]:
        """`page` lost its last holder. Returns the pages now truly free: [] when it is kept,
        else [page] (no key, or keep 0), plus the oldest kept page when over `keep`."""
        if page not in self._key or self.keep == 0:
            self._forget(page)
            return [page]
        self._kept[page] = None
        if len(self._kept) > self.keep:
            return [self.evict_oldest()]
        return []

    def evict_oldest(self) -> int:
        """Forgets the least recently released kept page and returns it (now free)."""
        page, _ = self._kept.popitem(last=False)
        self._forget(page)
        return page

    def clear(self) -> list[int]:
        """Forgets every key (the cache's contents are gone, or stale: new weights). Returns the
        kept pages, now free; held pages stay with their holders, unnamed."""
        pages = list(self._kept)
        self._kept.clear()
        self._page.clear()
        self._key.clear()
        return pages

    def _forget(self, page: int) -> None:
        key = self._key.pop(page, None)
        if key is not None:
            del self._page[key]


def check_prefix_cache(prefix_cache_pages, paging, record_routes: bool) -> int:
    """Validates `Engine(prefix_cache_pages=...)`: 0 (off) or the most unreferenced pages kept.
    The cache needs a paged cache (`paging`, an `engine.pages.Paging`, not None) whose layers all
    attend fully (a sliding-window layer keeps no whole prefix to map), and no `record_routes`
    (a cached prefix's routes are not kept: its tokens would have none)."""
    check_int("Engine(prefix_cache_pages)", prefix_cache_pages, 0)
    n = int(prefix_cache_pages)
    if n == 0:
        return 0
    if paging is None:
        raise ValueError(f"Engine(prefix_cache_pages={n}) keeps pages of a paged cache: set page_size (the cache "
                         "is dense)")
    if any(w != 0 for w in paging.windows):
        raise ValueError(f"Engine(prefix_cache_pages={n}): the model has sliding-window layers (windows "
                         f"{[w for w in paging.windows if w]}), whose pages hold no whole prefix; a group's samples "
                         "still share their prompt (share_prompts)")
    if record_routes:
        raise ValueError(f"Engine(prefix_cache_pages={n}) with record_routes=True: a cached prefix keeps no routes, "
                         "so its tokens would have none to replay; use prefix_cache_pages=0")
    return n
