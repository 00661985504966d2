"""Flash attention as Pallas GPU (Triton) kernels, forward and backward; interpret mode on CPU.

`pallas_attention` computes exactly the function of `attention.blockwise_attention` (and of the
naive `layers.attend(q, k, v, layers.attention_mask(q_pos, k_pos, q_seg, k_seg, window), sinks)`):

  q [batch, q_len, heads, head_dim]; k, v [batch, k_len, kv_heads, head_dim], heads a multiple of
  kv_heads (query head h reads kv head h // (heads // kv_heads));
  q_pos, q_seg [batch, q_len], k_pos, k_seg [batch, k_len] int;
  window: int scalar, may be traced (<= 0: unlimited); sinks [heads] or None: fp32 logits that
  join each row's softmax denominator only (GPT-OSS).
  Query i sees key j iff k_pos[j] <= q_pos[i], k_seg[j] == q_seg[i] and (window <= 0 or
  q_pos[i] - k_pos[j] < window). A row that sees nothing outputs 0. Returns q's shape and dtype;
  softmax statistics and accumulation are fp32.

Kernels (FlashAttention-2's recipe), each a `pl.pallas_call` over a grid with BlockSpecs:
  forward  grid (q blocks, batch, heads): one query block stays resident while a `fori_loop` folds
           key blocks into an online softmax (running max m, denominator l, weighted sum acc);
           writes the output and the per-row logsumexp (the only residual besides the inputs).
  dq       grid (q blocks, batch, heads): recomputes each block's probabilities from the lse.
  dk, dv   grid (k blocks, batch, kv_heads): loops over the group's query heads and the query
           blocks, so GQA's dk/dv sum over the group inside the kernel (no [heads]-sized copy).
  delta = rowsum(dO * O) and the sinks' gradient are O(seq) elementwise work left to XLA.

Block skipping: per (batch row, block) min/max of positions and segment ids (over real entries)
decide, outside the kernels, which block pairs can hold a visible pair (a necessary condition,
so skipping is exact); each kernel loops only from its first to its last live partner block.
The bounds are passed as a small int array and read as scalars by program id.

Triton restrictions, handled here: block lengths must be powers of two >= 16 (ValueError
otherwise; a block is shrunk to the next power of two >= 16 covering a short sequence);
head_dim is zero-padded to a power of two >= 16 (zero columns change no score; the 1/sqrt(d)
scale uses the real head_dim). Odd lengths are padded to a block multiple with sentinel segment
ids that match nothing (as in attention.py) and sliced off. q, k and v must share head_dim.
On GPU, fp32 inputs use IEEE fp32 dots (Pallas' default for fp32), bf16 inputs bf16 dots with
fp32 accumulation.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sfrrl_jax.models.attention import _PAD_K_SEG, _PAD_Q_SEG, _block_bounds, _pad_to

_F32_MIN = float(jnp.finfo(jnp.float32).min)
_MIN_BLOCK = 16  # Triton's tl.dot needs every matmul dimension >= 16
# The backward kernels use blocks of at most this length: they hold two fp32 [block, head_dim]
# accumulators plus k, v (or q, do) tiles, and 128-long tiles spill. On an H200 (bf16, 32 heads,
# 8 kv heads, head_dim 128, causal, t=16384) fwd+bwd took 52 ms with 128x128 backward blocks,
# 34 ms with 128x64 and 29 ms with 64x64 (4 warps); the forward was best at 128x128, 8 warps.
# With the defaults (forward 128x128, backward 64x64) it runs at 10.1 ms forward, 28.4 ms
# forward+backward (217 and 271 TFLOP/s); blockwise_attention's XLA loops took 3x as long at 4k.
_BWD_BLOCK = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_for(n: int, block: int, name: str) -> int:
    """The block length used for a sequence of n: `block`, or less when the sequence is shorter."""
    ok = isinstance(block, int) and not isinstance(block, bool)
    if not ok or block < _MIN_BLOCK or block & (block - 1):
        raise ValueError(f"{name}={block!r} must be a power of two >= {_MIN_BLOCK} (Triton tile)")
    return min(block, max(_MIN_BLOCK, _next_pow2(n)))


# -- which block pairs can hold a visible pair, per batch row ------------------------------------

def _loop_bounds(q_pos, q_seg, k_pos, k_seg, t, s, bq, bk, window):
    """(fwd [b, nq, 2], bwd [b, nk, 2]) int32: for each query block the [first, last + 1) key
    blocks to visit, for each key block the query blocks; (0, 0) where nothing is live.

    Each test is necessary for a visible pair: same segment => the blocks' segment ranges overlap;
    k_pos <= q_pos => min k_pos <= max q_pos; q_pos - k_pos < window => min q_pos - max k_pos <
    window. Empty (all-padding) blocks have min > max and fail the segment test (the position
    arithmetic may wrap for them, harmlessly)."""
    nq, nk = q_pos.shape[1] // bq, k_pos.shape[1] // bk
    qsmin, qsmax, qpmin, qpmax = (x[:, :, None] for x in _block_bounds(q_pos, q_seg, t, nq, bq))
    ksmin, ksmax, kpmin, kpmax = (x[:, None, :] for x in _block_bounds(k_pos, k_seg, s, nk, bk))
    live = (qsmin <= ksmax) & (ksmin <= qsmax) & (kpmin <= qpmax)
    live &= (window <= 0) | (qpmin - kpmax < window)  # [b, nq, nk]

    def first_last(live):  # [b, n, m] -> [b, n, 2]: first live column, last live column + 1
        m = live.shape[-1]
        first = jnp.argmax(live, axis=-1)
        last = m - jnp.argmax(live[..., ::-1], axis=-1)
        any_live = jnp.any(live, axis=-1)
        return jnp.stack([jnp.where(any_live, first, 0), jnp.where(any_live, last, 0)],
                         axis=-1).astype(jnp.int32)

    return first_last(live), first_last(jnp.swapaxes(live, 1, 2))


# -- kernel pieces shared by the three kernels --------------------------------------------------

def _scores(q, k, scale):
    """[bq, d] x [bk, d] -> [bq, bk] fp32: the product first, then the scale (the reference's
    rounding order)."""
    return _mm_nt(q, k) * scale


def _mask(qp, qs, kp, ks, window):
    """[bq] x [bk] int -> [bq, bk] bool: the reference mask for one block pair."""
    qp, qs, kp, ks = qp[:, None], qs[:, None], kp[None, :], ks[None, :]
    return (kp <= qp) & (qs == ks) & ((window <= 0) | (qp - kp < window))


def _mm_nt(a, b):  # [m, k] x [n, k]^T -> [m, n] fp32
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _mm(a, b):  # [m, k] x [k, n] -> [m, n] fp32
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _mm_t(a, b):  # [k, m]^T x [k, n] -> [m, n] fp32 (Triton lowers the transpose itself)
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# -- forward kernel -----------------------------------------------------------------------------

def _fwd_kernel(bounds_ref, win_ref, sinks_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref,
                ks_ref, o_ref, lse_ref, *, scale, block_k, use_sinks):
    i, bi, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    window = win_ref[0]
    q, qp, qs = q_ref[...], qp_ref[...], qs_ref[...]
    bq, d = q.shape
    if use_sinks:
        # The sink is one more logit in each row: start the running max at it, with denominator
        # exp(sink - sink) = 1 and nothing in the weighted sum.
        m0 = jnp.zeros((bq,), jnp.float32) + sinks_ref[h]
        l0 = jnp.ones((bq,), jnp.float32)
    else:
        m0 = jnp.full((bq,), _F32_MIN, jnp.float32)
        l0 = jnp.zeros((bq,), jnp.float32)
    acc0 = jnp.zeros((bq, d), jnp.float32)

    def fold(j, carry):
        m, l, acc = carry
        kslice = pl.ds(j * block_k, block_k)
        s = _scores(q, k_ref[kslice, :], scale)
        mask = _mask(qp, qs, kp_ref[kslice], ks_ref[kslice], window)
        # Masked entries are dropped with where (not a large negative), so a fully masked block
        # leaves m unchanged and adds exactly nothing.
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        v = v_ref[kslice, :]
        acc = acc * alpha[:, None] + _mm(p.astype(v.dtype), v)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    m, l, acc = jax.lax.fori_loop(bounds_ref[bi, i, 0], bounds_ref[bi, i, 1], fold, (m0, l0, acc0))
    # l == 0 only for rows that see nothing (and have no sink): output 0, lse 0 (unused: their
    # probabilities are masked to 0 in the backward).
    live = l > 0
    safe_l = jnp.where(live, l, 1.0)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(live, m + jnp.log(safe_l), 0.0)


# -- backward kernels ---------------------------------------------------------------------------

def _dq_kernel(bounds_ref, win_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, scale, block_k):
    i, bi = pl.program_id(0), pl.program_id(1)
    window = win_ref[0]
    q, qp, qs, do = q_ref[...], qp_ref[...], qs_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def fold(j, dq):
        kslice = pl.ds(j * block_k, block_k)
        k, v = k_ref[kslice, :], v_ref[kslice, :]
        s = _scores(q, k, scale)
        mask = _mask(qp, qs, kp_ref[kslice], ks_ref[kslice], window)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        dp = _mm_nt(do, v)
        # dS = P * (dP - D): the softmax Jacobian, D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij.
        ds = p * (dp - delta[:, None]) * scale
        return dq + _mm(ds.astype(k.dtype), k)

    dq0 = jnp.zeros(q.shape, jnp.float32)
    dq = jax.lax.fori_loop(bounds_ref[bi, i, 0], bounds_ref[bi, i, 1], fold, dq0)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(bounds_ref, win_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, scale, block_q, group):
    j, bi = pl.program_id(0), pl.program_id(1)
    window = win_ref[0]
    k, v, kp, ks = k_ref[...], v_ref[...], kp_ref[...], ks_ref[...]

    def fold(gi, i, carry):  # query head gi of this kv head's group, query block i
        dk, dv = carry
        qslice = pl.ds(i * block_q, block_q)
        q, do = q_ref[qslice, gi, :], do_ref[qslice, gi, :]
        lse, delta = lse_ref[gi, qslice], delta_ref[gi, qslice]
        s = _scores(q, k, scale)
        mask = _mask(qp_ref[qslice], qs_ref[qslice], kp, ks, window)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        dv = dv + _mm_t(p.astype(do.dtype), do)
        dp = _mm_nt(do, v)
        ds = p * (dp - delta[:, None]) * scale
        return dk + _mm_t(ds.astype(q.dtype), q), dv

    lo, hi = bounds_ref[bi, j, 0], bounds_ref[bi, j, 1]

    def head(gi, carry):
        return jax.lax.fori_loop(lo, hi, functools.partial(fold, gi), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# -- pallas_call wiring -------------------------------------------------------------------------
# All arrays here are padded: q [b, t, h, d]; k, v [b, s, kvh, d] (t, s block multiples, d a
# power of two); positions/segments [b, t] / [b, s] int32; window [1] int32; sinks [h] fp32;
# bounds = (fwd [b, nq, 2], dq [b, nq', 2], dkv [b, nk', 2]) int32, the last two for the backward
# blocks. cfg = (block_q, block_k, bwd_block_q, bwd_block_k, scale, use_sinks, interpret).

def _whole(x):
    """A BlockSpec handing each program the whole (small) array; it reads scalars by program id."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _params(num_warps):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=2)


