"""The engine steps over a paged KV cache (issue #18): same API and results as `EngineSteps`.

The dense cache reserves max_len tokens in every slot, so a long-tail agentic batch pays for its
longest possible trajectory max_slots times. Here keys/values live in pools of pages of
`page_size` tokens, one pool per layer kind (`engine.pages`): the full-attention layers' pool of
`num_pages` pages, and for sliding-window layers a pool sized by the window, since a slot keeps
only the window's pages there. All pools lie in one array [units, page_size, kv_heads, head_dim]
(`pages.pool_units`: layer l's page p is unit base[l] + p, each layer with its own scratch page),
and `DecodeState.page_table` [max_slots, kinds, pages_per_slot] int32 says which page of its
kind's pool holds each of a slot's positions. The host (the driver's `PageTable`) owns the table:
it assigns pages as a sequence grows, returns window pages that no later step reads as it moves
on, and uploads the table into the state before a step that needs it; the steps only read it
(and `free_resource` points the freed slot's row at the scratch pages).

Every step is `EngineSteps`' own; only the cache access differs: writes scatter through the
table, reads gather a slot's pages into a contiguous [max_len] view and attend to it with the
same masks and shapes as the dense cache, so tokens and logprobs equal the dense engine's
bit for bit (the gather moves values, it adds no arithmetic; positions whose pages a window
layer returned read the scratch page, and the window mask gives them weight exactly 0, as it
does to the dense cache's stale entries).
Decode can instead attend with a paged-attention kernel (`paged_attention='pallas'`, the default
on a GPU: `models.paged_attention`): it reads the pages in place and only those a query sees (a
window layer's window; nothing past the slot's length), with no gathered copy. The same function
summed in another order: tokens and logprobs equal the gather path's within float rounding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sfrrl_jax.config import ModelConfig, PagedAttention
from sfrrl_jax.engine.model_step import PAGE_POOL_AXES, extend_paged
from sfrrl_jax.engine.pages import PageTable, Paging, check_paging, pages_for, pool_units
from sfrrl_jax.engine.slot_state import DecodeState
from sfrrl_jax.engine.steps import EngineSteps
from sfrrl_jax.models.paged_attention import check_paged_kernel
from sfrrl_jax.mesh import sharding_for


PAGED_ATTENTION = PagedAttention.__args__


def use_paged_kernel(paged_attention: PagedAttention, paging: Paging | None, cfg: ModelConfig) -> bool:
    """Whether decode attends with the paged kernel: `paged_attention` 'pallas' (an error if the
    layout cannot have it), 'gather' (never) or 'auto' (on a GPU backend, where the layout
    allows: page_size and head_dim powers of two, `models.paged_attention.check_paged_kernel`).
    A dense cache (paging None) has no pages to read: 'pallas' is an error there."""
    if paged_attention not in PAGED_ATTENTION:
        raise ValueError(f"paged_attention={paged_attention!r} must be one of {PAGED_ATTENTION}")
    if paging is None:
        if paged_attention == "pallas":
            raise ValueError("paged_attention='pallas' reads a paged cache: set page_size (the cache is dense)")
        return False
    why = check_paged_kernel(paging.page_size, cfg.head_dim)
    if paged_attention == "pallas" and why:
        raise ValueError(f"paged_attention='pallas': {why}")
    if paged_attention == "auto":
        return why is None and jax.default_backend() == "gpu"
    return paged_attention == "pallas"


class PagedEngineSteps(EngineSteps):
    """`EngineSteps` over page pools laid out as `paging` (a `Paging` from
    `engine.pages.check_paging`) says; `kernel`: decode attends with the paged kernel
    (`use_paged_kernel`), else through the gathered view."""

    def __init__(self, cfg: ModelConfig, mesh, max_slots: int, max_len: int, buckets=None,
                 cache_dtype: str | None = None, record_routes: bool = False, decode_buckets=None, *,
                 paging: Paging, kernel: bool = False):
        self.paging, self.page_size = paging, paging.page_size
        self.kernel = bool(kernel)
        self.pages_per_slot = pages_for(max_len, paging.page_size)
        self.layer_kind, self.layer_base, self.layer_scratch, units = pool_units(paging, cfg.n_layers)
        self.kind_scratch = np.asarray(paging.pool_pages or (paging.num_pages,), np.int32)
        self.overlay = any(w > 0 for w in paging.windows)
        super().__init__(cfg, mesh, max_slots, max_len, buckets, cache_dtype, record_routes, decode_buckets)
        self._set_cache_shapes((units, paging.page_size, cfg.n_kv_heads, cfg.head_dim), PAGE_POOL_AXES)
        self.table_shape = (max_slots, len(self.kind_scratch), self.pages_per_slot)
        self.table_sharding = sharding_for(mesh, ("slots", None, None), self.table_shape)
        # rebuilt with the pool's shapes (the base class built it for the dense layout)
        self._init = jax.jit(self._init_impl, out_shardings=self._state_shardings())

    def new_page_table(self) -> PageTable:
        """A host `PageTable` for this layout, every slot empty."""
        return PageTable(self.max_slots, self.max_len, *self.paging)

    def bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence takes in a full-attention layout (keys and
        values, every layer); a window layer holds at most its window's pages of a sequence."""
        cfg = self.cfg
        return cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + cfg.value_cache_dim) * self.cache_dtype.itemsize

    def upload_table(self, table: np.ndarray) -> jax.Array:
        """The host page table [max_slots, kinds, pages_per_slot] as the state's `page_table`."""
        return jax.device_put(np.asarray(table, np.int32), self.table_sharding)

    # -- state ----------------------------------------------------------------------------------
    def _state_shardings(self):
        out = super()._state_shardings()
        if hasattr(self, "table_sharding"):  # the base __init__ calls this before the pool exists
            out.page_table = self.table_sharding
        return out

    def _init_impl(self):
        state = super()._init_impl()
        state.page_table = jnp.broadcast_to(jnp.asarray(self.kind_scratch)[None, :, None], self.table_shape)
        return state

    # -- cache access ---------------------------------------------------------------------------
    def _extend(self, params, tokens, starts, cache_k, cache_v, table, valid_len, with_routes=False, k_len=None,
                logits_at=None):
        return extend_paged(self.cfg, params, tokens, starts, cache_k, cache_v, table, valid_len,
                            k_len or self.max_len, self.layer_kind, self.layer_base, self.layer_scratch,
                            self.overlay, with_routes, logits_at, self.kernel)

    def _extend_all(self, params, state: DecodeState, tokens, starts, valid_len, with_routes=False, k_len=None):
        return self._extend(params, tokens, starts, state.cache_k, state.cache_v, state.page_table, valid_len,
                            with_routes, k_len)

    def _extend_slot(self, params, state: DecodeState, slot, tokens, start, valid_len, cast=False,
                     with_routes=False, logits_at=None):
        table = jax.lax.dynamic_slice_in_dim(state.page_table, slot, 1, axis=0)
        logits, state.cache_k, state.cache_v, *routes = self._extend(
            params, tokens, jnp.reshape(start, (1,)), state.cache_k, state.cache_v, table,
            jnp.reshape(valid_len, (1,)), with_routes, logits_at=logits_at)
        return (logits, state, *routes)

    def _extend_slots(self, params, state: DecodeState, slots, tokens, starts, valid_len, with_routes=False,
                      logits_at=None):
        logits, state.cache_k, state.cache_v, *routes = self._extend(
            params, tokens, starts, state.cache_k, state.cache_v, state.page_table[slots], valid_len, with_routes,
            logits_at=logits_at)
        return (logits, state, *routes)

    def _write_prefixes(self, state: DecodeState, slots, cache_k, cache_v) -> DecodeState:
        bucket = cache_k.shape[2]
        pos = jnp.arange(bucket, dtype=jnp.int32)
        idx = pos // self.page_size
        rows = state.page_table[slots][:, self.layer_kind]  # [n, layers, pages_per_slot]
        # positions past the slot's pages (bucket padding; a window layer's positions before its
        # window) go to the layer's scratch page
        page = rows[:, :, jnp.minimum(idx, self.pages_per_slot - 1)]
        unit = jnp.where(idx < self.pages_per_slot, jnp.asarray(self.layer_base)[:, None] + page,
                         jnp.asarray(self.layer_scratch)[:, None])  # [n, layers, bucket]
        off = (pos % self.page_size)[None, None, :]
        # [layers, n, bucket, ...] -> [n, layers, bucket, ...], the order of `unit`
        state.cache_k = state.cache_k.at[unit, off].set(jnp.swapaxes(cache_k, 0, 1).astype(self.cache_dtype))
        state.cache_v = state.cache_v.at[unit, off].set(jnp.swapaxes(cache_v, 0, 1).astype(self.cache_dtype))
        return state

    def _copy_rows(self, state: DecodeState, src, dst, lengths, mask) -> DecodeState:
        # the slots share their full pages (the page table points both at them): only the page
        # holding the last, partial page's positions is each slot's own, and is copied
        ps = self.page_size
        idx = jnp.minimum(lengths // ps, self.pages_per_slot - 1)
        mask = mask & (lengths % ps != 0)
        pick = lambda slots: jnp.take_along_axis(state.page_table[slots][:, self.layer_kind],   # [n, layers, pages]
                                                 idx[:, None, None], axis=2)[:, :, 0]            # [n, layers]
        base = jnp.asarray(self.layer_base)[None, :]
        src_unit = base + pick(src)
        dst_unit = jnp.where(mask[:, None], base + pick(dst), jnp.asarray(self.layer_scratch)[None, :])
        state.cache_k = state.cache_k.at[dst_unit].set(state.cache_k[src_unit])
        state.cache_v = state.cache_v.at[dst_unit].set(state.cache_v[src_unit])
        return state

    def _free_impl(self, state: DecodeState, slot):
        state = super()._free_impl(state, slot)
        state.page_table = state.page_table.at[slot].set(jnp.asarray(self.kind_scratch)[:, None])
        return state


def engine_steps(cfg: ModelConfig, mesh: Mesh, max_slots: int, max_len: int, buckets=None,
                 cache_dtype: str | None = None, paging: Paging | tuple[int, int] | None = None,
                 record_routes: bool = False, decode_buckets=None,
                 paged_attention: PagedAttention = "auto") -> EngineSteps:
    """A shared `EngineSteps` per configuration, so engines built alike reuse compilations.
    paging: None for the dense cache, or a `Paging` for `engine.paged`'s ((page_size, num_pages)
    means `check_paging`'s layout for cfg's layers and one-token decode chunks). record_routes:
    the steps' results also carry the experts of the tokens fed (`ResultTokens.routes`).
    decode_buckets: the decode chunk's cache-read lengths (`EngineSteps.decode_k_len`; default
    max_len / 8, / 4, / 2, max_len, none below 128). paged_attention: how a paged cache's decode
    attends ('auto', 'gather' or 'pallas'; `use_paged_kernel`)."""
    buckets = None if buckets is None else tuple(buckets)
    decode_buckets = None if decode_buckets is None else tuple(int(b) for b in decode_buckets)
    if paging is not None and not isinstance(paging, Paging):
        paging = check_paging(*paging, max_len, max_slots, cfg.layer_windows)
    kernel = use_paged_kernel(paged_attention, paging, cfg)
    # One cache key per configuration, however the call spelled it (keywords, defaults left out).
    return _shared_steps(cfg, mesh, int(max_slots), int(max_len), buckets, cache_dtype, paging, bool(record_routes),
                         decode_buckets, kernel)


@functools.lru_cache(maxsize=32)
def _shared_steps(cfg, mesh, max_slots, max_len, buckets, cache_dtype, paging, record_routes,
                  decode_buckets, kernel) -> EngineSteps:
    if paging is None:
        return EngineSteps(cfg, mesh, max_slots, max_len, buckets, cache_dtype, record_routes, decode_buckets)
    return PagedEngineSteps(cfg, mesh, max_slots, max_len, buckets, cache_dtype, record_routes, decode_buckets,
                            paging=paging, kernel=kernel)
