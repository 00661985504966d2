"""Dense building blocks: RMSNorm, embedding, rotary embeddings (default and YaRN), attention.

Every `nnx.Param` carries `logical_axes`, one logical name per dimension; `sfrrl_jax.mesh`
turns those into shardings. Parameters are stored in `cfg.param_dtype` and cast to
`cfg.compute_dtype` where used; norms, softmax and rotary phases run in fp32.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec as P

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import BATCH_AXES, TENSOR_AXIS, concrete_mesh_in_trace, constrain
from sfrrl_jax.models.attention import blockwise_attention
from sfrrl_jax.models.attention_pallas import pallas_attention
from sfrrl_jax.models.context_parallel import context_parallel_attention, context_size
from sfrrl_jax.models.lora_weight import LoraWeight, low_rank_delta


def param(rngs: nnx.Rngs | None, init: str, shape, logical_axes, cfg: ModelConfig, dtype=None) -> nnx.Param:
    """A parameter initialised as 'normal' (std cfg.init_std), 'ones' or 'zeros', stored in `dtype`
    (default cfg.param_dtype)."""
    assert len(shape) == len(logical_axes), (shape, logical_axes)
    dtype = jnp.dtype(cfg.param_dtype if dtype is None else dtype)
    if init == "normal":
        value = cfg.init_std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


def cdtype(cfg: ModelConfig):
    return jnp.dtype(cfg.compute_dtype)


def project(x: jax.Array, w: jax.Array, n_in: int = 1, preferred_element_type=None) -> jax.Array:
    """A projection: x [..., *in] times w [*in, *out] -> [..., *out], contracting x's trailing
    `n_in` dims with w's leading ones (e.g. x [b, s, embed] and w [embed, heads, hd] give
    [b, s, heads, hd]; x [b, s, heads, hd] and w [heads, hd, embed] with n_in=2 give [b, s, embed]).

    It is one 2-D matmul, [tokens, in] x [in, out], on reshaped views, not an einsum over the
    token dims. Why: the weight gradient of an einsum like 'bsd,df->bsf' contracts two token
    dims, and XLA:CPU lowers it with the cotangent transposed inside the elementwise fusion
    that produces it, a strided loop that cost as much as the matmuls of the backward on
    SmolLM2's shapes (issue #44); the 2-D form's gradient is a plain transposed-operand gemm.
    The math is the same contraction in the same dtype.

    A `LoraWeight` (an adapted weight, `models.lora`) gives x W + s (x A) B, unmerged."""
    if isinstance(w, LoraWeight):
        y = project(x, w.base, n_in, preferred_element_type)
        delta = low_rank_delta(x, w, lambda v, m, k: project(v, m, k, preferred_element_type))
        return y + delta.astype(y.dtype)
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    if tuple(x.shape[x.ndim - n_in:]) != tuple(in_shape):
        raise ValueError(f"project: x's trailing dims {tuple(x.shape[x.ndim - n_in:])} do not match "
                         f"the weight's input dims {tuple(in_shape)}")
    lead = x.shape[:x.ndim - n_in]
    k = math.prod(in_shape)
    y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=preferred_element_type)
    return y.reshape(tuple(lead) + tuple(out_shape))


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale (fp32 statistics, HF-compatible rounding) over the last dim, of size
    `dim` (logical axis `logical_axis`), or, with `dim` a shape, over its trailing dims at once
    (`logical_axis` one name per dim; OLMo's q/k norms over [heads, head_dim]).

    With cfg.norm_offset (Gemma: 1.0) the factor is (offset + scale), the weights are stored as
    offsets (initialised to 0). The product is taken in fp32 before the cast with an offset or
    cfg.norm_scale_fp32, as HF's Gemma3RMSNorm and Olmo2RMSNorm do; otherwise the normalised x is
    cast first, as Llama's. `eps` overrides cfg.rms_eps (latent attention's norms)."""

    def __init__(self, dim, cfg: ModelConfig, logical_axis="embed", rngs=None, eps: float | None = None):
        shape = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        axes = tuple(logical_axis) if isinstance(logical_axis, (tuple, list)) else (logical_axis,)
        self.eps = cfg.rms_eps if eps is None else eps
        self.offset = float(cfg.norm_offset)
        self.fp32_product = bool(cfg.norm_offset or cfg.norm_scale_fp32)
        self.axes = tuple(range(-len(shape), 0))
        self.scale = param(None, "zeros" if self.offset else "ones", shape, axes, cfg)

    def __call__(self, x: jax.Array) -> jax.Array:
        in_dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=self.axes, keepdims=True) + self.eps)
        if self.fp32_product:
            return (x32 * (self.offset + self.scale[...].astype(jnp.float32))).astype(in_dtype)
        return self.scale[...].astype(in_dtype) * x32.astype(in_dtype)


