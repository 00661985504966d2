"""Blockwise (flash-style) attention == the naive reference, values and gradients, for every mask
kind the model uses; the model forward with either impl agrees; train-step memory is not quadratic."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.models.attention import _live_blocks, _block_bounds, blockwise_attention
from sfrrl_jax.models.layers import attend, attention_mask

from model_fixtures import TINY, TINY_GPT_OSS, host, randomize, single_device_mesh

TOL = 1e-5


def _packed(lengths_per_row, t):
    """segment_ids, positions [rows, t]: consecutive segments 1, 2, ... then padding (segment 0);
    positions restart at each segment (padding too, as `default_positions_and_segments` does)."""
    segs = np.zeros((len(lengths_per_row), t), np.int32)
    for r, lengths in enumerate(lengths_per_row):
        start = 0
        for i, n in enumerate(lengths):
            segs[r, start:start + n] = i + 1
            start += n
    tokens = np.zeros_like(segs)
    seg, pos = tfm.default_positions_and_segments(tokens, jnp.asarray(segs))
    return seg, pos


# name, (batch, t, heads, kv_heads, head_dim), segments per row (None: one causal sequence),
# window, sinks, (block_q, block_k)
CASES = [
    ("causal_gqa2_odd_len", (2, 37, 4, 2, 8), None, 0, False, (8, 16)),
    ("packed_cross_edges_padding_mha", (2, 40, 2, 2, 8), [[5, 13, 9], [17, 11]], 0, False, (8, 8)),
    ("window_lt_block_sinks_gqa4", (1, 45, 4, 1, 8), [[20, 25]], 3, True, (16, 16)),
    ("window_gt_block_packed_gqa2", (2, 50, 4, 2, 8), [[30, 12], [7, 33]], 11, True, (8, 8)),
    ("single_block_causal_sinks", (2, 13, 4, 2, 8), None, 0, True, (512, 512)),
]


def _inputs(shape, seed=0):
    b, t, h, kvh, d = shape
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, t, h, d))
    k = jax.random.normal(ks[1], (b, t, kvh, d))
    v = jax.random.normal(ks[2], (b, t, kvh, d))
    sinks = jax.random.normal(ks[3], (h,))
    w = jax.random.normal(ks[4], (b, t, h, d))  # a random cotangent
    return q, k, v, sinks, w


@pytest.mark.parametrize("name,shape,segments,window,use_sinks,blocks", CASES, ids=[c[0] for c in CASES])
def test_blockwise_equals_naive_values_and_grads(name, shape, segments, window, use_sinks, blocks):
    b, t = shape[:2]
    q, k, v, sinks, w = _inputs(shape)
    if segments is None:
        seg, pos = tfm.default_positions_and_segments(jnp.zeros((b, t), jnp.int32))
    else:
        seg, pos = _packed(segments, t)
    sinks = sinks if use_sinks else None

    def naive(q, k, v, sinks, window):
        return attend(q, k, v, attention_mask(pos, pos, seg, seg, window), sinks)

    def blockwise(q, k, v, sinks, window):
        return blockwise_attention(q, k, v, pos, pos, seg, seg, window, sinks,
                                   block_q=blocks[0], block_k=blocks[1])

    def value_and_grads(fn):
        """One jitted call: the output and the grads of sum(out * w) (the VJP of cotangent w)."""
        def run(q, k, v, sinks, window):
            if use_sinks:
                out, vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, s, window), q, k, v, sinks)
            else:
                out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None, window), q, k, v)
            return out, vjp(w)
        return jax.jit(run)

    win = jnp.int32(window)  # traced, as the layer scan passes it
    want, g_want = value_and_grads(naive)(q, k, v, sinks, win)
    got, g_got = value_and_grads(blockwise)(q, k, v, sinks, win)
    np.testing.assert_allclose(host(got), host(want), atol=TOL, rtol=0)
    for wname, a, e in zip("q k v sinks".split(), g_got, g_want):
        assert a.shape == e.shape and a.dtype == e.dtype, wname
        np.testing.assert_allclose(host(a), host(e), atol=TOL, rtol=0, err_msg=wname)


def test_dead_blocks_are_found_exactly_for_causal_and_window():
    """The skip test marks the causal upper triangle (and blocks beyond a window) dead, and keeps
    every block that holds a visible pair."""
    t, blk = 32, 8
    seg, pos = tfm.default_positions_and_segments(jnp.zeros((1, t), jnp.int32))
    bounds = _block_bounds(pos, seg, t, t // blk, blk)
    for window in (0, 5, 9):
        live = np.asarray(_live_blocks(bounds, bounds, jnp.int32(window)))
        mask = np.asarray(attention_mask(pos, pos, seg, seg, window))[0]
        truth = mask.reshape(t // blk, blk, t // blk, blk).any(axis=(1, 3))
        np.testing.assert_array_equal(live, truth, err_msg=f"window={window}")


def test_bf16_inputs_stay_close_and_keep_dtypes():
    q, k, v, sinks, _ = _inputs((1, 24, 4, 2, 16), seed=3)
    seg, pos = tfm.default_positions_and_segments(jnp.zeros((1, 24), jnp.int32))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, pos, pos, seg, seg, 0, sinks, block_q=8,
                                                      block_k=8))(q, k, v)
    want = attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                  attention_mask(pos, pos, seg, seg, 0), sinks)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(host(got.astype(jnp.float32)), host(want), atol=3e-2)


# gpt_oss has every attention feature (sinks, windows, biases); qwen3's qk-norm sits before the
# core, and the core's own cases are above (one model keeps the suite in its time budget).
@pytest.mark.parametrize("name", ["gpt_oss"])
def test_model_forward_blockwise_equals_naive(name):
    """Through the whole model (scanned layers, per-layer traced windows, sinks on gpt_oss),
    packed rows with padding: logits and param grads agree. Param grads of sum(logits * w) reach
    ~5, so their tolerance is TOL relative to each grad's largest entry (fp32 summation order
    differs between the two paths)."""
    base = {"qwen3": TINY, "gpt_oss": TINY_GPT_OSS}[name]
    mesh = single_device_mesh()
    params = randomize(S.init_params(base, mesh, seed=0), seed=5, scale=0.3)
    t = 29
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, base.vocab_size, (2, t)), jnp.int32)
    seg, pos = _packed([[9, 14], [20]], t)
    w = jax.random.normal(jax.random.key(1), (2, t, base.vocab_size))
    results = {}
    for impl in ("naive", "blockwise"):
        cfg = base.replace(attention_impl=impl, attention_block_q=8, attention_block_k=8)

        def loss(p, cfg=cfg):
            logits, _ = tfm.forward_with_aux(cfg, p, tokens, seg, pos)
            return jnp.sum(logits * w), logits

        with jax.set_mesh(mesh):
            results[impl] = jax.jit(jax.grad(loss, has_aux=True))(params)
    (g_naive, l_naive), (g_block, l_block) = results["naive"], results["blockwise"]
    np.testing.assert_allclose(host(l_block), host(l_naive), atol=TOL, rtol=0)
    flat_n = dict(jax.tree_util.tree_leaves_with_path(g_naive))
    for path, g in jax.tree_util.tree_leaves_with_path(g_block):
        want = host(flat_n[path])
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(host(g), want, atol=TOL * scale, rtol=0, err_msg=str(path))
    if base.attn_sinks:
        assert np.any(host(g_block["layers"]["attn"]["sinks"]) != 0)


def _train_step_temp_bytes(cfg, t):
    mesh = single_device_mesh()
    params = tfm.param_shapes(cfg)
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(p, tokens):
        logits, _ = tfm.forward_with_aux(cfg, p, tokens)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_train_step_memory_is_not_quadratic():
    """Gradient of a model loss at T and 4T: blockwise temp memory grows ~4x (linear; quadratic
    would be 16x), and at 4T it is a fraction of the naive step's."""
    small = TINY.replace(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff_expert=16, vocab_size=64,
                         attention_block_q=64, attention_block_k=64)
    t = 512
    blockwise = [_train_step_temp_bytes(small, n) for n in (t, 4 * t)]
    naive = _train_step_temp_bytes(small.replace(attention_impl="naive"), 4 * t)
    assert blockwise[1] / blockwise[0] < 6, blockwise
    # the [T, T] scores dominate the naive step at 4T, so the measure does see attention memory
    assert blockwise[1] < naive / 4, (blockwise, naive)


def test_config_rejects_unknown_impl_and_bad_blocks():
    with pytest.raises(ValueError, match="attention_impl"):
        TINY.replace(attention_impl="flash")
    with pytest.raises(ValueError, match="attention_block_k"):
        TINY.replace(attention_block_k=0)
    with pytest.raises(ValueError, match="attention_block_q"):
        TINY.replace(attention_block_q=True)
    assert TINY.attention_impl == "blockwise"
