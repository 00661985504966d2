"""The engine steps over a paged KV cache (issue #18): same API and results as `EngineSteps`.

The dense cache reserves max_len tokens in every slot, so a long-tail agentic batch pays for its
longest possible trajectory max_slots times. Here keys/values live in a pool of `num_pages` pages
of `page_size` tokens ([layers, num_pages + 1, page_size, kv_heads, head_dim]; the extra last page
is scratch, see `engine.pages`), and `DecodeState.page_table` [max_slots, pages_per_slot] int32
says which pages hold a slot's positions. The host (the driver's `PageTable`) owns the table: it
assigns pages as a sequence grows and uploads the table into the state before a step that needs
them; the steps only read it (and `free_resource` points the freed slot's row at scratch).

Every step is `EngineSteps`' own; only the cache access differs: writes scatter through the
table, reads gather a slot's pages into a contiguous [max_len] view and attend to it with the
same masks and shapes as the dense cache, so tokens and logprobs equal the dense engine's
bit for bit (the gather moves values, it adds no arithmetic). A GPU paged-attention kernel that
reads pages in place is a follow-up.

Sliding-window layers share the pool and mask like the dense cache: their pages outside the
window are not returned early (per-layer-type pools are a follow-up).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.model_step import PAGE_POOL_AXES, extend_paged
from sfrrl_jax.engine.pages import pages_for
from sfrrl_jax.engine.steps import DecodeState, EngineSteps, Prefix
from sfrrl_jax.mesh import sharding_for


class PagedEngineSteps(EngineSteps):
    """`EngineSteps` over a page pool; `page_size`, `num_pages` as validated by
    `engine.pages.check_paging`."""

    def __init__(self, cfg: ModelConfig, mesh, max_slots: int, max_len: int, buckets=None,
                 cache_dtype: str | None = None, *, page_size: int, num_pages: int):
        self.page_size, self.num_pages = page_size, num_pages
        self.pages_per_slot = pages_for(max_len, page_size)
        super().__init__(cfg, mesh, max_slots, max_len, buckets, cache_dtype)
        shape = (cfg.n_layers, num_pages + 1, page_size, cfg.n_kv_heads, cfg.head_dim)
        self.cache_shape = shape
        self.cache_sharding = sharding_for(mesh, PAGE_POOL_AXES, shape)
        self.table_sharding = sharding_for(mesh, ("slots", None), (max_slots, self.pages_per_slot))
        # rebuilt with the pool's shapes (the base class built it for the dense layout)
        self._init = jax.jit(self._init_impl, out_shardings=self._state_shardings())

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    def bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence takes (keys and values, every layer)."""
        return 2 * self.cfg.n_layers * self.cfg.n_kv_heads * self.cfg.head_dim * self.cache_dtype.itemsize

    def upload_table(self, table: np.ndarray) -> jax.Array:
        """The host page table as the state's `page_table` leaf."""
        return jax.device_put(np.asarray(table, np.int32), self.table_sharding)

    # -- state ----------------------------------------------------------------------------------
    def _state_shardings(self):
        out = super()._state_shardings()
        if hasattr(self, "table_sharding"):  # the base __init__ calls this before the pool exists
            out.page_table = self.table_sharding
        return out

    def _init_impl(self):
        state = super()._init_impl()
        state.page_table = jnp.full((self.max_slots, self.pages_per_slot), self.scratch_page, jnp.int32)
        return state

    # -- cache access ---------------------------------------------------------------------------
    def _extend_all(self, params, state: DecodeState, tokens, starts, valid_len):
        return extend_paged(self.cfg, params, tokens, starts, state.cache_k, state.cache_v,
                            state.page_table, valid_len, self.max_len)

    def _extend_slot(self, params, state: DecodeState, slot, tokens, start, valid_len, cast=False):
        table = jax.lax.dynamic_slice_in_dim(state.page_table, slot, 1, axis=0)
        logits, state.cache_k, state.cache_v = extend_paged(
            self.cfg, params, tokens, jnp.reshape(start, (1,)), state.cache_k, state.cache_v, table,
            jnp.reshape(valid_len, (1,)), self.max_len)
        return logits, state

    def _write_prefix(self, state: DecodeState, slot, prefix: Prefix) -> DecodeState:
        bucket = prefix.cache_k.shape[2]
        pos = jnp.arange(bucket, dtype=jnp.int32)
        idx = pos // self.page_size
        row = state.page_table[slot]
        # positions past the slot's pages (bucket padding) go to the scratch page
        page = jnp.where(idx < self.pages_per_slot, row[jnp.minimum(idx, self.pages_per_slot - 1)],
                         self.scratch_page)
        off = pos % self.page_size
        state.cache_k = state.cache_k.at[:, page, off].set(prefix.cache_k[:, 0].astype(self.cache_dtype))
        state.cache_v = state.cache_v.at[:, page, off].set(prefix.cache_v[:, 0].astype(self.cache_dtype))
        return state

    def _free_impl(self, state: DecodeState, slot):
        state = super()._free_impl(state, slot)
        state.page_table = state.page_table.at[slot].set(self.scratch_page)
        return state


@functools.lru_cache(maxsize=32)
def engine_steps(cfg: ModelConfig, mesh: Mesh, max_slots: int, max_len: int, buckets=None,
                 cache_dtype: str | None = None, paging: tuple[int, int] | None = None) -> EngineSteps:
    """A shared `EngineSteps` per configuration, so engines built alike reuse compilations.
    paging: None for the dense cache, or (page_size, num_pages) for `engine.paged`'s."""
    buckets = None if buckets is None else tuple(buckets)
    if paging is None:
        return EngineSteps(cfg, mesh, max_slots, max_len, buckets, cache_dtype)
    return PagedEngineSteps(cfg, mesh, max_slots, max_len, buckets, cache_dtype,
                            page_size=paging[0], num_pages=paging[1])
