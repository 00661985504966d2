"""Pallas flash attention (interpret mode on CPU) == the naive reference, values and gradients
(q, k, v, sinks), for every mask kind the model uses; rows that see nothing match
blockwise_attention (which equals the naive reference elsewhere: test_attention_blockwise.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import host

from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.models.attention import blockwise_attention
from sfrrl_jax.models.attention_pallas import _loop_bounds, pallas_attention
from sfrrl_jax.models.layers import attend, attention_mask

TOL = 1e-5


def _packed(lengths_per_row, t):
    """segment_ids, positions [rows, t]: consecutive segments 1, 2, ... then padding (segment 0);
    positions restart at each segment (padding too)."""
    segs = np.zeros((len(lengths_per_row), t), np.int32)
    for r, lengths in enumerate(lengths_per_row):
        start = 0
        for i, n in enumerate(lengths):
            segs[r, start:start + n] = i + 1
            start += n
    return tfm.default_positions_and_segments(np.zeros_like(segs), jnp.asarray(segs))


# name, (batch, q_len, k_len, heads, kv_heads, head_dim), segments per row (None: one causal
# sequence), window, sinks, (block_q, block_k). Lengths are odd or cross block edges on purpose.
CASES = [
    ("causal_gqa2_odd_len", (2, 37, 37, 4, 2, 16), None, 0, False, (16, 32)),
    ("packed_cross_edges_padding0", (2, 50, 50, 2, 2, 16), [[5, 13, 9], [17, 11]], 0, False,
     (16, 16)),
    ("window_lt_block_sinks_gqa4", (1, 45, 45, 4, 1, 16), [[20, 25]], 3, True, (16, 16)),
    ("window_gt_block_packed_sinks", (2, 50, 50, 4, 2, 16), [[30, 12], [7, 33]], 19, True,
     (32, 16)),
    # head_dim 8 is zero-padded to 16; one forward block of 128, backward blocks of 64
    ("head_dim8_fwd128_bwd64", (1, 100, 100, 4, 2, 8), [[45, 40]], 0, True, (128, 128)),
    # queries are the last 20 of 53 positions (a prefill chunk after a cache)
    ("q_shorter_than_k", (1, 20, 53, 4, 2, 16), None, 5, False, (16, 16)),
]


def _inputs(b, t, s, h, kvh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, t, h, d))
    k = jax.random.normal(ks[1], (b, s, kvh, d))
    v = jax.random.normal(ks[2], (b, s, kvh, d))
    sinks = jax.random.normal(ks[3], (h,))
    w = jax.random.normal(ks[4], (b, t, h, d))  # a random cotangent
    return q, k, v, sinks, w


def _value_and_grads(fn, w, use_sinks):
    """One jitted call: the output and the grads of sum(out * w) (the VJP of cotangent w)."""
    def run(q, k, v, sinks, window):
        if use_sinks:
            out, vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, s, window), q, k, v, sinks)
        else:
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None, window), q, k, v)
        return out, vjp(w)
    return jax.jit(run)


def _assert_same(got, want, g_got, g_want):
    np.testing.assert_allclose(host(got), host(want), atol=TOL, rtol=0)
    for name, a, e in zip(["q", "k", "v", "sinks"], g_got, g_want):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        np.testing.assert_allclose(host(a), host(e), atol=TOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("name,shape,segments,window,use_sinks,blocks", CASES,
                         ids=[c[0] for c in CASES])
def test_pallas_equals_naive_values_and_grads(name, shape, segments, window, use_sinks, blocks):
    b, t, s, h, kvh, d = shape
    q, k, v, sinks, w = _inputs(b, t, s, h, kvh, d)
    if segments is None:
        k_seg, k_pos = tfm.default_positions_and_segments(jnp.zeros((b, s), jnp.int32))
    else:
        k_seg, k_pos = _packed(segments, s)
    q_seg, q_pos = k_seg[:, s - t:], k_pos[:, s - t:]
    sinks = sinks if use_sinks else None
    args = (q_pos, k_pos, q_seg, k_seg)

    def naive(q, k, v, sinks, window):
        return attend(q, k, v, attention_mask(*args, window), sinks)

    def pallas(q, k, v, sinks, window):
        return pallas_attention(q, k, v, *args, window, sinks, block_q=blocks[0], block_k=blocks[1],
                                interpret=True)

    win = jnp.int32(window)  # traced, as the layer scan passes it
    got, g_got = _value_and_grads(pallas, w, use_sinks)(q, k, v, sinks, win)
    want, g_want = _value_and_grads(naive, w, use_sinks)(q, k, v, sinks, win)
    _assert_same(got, want, g_got, g_want)


def test_rows_that_see_nothing_output_zero_like_blockwise():
    """A query segment no key has (here: the keys are all segment 1, the last queries segment 2)
    outputs 0 with no NaN in any gradient, as blockwise_attention does (the naive softmax would
    average v over an all-masked row instead)."""
    b, t, h, kvh, d = 1, 24, 2, 1, 16
    q, k, v, _, w = _inputs(b, t, t, h, kvh, d, seed=1)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    k_seg = jnp.ones((b, t), jnp.int32)
    q_seg = k_seg.at[:, 18:].set(2)

    def run(fn):
        return _value_and_grads(lambda q, k, v, s, win: fn(q, k, v, pos, pos, q_seg, k_seg, win, s),
                                w, False)(q, k, v, None, jnp.int32(0))

    got, g_got = run(lambda *a: pallas_attention(*a, block_q=16, block_k=16, interpret=True))
    want, g_want = run(lambda *a: blockwise_attention(*a, block_q=8, block_k=8))
    assert not np.any(host(got)[:, 18:])
    _assert_same(got, want, g_got, g_want)


def test_loop_bounds_skip_dead_blocks_per_row():
    """Causal one sequence: query block i visits key blocks [0, i + 1); key block j visits query
    blocks [j, n). A window of 5 with blocks of 8 leaves only the diagonal and the one before it."""
    t, blk = 32, 8
    seg, pos = tfm.default_positions_and_segments(jnp.zeros((1, t), jnp.int32))
    seg, pos = seg.astype(jnp.int32), pos.astype(jnp.int32)
    fwd, bwd = _loop_bounds(pos, seg, pos, seg, t, t, blk, blk, jnp.int32(0))
    np.testing.assert_array_equal(host(fwd)[0], [[0, 1], [0, 2], [0, 3], [0, 4]])
    np.testing.assert_array_equal(host(bwd)[0], [[0, 4], [1, 4], [2, 4], [3, 4]])
    fwd, _ = _loop_bounds(pos, seg, pos, seg, t, t, blk, blk, jnp.int32(5))
    np.testing.assert_array_equal(host(fwd)[0], [[0, 1], [0, 2], [1, 3], [2, 4]])


def test_rejects_blocks_triton_cannot_tile():
    q = jnp.zeros((1, 8, 2, 16))
    kv = jnp.zeros((1, 8, 1, 16))
    pos = jnp.zeros((1, 8), jnp.int32)
    for bad in (24, 8, True):
        with pytest.raises(ValueError, match="block_q"):
            pallas_attention(q, kv, kv, pos, pos, pos, pos, block_q=bad)
    with pytest.raises(ValueError, match="kv_heads"):
        pallas_attention(q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16)), pos, pos, pos, pos)


def test_model_with_attention_impl_pallas_runs_it_per_device_on_a_mesh():
    """The `attention_impl='pallas'` switch through the whole model on a data x expert mesh: the
    kernel runs inside shard_map on each device's rows (XLA cannot partition a pallas_call) and
    the hidden states equal the blockwise core's (interpret mode on CPU; forward only, the
    kernel's grads are checked above)."""
    import sfrrl_jax as S
    from model_fixtures import TINY_GPT_OSS, randomize

    mesh = S.make_mesh(data=2, expert=4)
    base = TINY_GPT_OSS.replace(attention_block_q=16, attention_block_k=16)
    params = randomize(S.init_params(base, mesh, seed=0), seed=3)
    tokens = np.random.RandomState(0).randint(0, base.vocab_size, (4, 24)).astype(np.int32)
    hidden = {}
    with jax.set_mesh(mesh):
        for impl in ("blockwise", "pallas"):
            cfg = base.replace(attention_impl=impl)
            traced = jax.jit(lambda p, cfg=cfg: tfm.forward_hidden(cfg, p, tokens)[0]).trace(params)
            assert ("pallas_call" in str(traced.jaxpr)) == (impl == "pallas")
            hidden[impl] = np.asarray(traced.lower().compile()(params))
    np.testing.assert_allclose(hidden["pallas"], hidden["blockwise"], atol=1e-5, rtol=0)
