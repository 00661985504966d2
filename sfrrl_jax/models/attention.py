"""Memory-efficient (blockwise, flash-style) attention in pure JAX, with its own backward.

`blockwise_attention` computes the same function as `layers.attend(q, k, v, attention_mask(...))`
without ever materialising a [q_len, k_len] array: queries and keys are cut into blocks, each
(query block, key block) pair's scores and mask are computed on the fly from positions, segment
ids and the window, and an online softmax (running max `m`, running denominator `l`, running
weighted sum `acc`, all fp32) folds the key blocks in one at a time. The backward is a
`jax.custom_vjp` that keeps only the inputs, the output and the per-row logsumexp, and recomputes
each block's probabilities from them (FlashAttention-2's recipe), so the train step's memory is
linear in the sequence length.

Mask semantics (identical to `layers.attention_mask`): query i sees key j iff
`k_pos[j] <= q_pos[i]`, `k_seg[j] == q_seg[i]` and (`window <= 0` or `q_pos[i] - k_pos[j] <
window`). Segment 0 (padding) is just another segment, as in the reference.

Blocks that no (query, key) pair of any batch row can see are skipped: per-block min/max of
positions and segment ids give, for each query block, the live key blocks (a necessary condition
for any visible pair, so skipping is exact), and each query block loops only from its first to
its last live key block (`fori_loop` with traced bounds; the backward likewise per key block).
For one causal sequence this halves the work; with a sliding window it makes it linear. With
packed rows (segments in order, positions increasing within each) the live blocks of a query
block form one run containing its own diagonal block, so the bounds leave nothing dead inside
(a `lax.cond` per block to skip holes measured no faster on CPU, so there is none).
All shapes are static; odd lengths are padded internally to a multiple of the block size (padded
queries and keys get sentinel segment ids that match nothing real, and are sliced off).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

_F32_MIN = float(jnp.finfo(jnp.float32).min)
_INT_MAX = int(jnp.iinfo(jnp.int32).max)
_INT_MIN = int(jnp.iinfo(jnp.int32).min)
# Padding sentinels: distinct, so padded queries and padded keys never see each other (or anything).
_PAD_Q_SEG = _INT_MIN
_PAD_K_SEG = _INT_MIN + 1


def _block_len(n: int, block: int) -> tuple[int, int]:
    """(number of blocks, block length) covering n with as little padding as possible.

    n <= block: one exact block. Otherwise ceil(n / block) blocks of equal length, rounded up to a
    multiple of 8 (so e.g. n=600, block=512 pads to 2 x 304, not to 1024)."""
    if n <= block:
        return 1, n
    nb = -(-n // block)
    blen = -(-n // nb)
    blen = -(-blen // 8) * 8
    return nb, blen


def _pad_to(x, length: int, axis: int, value=0):
    pad = length - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _block_mask(qp, kp, qs, ks, window):
    """[b, bq] x [b, bk] int -> [b, 1, 1, bq, bk] bool: the reference mask for one block pair."""
    qp, kp = qp[:, :, None], kp[:, None, :]
    mask = (kp <= qp) & (qs[:, :, None] == ks[:, None, :])
    mask &= (window <= 0) | (qp - kp < window)
    return mask[:, None, None]


def _block_bounds(pos, seg, n_real: int, nb: int, blen: int):
    """Per-block (seg_min, seg_max, pos_min, pos_max) over real entries, each [b, nb].

    A block with no real entry gets min > max (it then overlaps no segment range)."""
    b = pos.shape[0]
    real = (jnp.arange(nb * blen) < n_real).reshape(1, nb, blen)
    pos, seg = pos.reshape(b, nb, blen), seg.reshape(b, nb, blen)
    lo = lambda x: jnp.min(jnp.where(real, x, _INT_MAX), axis=-1)  # noqa: E731
    hi = lambda x: jnp.max(jnp.where(real, x, _INT_MIN), axis=-1)  # noqa: E731
    return lo(seg), hi(seg), lo(pos), hi(pos)


def _live_blocks(q_bounds, k_bounds, window):
    """live [nq, nk] bool: some batch row may have a visible (query, key) pair in that block pair.

    Each test is a necessary condition for a visible pair (same segment => the segment ranges
    overlap; k_pos <= q_pos => min k_pos <= max q_pos; q_pos - k_pos < window => min q_pos -
    max k_pos < window), so a block failing any of them is entirely masked. Empty (all-padding)
    blocks fail the segment test; the position arithmetic may wrap for them, harmlessly."""
    qsmin, qsmax, qpmin, qpmax = (x[:, :, None] for x in q_bounds)
    ksmin, ksmax, kpmin, kpmax = (x[:, None, :] for x in k_bounds)
    live = (qsmin <= ksmax) & (ksmin <= qsmax) & (kpmin <= qpmax)
    live &= (window <= 0) | (qpmin - kpmax < window)
    return jnp.any(live, axis=0)


def _loop_bounds(live):
    """For each row of live [n, m]: (first live column, last live column + 1), (0, 0) if none."""
    m = live.shape[1]
    any_live = jnp.any(live, axis=1)
    first = jnp.argmax(live, axis=1).astype(jnp.int32)
    last = (m - jnp.argmax(live[:, ::-1], axis=1)).astype(jnp.int32)
    return jnp.where(any_live, first, 0), jnp.where(any_live, last, 0)


# -- the blocked kernel: inputs already padded and cut into blocks ---------------------------------
# qb [nq, b, kvh, g, bq, d]; kb, vb [nk, b, kvh, bk, d]; q_pos/q_seg [nq, b, bq];
# k_pos/k_seg [nk, b, bk]; sinks [kvh, g] fp32 (ignored unless use_sinks); live [nq, nk] bool.

def _scores(q_blk, k_blk, scale):
    # Same rounding as the reference: fp32 product, then the 1/sqrt(d) scale.
    return jnp.einsum("bkgqd,bksd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def _forward(qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live, use_sinks):
    nq, b, kvh, g, bq, d = qb.shape
    scale = 1.0 / math.sqrt(d)
    lo, hi = _loop_bounds(live)

    def q_block(i):
        q_i, qp_i, qs_i = qb[i], q_pos[i], q_seg[i]
        if use_sinks:
            # The sink is one more logit in every row's softmax: start the running max at it with
            # denominator exp(sink - sink) = 1 and nothing in the weighted sum.
            m0 = jnp.broadcast_to(sinks[None, :, :, None], (b, kvh, g, bq))
            l0 = jnp.ones((b, kvh, g, bq), jnp.float32)
        else:
            m0 = jnp.full((b, kvh, g, bq), _F32_MIN, jnp.float32)
            l0 = jnp.zeros((b, kvh, g, bq), jnp.float32)
        acc0 = jnp.zeros((b, kvh, g, bq, d), jnp.float32)

        def fold(j, carry):
            m, l, acc = carry
            s = _scores(q_i, kb[j], scale)
            mask = _block_mask(qp_i, k_pos[j], qs_i, k_seg[j], window)
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vb.dtype), vb[j],
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * alpha[..., None] + pv

        m, l, acc = jax.lax.fori_loop(lo[i], hi[i], fold, (m0, l0, acc0))
        # l == 0 only for rows that see nothing (padding rows): output 0, lse unused.
        safe_l = jnp.where(l > 0, l, 1.0)
        out = (acc / safe_l[..., None]).astype(qb.dtype)
        lse = jnp.where(l > 0, m + jnp.log(safe_l), 0.0)
        return out, lse

    return jax.lax.map(q_block, jnp.arange(nq))


def _backward(qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live, use_sinks, out, lse, dout):
    nq, b, kvh, g, bq, d = qb.shape
    nk, bk = kb.shape[0], kb.shape[3]
    scale = 1.0 / math.sqrt(d)
    # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the softmax Jacobian's diagonal correction.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [nq, b, kvh, g, bq]
    lo, hi = _loop_bounds(live.T)

    def k_block(dq, j):
        k_j, v_j, kp_j, ks_j = kb[j], vb[j], k_pos[j], k_seg[j]

        def fold(i, carry):
            dk, dv, dq = carry
            q_i, do_i = qb[i], dout[i]
            s = _scores(q_i, k_j, scale)
            mask = _block_mask(q_pos[i], kp_j, q_seg[i], ks_j, window)
            p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(dout.dtype), do_i,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[i][..., None]) * scale
            dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(kb.dtype), k_j,
                              preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, axis=0)
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(qb.dtype), q_i,
                                 preferred_element_type=jnp.float32)
            return dk, dv, dq

        zeros = jnp.zeros((b, kvh, bk, d), jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(lo[j], hi[j], fold, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(k_block, jnp.zeros(qb.shape, jnp.float32), jnp.arange(nk))
    dsinks = None
    if use_sinks:
        # d out / d sink = -p_sink * out, so dL/dsink = -sum over rows of p_sink * D.
        p_sink = jnp.exp(sinks[None, None, :, :, None] - lse)
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 1, 4))
    return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), dsinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _blocked_attention(qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live, use_sinks):
    return _forward(qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live, use_sinks)[0]


def _blocked_fwd(qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live, use_sinks):
    out, lse = _forward(qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live, use_sinks)
    # Named for the 'attention_out' remat policies: saving these spares the backward a re-run of
    # this forward (the inputs q, k, v are cheap projections to recompute).
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    # Residuals are O(seq): inputs, output, logsumexp. No [q_len, k_len] array survives.
    return out, (qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live, out, lse)


def _blocked_bwd(use_sinks, res, dout):
    qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live, out, lse = res
    dq, dk, dv, dsinks = _backward(qb, kb, vb, sinks, q_pos, k_pos, q_seg, k_seg, window, live,
                                   use_sinks, out, lse, dout)
    if dsinks is None:
        dsinks = jnp.zeros_like(sinks)
    return dq, dk, dv, dsinks, None, None, None, None, None, None


_blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)


# -- public entry point ------------------------------------------------------------------------

def blockwise_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, window=0, sinks=None, *,
                        block_q: int = 512, block_k: int = 512) -> jax.Array:
    """Grouped-query attention without a [q_len, k_len] array, forward and backward.

    q [batch, q_len, heads, head_dim]; k, v [batch, k_len, kv_heads, head_dim] (heads a multiple
    of kv_heads: query head h reads kv head h // (heads // kv_heads));
    q_pos, q_seg [batch, q_len] and k_pos, k_seg [batch, k_len] int: positions and segment ids;
    window: int scalar, may be traced (0 or less = unlimited); sinks [heads] or None: learned
    logits joining each row's softmax denominator only (GPT-OSS).
    block_q, block_k: static block lengths (clipped to the lengths; odd lengths are padded).
    Returns [batch, q_len, heads, head_dim] in q's dtype; equals
    `layers.attend(q, k, v, layers.attention_mask(q_pos, k_pos, q_seg, k_seg, window), sinks)`
    up to fp32 rounding. Softmax statistics and accumulation are fp32.
    """
    b, t, h, d = q.shape
    s_len, kvh = k.shape[1], k.shape[2]
    if h % kvh:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kvh}")
    g = h // kvh
    nq, bq = _block_len(t, block_q)
    nk, bk = _block_len(s_len, block_k)
    window = jnp.asarray(window, jnp.int32)

    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)
    q_seg, k_seg = q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)
    q_bounds = _block_bounds(_pad_to(q_pos, nq * bq, 1), _pad_to(q_seg, nq * bq, 1), t, nq, bq)
    k_bounds = _block_bounds(_pad_to(k_pos, nk * bk, 1), _pad_to(k_seg, nk * bk, 1), s_len, nk, bk)
    live = _live_blocks(q_bounds, k_bounds, window)

    def blocks_of(x, n, blen, pad_value):  # [b, n*blen, ...] -> [n, b, blen, ...]
        x = _pad_to(x, n * blen, 1, pad_value)
        return jnp.moveaxis(x.reshape((b, n, blen) + x.shape[2:]), 1, 0)

    qp_b, qs_b = blocks_of(q_pos, nq, bq, 0), blocks_of(q_seg, nq, bq, _PAD_Q_SEG)
    kp_b, ks_b = blocks_of(k_pos, nk, bk, 0), blocks_of(k_seg, nk, bk, _PAD_K_SEG)
    # q [b, t, h, d] -> [nq, b, kvh, g, bq, d]; k, v [b, s, kvh, d] -> [nk, b, kvh, bk, d]
    qb = blocks_of(q.reshape(b, t, kvh, g, d), nq, bq, 0).transpose(0, 1, 3, 4, 2, 5)
    kb = blocks_of(k, nk, bk, 0).transpose(0, 1, 3, 2, 4)
    vb = blocks_of(v, nk, bk, 0).transpose(0, 1, 3, 2, 4)
    use_sinks = sinks is not None
    sinks_g = (sinks.astype(jnp.float32).reshape(kvh, g) if use_sinks
               else jnp.zeros((kvh, g), jnp.float32))

    out = _blocked_attention(qb, kb, vb, sinks_g, qp_b, kp_b, qs_b, ks_b, window, live, use_sinks)
    # [nq, b, kvh, g, bq, d] -> [b, t, h, d]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, h, d)
    return out[:, :t]