class Embed(nnx.Module):
    """Token embedding table [vocab, embed]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embedding = param(rngs, "normal", (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg)
        self.cfg = cfg

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, seq] int -> [batch, seq, embed] in compute dtype."""
        table = self.embedding[...].astype(cdtype(self.cfg))
        x = jnp.take(table, tokens, axis=0)
        if self.cfg.embed_scale != 1.0:   # rounded to the param dtype first, as HF's Gemma does
            scale = jnp.asarray(self.cfg.embed_scale, jnp.float32).astype(self.cfg.param_dtype)
            x = x * scale.astype(x.dtype)
        return x


# -- rotary embeddings --------------------------------------------------------------------------

def rope_inv_freq(cfg: ModelConfig, local: bool = False, long: bool = False) -> tuple[jax.Array, float]:
    """Inverse frequencies [cfg.rotary_dim // 2] and the attention (cos/sin) scale for `cfg`'s RoPE;
    `local`: the sliding layers' own (cfg.rope_local_theta, unscaled), where the config has one;
    `long`: longrope's long factors."""
    dim, base = cfg.rotary_dim, cfg.rope_theta
    if local and cfg.rope_local_theta is not None:
        base = cfg.rope_local_theta
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    inv_freq = 1.0 / (base ** exponents)
    if cfg.rope_type == "default" or (local and cfg.rope_local_theta is not None):
        return inv_freq, 1.0
    if cfg.rope_type == "longrope":
        factors = jnp.asarray(cfg.rope_long_factor if long else cfg.rope_short_factor, jnp.float32)
        scale = 1.0 if cfg.rope_attention_factor is None else cfg.rope_attention_factor
        return 1.0 / (factors * base ** exponents), scale
    if cfg.rope_type == "linear":   # positions divided by the factor (Gemma 3's global layers)
        return inv_freq / cfg.rope_factor, 1.0
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, cfg), 1.0
    # YaRN: interpolate low frequencies by `factor`, keep high ones, blend on a linear ramp
    # between the dims that rotate beta_fast and beta_slow times over the original context.
    factor = cfg.rope_factor
    attention_scale = cfg.rope_attention_factor
    if attention_scale is None:
        attention_scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq, attention_scale


