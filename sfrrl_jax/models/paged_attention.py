"""Decode attention that reads a paged KV cache in place: a Pallas GPU (Triton) kernel, run in
Pallas interpret mode on CPU.

The engine's paged cache (`engine.pages`, `engine.paged`) keeps keys and values in a pool of
pages; its gather path copies a slot's pages into a contiguous [k_len] view per layer and step
and attends to the whole view (window layers included). This kernel reads only the pages a query
can see, where they lie: for a window layer only the window's pages, for every layer only the
pages below the slot's length. The function is the gather path's, for one new token per slot:

  q [batch, heads, head_dim]: the new token's queries, at position q_pos [batch] int32;
  pool_k, pool_v [units, page_size, kv_heads, head_dim]: the pages (cache dtype);
  units [batch, pages] int32: the pool units holding positions p*page_size .. of each row;
  k_new, v_new [batch, kv_heads, head_dim]: the new token's keys and values (the step's own, as
    written to the cache: rounded to the pool's dtype here, as the gather path reads them back);
  valid_len [batch] int32, k_len (static): key position j is visible to the query iff
    j <= q_pos, j < valid_len, j < k_len and (window <= 0 or q_pos - j < window); position
    q_pos is the new token itself (k_new, v_new), positions below it come from the pool;
  window: int scalar, may be traced; sinks [heads] or None: fp32 logits that join each row's
    softmax denominator only (GPT-OSS). A row that sees nothing outputs 0.
  Returns [batch, heads, head_dim] in q's dtype; scores, softmax statistics and accumulation fp32.

Kernel: grid (batch, kv_heads, splits). A program folds blocks of `block_k` tokens (whole pages,
gathered by their unit ids) of one row's live range into an online softmax for the query heads
of one kv head (padded to 16 rows, Triton's smallest dot), and writes its partial (acc, max,
denominator). Splitting a row's range over programs (flash-decoding) keeps a long context busy
at small batch; XLA merges the splits with the new token's own score and the sinks (O(batch x
heads) work). The live range per row ([first, last] token: the window's start, the slot's
length) is computed outside the kernel and read as scalars by program id.

Triton restrictions: page_size and head_dim must be powers of two, head_dim >= 16 (the pool is
not padded: that would copy it every step); block_k is rounded to whole pages and to at least 16
tokens. `check_paged_kernel` says whether a layout qualifies.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from sfrrl_jax.mesh import TOKEN_AXES
from sfrrl_jax.models.layers import attend, attention_mask, kernel_split

_F32_MIN = float(jnp.finfo(jnp.float32).min)
_MIN_TILE = 16   # tl.dot needs every matmul dimension >= 16
_BOUNDS = 4      # per row: first block, end block, first visible token, end of visible tokens


def _is_pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def check_paged_kernel(page_size: int, head_dim: int) -> str | None:
    """Why the kernel cannot read this layout (a sentence naming the value), or None if it can."""
    if not _is_pow2(int(page_size)):
        return f"page_size={page_size} is not a power of two (a Triton tile is a whole number of pages)"
    if not _is_pow2(int(head_dim)) or head_dim < _MIN_TILE:
        return f"head_dim={head_dim} is not a power of two >= {_MIN_TILE} (Triton tile)"
    return None


def _pages_per_block(page_size: int, block_k: int) -> int:
    """Pages folded per kernel step: block_k tokens' worth, at least one page and 16 tokens."""
    tokens = max(int(block_k), _MIN_TILE, page_size)
    return max(1, 1 << (tokens // page_size).bit_length() - 1)


def _kernel(bounds_ref, units_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, scale, ppb,
            page_size, splits):
    """One (row, kv head, split): q_ref [gpad, d]; k_ref, v_ref [units, page_size, d] (this kv
    head's slice of the pool); units_ref [pages] (this row's); outputs acc [gpad, d], m, l [gpad]."""
    bi, sp = pl.program_id(0), pl.program_id(2)
    lo, hi = bounds_ref[bi, 0], bounds_ref[bi, 1]
    first, end = bounds_ref[bi, 2], bounds_ref[bi, 3]
    per = (hi - lo + splits - 1) // splits
    my_lo = lo + sp * per
    my_hi = jnp.minimum(hi, my_lo + per)
    q = q_ref[...]
    gpad, d = q.shape
    block = ppb * page_size

    def fold(j, carry):
        m, l, acc = carry
        pages = units_ref[pl.ds(j * ppb, ppb)]                        # [ppb] pool units
        k = k_ref[pages].reshape(block, d).astype(q.dtype)           # [block, d]
        v = v_ref[pages].reshape(block, d).astype(q.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale   # [gpad, block]
        tok = j * block + jnp.arange(block, dtype=jnp.int32)
        live = ((tok >= first) & (tok < end))[None, :]
        # where, not a large negative: a block's dead columns add exactly nothing
        m_new = jnp.maximum(m, jnp.max(jnp.where(live, s, -jnp.inf), axis=1))
        p = jnp.where(live, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (jnp.full((gpad,), _F32_MIN, jnp.float32), jnp.zeros((gpad,), jnp.float32),
            jnp.zeros((gpad, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(my_lo, jnp.maximum(my_lo, my_hi), fold, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _row_bounds(q_pos, valid_len, window, k_len, block):
    """[b, 4] int32: first and end block, first visible token and end of the pool's visible
    tokens (the new token at q_pos is not read from the pool)."""
    end = jnp.minimum(jnp.minimum(q_pos, valid_len), k_len)
    first = jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)
    first = jnp.minimum(first, end)
    lo = first // block
    hi = jnp.where(end > first, (end + block - 1) // block, lo)
    return jnp.stack([lo, hi, first, end], axis=1).astype(jnp.int32)


def _paged_decode_local(q, pool_k, pool_v, units, q_pos, valid_len, k_new, v_new, window, sinks, *,
                        k_len, block_k, splits, interpret):
    """The kernel and the merge on one device's rows and kv heads (shapes as the module's)."""
    b, h, d = q.shape
    page_size, kvh = pool_k.shape[1], pool_k.shape[2]
    g = h // kvh
    gpad = max(_MIN_TILE, 1 << (g - 1).bit_length())
    ppb = _pages_per_block(page_size, block_k)
    block = ppb * page_size
    read_pages = min(units.shape[1], -(-k_len // page_size))
    n_blocks = -(-read_pages // ppb)
    if splits is None:  # enough programs to keep a GPU's SMs busy, never more than the blocks
        splits = max(1, min(n_blocks, 256 // max(1, b * kvh)))
    splits = int(max(1, min(splits, n_blocks)))
    # pad the table to whole blocks with unit 0: those columns lie past `end` and are masked
    units = jnp.pad(units[:, :read_pages].astype(jnp.int32), ((0, 0), (0, n_blocks * ppb - read_pages)))
    window = jnp.asarray(window, jnp.int32)
    bounds = _row_bounds(q_pos.astype(jnp.int32), valid_len.astype(jnp.int32), window, k_len, block)
    scale = 1.0 / math.sqrt(d)
    qg = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, gpad - g), (0, 0)))

    pool_spec = pl.BlockSpec((pool_k.shape[0], page_size, None, d), lambda bi, kh, sp: (0, 0, kh, 0))
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, scale=scale, ppb=ppb, page_size=page_size, splits=splits),
        grid=(b, kvh, splits),
        in_specs=[pl.BlockSpec(bounds.shape, lambda *_: (0, 0)),
                  pl.BlockSpec((None, units.shape[1]), lambda bi, kh, sp: (bi, 0)),
                  pl.BlockSpec((None, None, gpad, d), lambda bi, kh, sp: (bi, kh, 0, 0)),
                  pool_spec, pool_spec],
        out_specs=[pl.BlockSpec((None, None, None, gpad, d), lambda bi, kh, sp: (bi, kh, sp, 0, 0)),
                   pl.BlockSpec((None, None, None, gpad), lambda bi, kh, sp: (bi, kh, sp, 0)),
                   pl.BlockSpec((None, None, None, gpad), lambda bi, kh, sp: (bi, kh, sp, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, splits, gpad, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, gpad), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, gpad), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="sfrrl_paged_decode",
    )(bounds, units, qg, pool_k, pool_v)
    # [b, kvh, splits, gpad, ...] -> [b, h, splits, ...]
    acc = jnp.moveaxis(acc[:, :, :, :g], 2, 3).reshape(b, h, splits, d)
    m = jnp.moveaxis(m[:, :, :, :g], 2, 3).reshape(b, h, splits)
    l = jnp.moveaxis(l[:, :, :, :g], 2, 3).reshape(b, h, splits)

    # The new token's own key and value, as the gather path reads them back from the cache.
    k_self = jnp.repeat(k_new.astype(pool_k.dtype).astype(q.dtype), g, axis=1)   # [b, h, d]
    v_self = jnp.repeat(v_new.astype(pool_v.dtype).astype(q.dtype), g, axis=1)
    s_self = jnp.einsum("bhd,bhd->bh", q, k_self, preferred_element_type=jnp.float32) * scale
    self_live = (q_pos < jnp.minimum(valid_len, k_len))[:, None]               # [b, 1]
    top = jnp.max(m, axis=2)
    top = jnp.maximum(top, jnp.where(self_live, s_self, _F32_MIN))
    if sinks is not None:
        top = jnp.maximum(top, sinks.astype(jnp.float32)[None, :])
    w = jnp.where(l > 0, jnp.exp(m - top[:, :, None]), 0.0)                   # [b, h, splits]
    w_self = jnp.where(self_live, jnp.exp(s_self - top), 0.0)                 # [b, h]
    den = jnp.sum(w * l, axis=2) + w_self
    if sinks is not None:
        den = den + jnp.exp(sinks.astype(jnp.float32)[None, :] - top)
    num = jnp.einsum("bhs,bhsd->bhd", w, acc) + w_self[:, :, None] * v_self.astype(jnp.float32)
    out = jnp.where(den[:, :, None] > 0, num / jnp.where(den > 0, den, 1.0)[:, :, None], 0.0)
    return out.astype(q.dtype)


def paged_decode_reference(q, pool_k, pool_v, units, q_pos, valid_len, k_new, v_new, window=0, sinks=None, *,
                           k_len: int) -> jax.Array:
    """The function `paged_decode_attention` computes, as the engine's gather path computes it
    (`engine.model_step.extend_paged`'s read for one new token a row): each row's pages copied
    into a [k_len] view, the new token's key/value written over position q_pos, `layers.attend`
    with the cache mask. Same arguments and result; builds the [batch, k_len] views and scores
    (the reference in tests and benchmarks, not a path to run at length)."""
    b, page_size = q.shape[0], pool_k.shape[1]
    pages = -(-k_len // page_size)

    def view(pool, new):
        g = pool[units[:, :pages]].reshape((b, pages * page_size) + pool.shape[2:])[:, :k_len]
        g = g.at[jnp.arange(b)[:, None], q_pos[:, None]].set(new[:, None].astype(pool.dtype), mode="drop")
        return g.astype(q.dtype)

    k_pos = jnp.broadcast_to(jnp.arange(k_len, dtype=jnp.int32), (b, k_len))
    mask = attention_mask(q_pos[:, None], k_pos, jnp.ones((b, 1), jnp.int32), jnp.ones_like(k_pos), window,
                          k_pos < valid_len[:, None])
    return attend(q[:, None], view(pool_k, k_new), view(pool_v, v_new), mask, sinks)[:, 0]


def paged_decode_attention(q, pool_k, pool_v, units, q_pos, valid_len, k_new, v_new, window=0,
                           sinks=None, *, k_len: int, block_k: int = 128, splits: int | None = None,
                           interpret: bool | None = None) -> jax.Array:
    """Attention of one new token per row over a paged cache, read in place (module docstring).

    k_len (static): positions >= k_len are not read (the decode bucket's cache length).
    block_k (static): tokens folded per kernel step (rounded to whole pages, >= 16).
    splits (static): programs a row's range is split over (None: enough for ~256 programs).
    interpret: Pallas interpret mode; None means interpret unless the default backend is a GPU.
    Under a mesh, each device runs its own rows (slots' axes) and kv heads (`tensor`) in
    `shard_map`: the pool is never moved, only split as it already is.
    """
    b, h, d = q.shape
    page_size, kvh = pool_k.shape[1], pool_k.shape[2]
    why = check_paged_kernel(page_size, d)
    if why:
        raise ValueError(f"paged decode kernel: {why}")
    if pool_k.shape != pool_v.shape or pool_k.shape[3] != d:
        raise ValueError(f"pool_k {pool_k.shape} and pool_v {pool_v.shape} must be [units, page_size, "
                         f"kv_heads, {d}]")
    if h % kvh:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kvh}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    local = functools.partial(_paged_decode_local, k_len=int(k_len), block_k=int(block_k), splits=splits,
                              interpret=bool(interpret))
    args = (q, pool_k, pool_v, units, q_pos, valid_len, k_new, v_new, jnp.asarray(window, jnp.int32))
    split = kernel_split(b, h, kvh, row_axes=TOKEN_AXES)   # rows: the slots' axes
    if split is None:
        return local(*args, sinks)
    mesh, free, r_ax, h_ax = split
    specs = (P(r_ax, h_ax, None), P(None, None, h_ax, None), P(None, None, h_ax, None), P(r_ax, None),
             P(r_ax), P(r_ax), P(r_ax, h_ax, None), P(r_ax, h_ax, None), P())
    if sinks is not None:
        args, specs = args + (sinks,), specs + (P(h_ax),)
    return jax.shard_map(lambda *a: local(*a[:9], a[9] if len(a) > 9 else None), mesh=mesh,
                         in_specs=specs, out_specs=P(r_ax, h_ax, None), axis_names=frozenset(free),
                         check_vma=False)(*args)