def _forward(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, bounds, cfg):
    block_q, block_k, _, _, scale, use_sinks, interpret = cfg
    fwd_bounds = bounds[0]
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    q_blk = pl.BlockSpec((None, block_q, None, d), lambda i, bi, hh: (bi, i, hh, 0))
    kv_all = pl.BlockSpec((None, s, None, d), lambda i, bi, hh: (bi, 0, hh // g, 0))
    qrow = pl.BlockSpec((None, block_q), lambda i, bi, hh: (bi, i))
    krow = pl.BlockSpec((None, s), lambda i, bi, hh: (bi, 0))
    kernel = functools.partial(_fwd_kernel, scale=scale, block_k=block_k, use_sinks=use_sinks)
    return pl.pallas_call(
        kernel,
        grid=(t // block_q, b, h),
        in_specs=[_whole(fwd_bounds), _whole(window), _whole(sinks), q_blk, kv_all, kv_all,
                  qrow, qrow, krow, krow],
        out_specs=[q_blk, pl.BlockSpec((None, None, block_q), lambda i, bi, hh: (bi, hh, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
        # 8 warps only for big tiles: on the H200 run above, 128x128 blocks with head_dim 128 took
        # 10 ms with 8 warps (19 ms with 4); 64x64 blocks 10 ms with 4 warps (21 ms with 8).
        compiler_params=_params(8 if block_q * d >= 128 * 128 else 4),
        interpret=interpret,
        name="sfrrl_flash_fwd",
    )(fwd_bounds, window, sinks, q, k, v, q_pos, q_seg, k_pos, k_seg)


def _backward(q, k, v, q_pos, k_pos, q_seg, k_seg, window, bounds, dout, lse, delta, cfg):
    _, _, block_q, block_k, scale, _, interpret = cfg
    _, dq_bounds, dkv_bounds = bounds
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh

    # dq: one query block of one head per program, looping over its live key blocks.
    q_blk = pl.BlockSpec((None, block_q, None, d), lambda i, bi, hh: (bi, i, hh, 0))
    kv_all = pl.BlockSpec((None, s, None, d), lambda i, bi, hh: (bi, 0, hh // g, 0))
    qrow = pl.BlockSpec((None, block_q), lambda i, bi, hh: (bi, i))
    krow = pl.BlockSpec((None, s), lambda i, bi, hh: (bi, 0))
    stat = pl.BlockSpec((None, None, block_q), lambda i, bi, hh: (bi, hh, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=block_k),
        grid=(t // block_q, b, h),
        in_specs=[_whole(dq_bounds), _whole(window), q_blk, kv_all, kv_all, qrow, qrow, krow, krow,
                  q_blk, stat, stat],
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(4),
        interpret=interpret,
        name="sfrrl_flash_dq",
    )(dq_bounds, window, q, k, v, q_pos, q_seg, k_pos, k_seg, dout, lse, delta)

    # dk, dv: one key block of one kv head per program, looping over the group's query heads
    # and their live query blocks. Views: q, dout [b, t, kvh, g, d]; lse, delta [b, kvh, g, t].
    q_all = pl.BlockSpec((None, t, None, g, d), lambda j, bi, kh: (bi, 0, kh, 0, 0))
    k_blk = pl.BlockSpec((None, block_k, None, d), lambda j, bi, kh: (bi, j, kh, 0))
    qrow_all = pl.BlockSpec((None, t), lambda j, bi, kh: (bi, 0))
    krow_blk = pl.BlockSpec((None, block_k), lambda j, bi, kh: (bi, j))
    stat_all = pl.BlockSpec((None, None, g, t), lambda j, bi, kh: (bi, kh, 0, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=block_q, group=g),
        grid=(s // block_k, b, kvh),
        in_specs=[_whole(dkv_bounds), _whole(window), q_all, k_blk, k_blk, qrow_all, qrow_all,
                  krow_blk, krow_blk, q_all, stat_all, stat_all],
        out_specs=[k_blk, k_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(4),
        interpret=interpret,
        name="sfrrl_flash_dkv",
    )(dkv_bounds, window, q.reshape(b, t, kvh, g, d), k, v, q_pos, q_seg, k_pos, k_seg,
      dout.reshape(b, t, kvh, g, d), lse.reshape(b, kvh, g, t), delta.reshape(b, kvh, g, t))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _flash(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, bounds, cfg):
    return _forward(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, bounds, cfg)[0]


def _flash_fwd(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, bounds, cfg):
    out, lse = _forward(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, bounds, cfg)
    # Same names as blockwise_attention's, so the 'attention_out' remat policies keep these and
    # the backward never re-runs the forward kernel.
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    # Residuals are O(seq): inputs, output, logsumexp.
    return out, (q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, bounds, out, lse)


def _flash_bwd(cfg, res, dout):
    q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, bounds, out, lse = res
    use_sinks = cfg[5]
    # D = rowsum(dO * O) [b, h, t]: elementwise, XLA fuses it.
    delta = jnp.einsum("bthd,bthd->bht", dout.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = _backward(q, k, v, q_pos, k_pos, q_seg, k_seg, window, bounds, dout, lse, delta,
                           cfg)
    if use_sinks:
        # d out / d sink = -p_sink * out, so dL/dsink_h = -sum over rows of p_sink * D. Padded
        # rows have dO = 0, hence D = 0, and add nothing.
        dsinks = -jnp.sum(jnp.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2))
    else:
        dsinks = jnp.zeros_like(sinks)
    return dq, dk, dv, dsinks, None, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# -- public entry point ------------------------------------------------------------------------

def pallas_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, window=0, sinks=None, *,
                     block_q: int = 128, block_k: int = 128,
                     interpret: bool | None = None) -> jax.Array:
    """Grouped-query flash attention as Pallas kernels; same function as `blockwise_attention`.

    Shapes and semantics in the module docstring. block_q, block_k: static powers of two >= 16
    (shrunk for short sequences). interpret: run the kernels in Pallas interpret mode; None means
    interpret unless `jax.default_backend() == 'gpu'` (the kernels are Triton kernels: on TPU
    or CPU they only run interpreted, slowly). Differentiable in q, k, v and sinks.
    """
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [batch, k_len, kv_heads, {d}]")
    if h % kvh:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kvh}")
    bq, bk = _block_for(t, block_q, "block_q"), _block_for(s, block_k, "block_k")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    t_pad, s_pad = -(-t // bq) * bq, -(-s // bk) * bk
    d_pad = max(_MIN_BLOCK, _next_pow2(d))
    window = jnp.asarray(window, jnp.int32)

    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)
    q_seg, k_seg = q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)
    # Padded queries and keys get distinct sentinel segments: they see nothing, nothing sees them.
    qp, kp = _pad_to(q_pos, t_pad, 1), _pad_to(k_pos, s_pad, 1)
    qs, ks = _pad_to(q_seg, t_pad, 1, _PAD_Q_SEG), _pad_to(k_seg, s_pad, 1, _PAD_K_SEG)
    # The backward blocks divide the forward ones (powers of two), so the padding serves both.
    bq_bwd, bk_bwd = min(bq, _BWD_BLOCK), min(bk, _BWD_BLOCK)
    fwd_bounds, _ = _loop_bounds(qp, qs, kp, ks, t, s, bq, bk, window)
    dq_bounds, dkv_bounds = _loop_bounds(qp, qs, kp, ks, t, s, bq_bwd, bk_bwd, window)

    def pad(x, length):  # sequence to `length`, head_dim to d_pad, with zeros
        return _pad_to(_pad_to(x, length, 1), d_pad, 3)

    use_sinks = sinks is not None
    sinks32 = sinks.astype(jnp.float32) if use_sinks else jnp.zeros((h,), jnp.float32)
    cfg = (bq, bk, bq_bwd, bk_bwd, 1.0 / math.sqrt(d), use_sinks, bool(interpret))
    out = _flash(pad(q, t_pad), pad(k, s_pad), pad(v, s_pad), sinks32, qp, kp, qs, ks,
                 window.reshape(1), (fwd_bounds, dq_bounds, dkv_bounds), cfg)
    return out[:, :t, :, :d]