def _llama3_inv_freq(inv_freq: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Llama 3.1's scaling: frequencies whose wavelength exceeds the original context divided by
    `low_freq_factor` are slowed by `factor`; those shorter than it over `high_freq_factor` are
    kept; in between, a blend linear in (original context / wavelength)."""
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = float(cfg.rope_original_max_len)
    wavelength = 2 * math.pi / inv_freq
    slowed = jnp.where(wavelength > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelength - low) / (high - low)           # 0 at the long end, 1 at the short
    blended = (1 - blend) * slowed / factor + blend * slowed
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return jnp.where(medium, blended, slowed)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig, window=None) -> jax.Array:
    """Rotates halves of the head dim's first cfg.rotary_dim dims. x [batch, seq, heads, head_dim];
    positions [batch, seq].
    window (int scalar, may be traced; a sliding layer's > 0): picks the sliding layers' RoPE
    where cfg.rope_local_theta gives them their own."""
    inv_freq, scale = rope_inv_freq(cfg)
    if cfg.rope_type == "longrope":   # HF's rule: the long factors once any position reaches the original length
        long_freq, _ = rope_inv_freq(cfg, long=True)
        inv_freq = jnp.where(jnp.max(positions) + 1 > cfg.rope_original_max_len, long_freq, inv_freq)
    if cfg.rope_local_theta is not None and window is not None:
        local_freq, local_scale = rope_inv_freq(cfg, local=True)
        sliding = jnp.asarray(window) > 0
        inv_freq = jnp.where(sliding, local_freq, inv_freq)
        scale = jnp.where(sliding, local_scale, scale)
    phase = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, s, hd/2]
    cos = (jnp.cos(phase) * scale)[:, :, None, :]
    sin = (jnp.sin(phase) * scale)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    rotated = 2 * inv_freq.shape[-1]
    first, second = jnp.split(x32[..., :rotated], 2, axis=-1)
    parts = [first * cos - second * sin, second * cos + first * sin]
    if rotated < x.shape[-1]:   # partial rotary: the trailing dims pass as they are
        parts.append(x32[..., rotated:])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)


def rope_unless_nope(x, positions, cfg: ModelConfig, window, rope) -> jax.Array:
    """apply_rope, or x as it is where `rope` is False (Python: no rotation computed; traced: the
    scan's per-layer flag, both computed and one kept)."""
    if rope is True:
        return apply_rope(x, positions, cfg, window)
    if rope is False:
        return x
    return jnp.where(rope, apply_rope(x, positions, cfg, window), x)


# -- attention ----------------------------------------------------------------------------------

def attention_mask(q_pos, k_pos, q_seg, k_seg, window, k_valid=None) -> jax.Array:
    """Boolean [batch, q_len, k_len]: causal by position, same segment, within `window`.

    window: int scalar (may be traced); 0 means unlimited. k_valid [batch, k_len] marks filled
    cache entries when attending to a KV cache.
    """
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = (kp <= qp) & (q_seg[:, :, None] == k_seg[:, None, :])
    mask &= (window <= 0) | (qp - kp < window)
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    return mask


def attend(q, k, v, mask, sinks=None) -> jax.Array:
    """Grouped-query attention core, naive: builds the full [batch, kv_heads, group, q_len, k_len]
    fp32 scores (kept for the backward). The reference for `models.attention.blockwise_attention`,
    which the training forward uses unless cfg.attention_impl == 'naive'; the engine's KV-cache
    steps call this one.

    q [batch, q_len, heads, head_dim]; k, v [batch, k_len, kv_heads, head_dim];
    mask [batch, q_len, k_len] bool; sinks [heads] learned logits that join the softmax
    denominator only (GPT-OSS). Returns [batch, q_len, heads, head_dim].
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(d))
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    if sinks is not None:
        sink = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, kvh, h // kvh, 1, 1), logits.shape[:-1] + (1,)
        )
        probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, d)


def decode_attend(q, k, v, mask, sinks=None) -> jax.Array:
    """`attend` for one query per row (a decode step), as broadcast products and sums: the same
    function, summed in another order (equal within float rounding).

    Why not `attend`'s einsums: with one query token, each (row, kv head) is a [group, head_dim] x
    [head_dim, k_len] product, far too small for a matmul kernel; XLA:CPU ran them as a batched
    dot at a quarter of this fusion's speed (SmolLM2's shapes, 64 rows x 512 keys: 26.6 ms a layer
    against 6.6 ms, issue #44), and the fusion reads each cached key and value once, which is the
    bound of a decode step's attention on any backend.

    q [batch, 1, heads, head_dim]; k [batch, k_len, kv_heads, head_dim]; v [batch, k_len,
    kv_heads, v_dim]; mask [batch, 1, k_len] bool; sinks [heads] (optional, as `attend`).
    Returns [batch, 1, heads, v_dim].
    """
    b, t, h, d = q.shape
    if t != 1:
        raise ValueError(f"decode_attend: q has {t} query tokens per row; it serves one ([batch, 1, heads, head_dim])")
    kvh = k.shape[2]
    qg = q.reshape(b, 1, kvh, h // kvh, d).astype(jnp.float32)               # [b, 1, kvh, g, d]
    logits = jnp.sum(qg * k[:, :, :, None, :].astype(jnp.float32), axis=-1)  # [b, k_len, kvh, g]
    logits = logits * (1.0 / math.sqrt(d))
    logits = jnp.where(mask[:, 0, :, None, None], logits, jnp.finfo(jnp.float32).min)
    top = jnp.max(logits, axis=1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, 1, kvh, h // kvh)
        top = jnp.maximum(top, sink)
    weights = jnp.exp(logits - top)
    total = jnp.sum(weights, axis=1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    probs = (weights / total).astype(v.dtype)
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1, dtype=jnp.float32)  # [b, kvh, g, v_dim]
    return out.astype(v.dtype).reshape(b, 1, h, v.shape[-1])


class Attention(nnx.Module):
    """GQA with RoPE; optional q/k RMSNorm (per head: Qwen3; over all heads: OLMo 2/3), biases
    and sinks (GPT-OSS)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, kvh, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = param(rngs, "normal", (d, h, hd), ("embed", "heads", "head_dim"), cfg)
        self.k_proj = param(rngs, "normal", (d, kvh, hd), ("embed", "kv_heads", "head_dim"), cfg)
        self.v_proj = param(rngs, "normal", (d, kvh, hd), ("embed", "kv_heads", "head_dim"), cfg)
        self.o_proj = param(rngs, "normal", (h, hd, d), ("heads", "head_dim", "embed"), cfg)
        if cfg.attention_bias:
            self.q_bias = param(rngs, "zeros", (h, hd), ("heads", "head_dim"), cfg)
            self.k_bias = param(rngs, "zeros", (kvh, hd), ("kv_heads", "head_dim"), cfg)
            self.v_bias = param(rngs, "zeros", (kvh, hd), ("kv_heads", "head_dim"), cfg)
        if cfg.out_bias:
            self.o_bias = param(rngs, "zeros", (d,), ("embed",), cfg)
        if cfg.qk_norm and cfg.qk_norm_over_heads:   # OLMo: one norm over the whole projection
            self.q_norm = RMSNorm((h, hd), cfg, logical_axis=("heads", "head_dim"))
            self.k_norm = RMSNorm((kvh, hd), cfg, logical_axis=("kv_heads", "head_dim"))
        elif cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg, logical_axis="head_dim")
            self.k_norm = RMSNorm(hd, cfg, logical_axis="head_dim")
        if cfg.attn_sinks:
            self.sinks = param(rngs, "zeros", (h,), ("heads",), cfg)

    def project_qkv(self, x, positions, window=None, rope=True):
        """x [b, s, embed] -> q [b, s, heads, hd], k, v [b, s, kv_heads, hd], RoPE applied (the
        sliding layers' own where cfg.rope_local_theta is set: `window` > 0) unless `rope` is
        False (Python or traced: a NoPE layer of cfg.nope_layers, SmolLM3's every fourth). With
        cfg.query_scale, q carries query_scale * sqrt(hd), so that the cores' 1/sqrt(hd) makes
        the scores' scale query_scale."""
        cfg, dt = self.cfg, cdtype(self.cfg)
        q = project(x, self.q_proj[...].astype(dt))
        k = project(x, self.k_proj[...].astype(dt))
        v = project(x, self.v_proj[...].astype(dt))
        if cfg.attention_bias:
            q, k, v = (q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt),
                       v + self.v_bias[...].astype(dt))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope_unless_nope(q, positions, cfg, window, rope)
        if cfg.query_scale is not None and cfg.query_scale * math.sqrt(cfg.head_dim) != 1.0:
            q = q * jnp.asarray(cfg.query_scale * math.sqrt(cfg.head_dim), q.dtype)
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        k = rope_unless_nope(k, positions, cfg, window, rope)
        k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        return q, k, v

    def output(self, attn_out):
        """[b, s, heads, hd] -> [b, s, embed]."""
        dt = cdtype(self.cfg)
        y = project(attn_out, self.o_proj[...].astype(dt), n_in=2)
        if self.cfg.out_bias:
            y = y + self.o_bias[...].astype(dt)
        return y

    def sink_logits(self):
        return self.sinks[...] if self.cfg.attn_sinks else None

    def __call__(self, x, positions, segment_ids, window, rope=True):
        """Self-attention over a packed batch: x [b, s, embed]; positions, segment_ids [b, s].

        window: int scalar, may be traced (0 = unlimited); rope: bool, may be traced (False: a
        NoPE layer, `project_qkv`). cfg.attention_impl picks the core:
        'blockwise' never builds a [s, s] array (forward or backward); 'naive' is the reference
        (`self_attention`).
        """
        q, k, v = self.project_qkv(x, positions, window, rope)
        return self.output(self_attention(self.cfg, q, k, v, positions, segment_ids, window, self.sink_logits()))


def self_attention(cfg: ModelConfig, q, k, v, positions, segment_ids, window, sinks=None) -> jax.Array:
    """The training forward's attention over a packed batch: q [b, s, heads, d]; k, v [b, s,
    kv_heads, d]; positions, segment_ids [b, s] -> [b, s, heads, d], by the core
    cfg.attention_impl names (`attention_core`). Where the sequence is split (a `context` axis
    > 1, or `expert` when the rows do not split over it) the core runs on each shard's queries
    against all-gathered keys (`models.context_parallel`)."""
    core = attention_core(cfg)
    if context_size(q.shape[0]) > 1:
        out = context_parallel_attention(core, q, k, v, positions, segment_ids, window, sinks)
    else:
        out = core(q, k, v, positions, positions, segment_ids, segment_ids, window, sinks)
    # The cores' internal layouts (blocks, gathers) are their own; pin the result's. The name
    # lets the 'attention_out' remat policies keep it (the blockwise core names its own too).
    return checkpoint_name(constrain(out, ("batch", "seq", "heads", "head_dim")), "attention_out")


def attention_core(cfg: ModelConfig):
    """The attention core cfg.attention_impl names, as
    core(q, k, v, q_pos, k_pos, q_seg, k_seg, window, sinks) -> [b, q_len, heads, head_dim]."""
    if cfg.attention_impl == "blockwise":
        return functools.partial(blockwise_attention, block_q=cfg.attention_block_q,
                                 block_k=cfg.attention_block_k)
    if cfg.attention_impl == "pallas":
        return per_device(functools.partial(pallas_attention, block_q=_pallas_block(cfg.attention_block_q),
                                            block_k=_pallas_block(cfg.attention_block_k)))

    def naive(q, k, v, q_pos, k_pos, q_seg, k_seg, window, sinks):
        return attend(q, k, v, attention_mask(q_pos, k_pos, q_seg, k_seg, window), sinks)
    return naive


def _pallas_block(block: int) -> int:
    """The Triton tile for a configured block: a power of two in [16, 128] (larger tiles overflow
    shared memory at head_dim 128; 128 measured fastest on an H200)."""
    return max(16, min(128, 1 << (block.bit_length() - 1)))


def kernel_split(n_rows: int, heads: int, kv_heads: int, row_axes=BATCH_AXES):
    """How a one-device kernel (a Pallas call, which XLA's automatic partitioner cannot split) is
    split over the current mesh in `shard_map`: (mesh, free axes, rows' axes or None, heads' axis
    or None), or None when there is nothing to split (no mesh, one device, every axis manual).
    Rows go over `row_axes` in order while their product divides n_rows; heads over `tensor`
    where it divides both head counts; mesh axes already manual (the context axis inside context
    parallelism) stay as they are; any other axis sees the whole input."""
    mesh = concrete_mesh_in_trace() or jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    free = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual and mesh.shape[a] > 1)
    if not free:
        return None
    kept, n = [], 1
    for a in row_axes:
        if a in free and n_rows % (n * mesh.shape[a]) == 0:
            kept.append(a)
            n *= mesh.shape[a]
    t = mesh.shape[TENSOR_AXIS] if TENSOR_AXIS in free else 1
    h_ax = TENSOR_AXIS if t > 1 and heads % t == 0 and kv_heads % t == 0 else None
    return mesh, free, tuple(kept) or None, h_ax


def per_device(core):
    """`core` run on each device's own rows and heads inside `shard_map` (`kernel_split`: rows
    over the batch axes, heads over `tensor`)."""
    def run(q, k, v, q_pos, k_pos, q_seg, k_seg, window, sinks):
        split = kernel_split(q.shape[0], q.shape[2], k.shape[2])
        if split is None:
            return core(q, k, v, q_pos, k_pos, q_seg, k_seg, window, sinks)
        mesh, free, b_ax, h_ax = split
        qkv, ids = P(b_ax, None, h_ax, None), P(b_ax, None)
        args = (q, k, v, q_pos, k_pos, q_seg, k_seg, jnp.asarray(window, jnp.int32))
        specs = (qkv, qkv, qkv, ids, ids, ids, ids, P())
        if sinks is not None:
            args, specs = args + (sinks,), specs + (P(h_ax),)
        return jax.shard_map(lambda *a: core(*a[:8], a[8] if len(a) > 8 else None), mesh=mesh,
                             in_specs=specs, out_specs=qkv, axis_names=frozenset(free),
                             check_vma=False)(*args)
    return run


class DenseMLP(nnx.Module):
    """GLU MLP of the dense families: down(act(x @ gate) * (x @ up)), act cfg.mlp_act (SiLU:
    SwiGLU; Gemma's tanh-approximated GELU: GeGLU). gate/up [embed, mlp], down [mlp, embed];
    `mlp` is split over the `tensor` axis (the rules table)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None):
        d, f = cfg.d_model, cfg.d_ff if width is None else width   # width: a shared expert's
        self.cfg = cfg
        self.w_gate = param(rngs, "normal", (d, f), ("embed", "mlp"), cfg)
        self.w_up = param(rngs, "normal", (d, f), ("embed", "mlp"), cfg)
        self.w_down = param(rngs, "normal", (f, d), ("mlp", "embed"), cfg)

    def __call__(self, x, token_mask=None):
        """x [batch, seq, embed] -> (y [batch, seq, embed], {}): no router, so no router metrics."""
        dt = cdtype(self.cfg)
        gate = project(x, self.w_gate[...].astype(dt))
        up = project(x, self.w_up[...].astype(dt))
        act = jax.nn.silu(gate) if self.cfg.mlp_act == "silu" else jax.nn.gelu(gate, approximate=True)
        hidden = constrain(act * up, ("batch", "seq", "mlp"))
        return project(hidden, self.w_down[...].astype(dt)), {}
