"""`layers.decode_attend` (the engine's one-query-per-row attention core) == `layers.attend`,
values and gradients, for the mask kinds a decode step builds (cache validity, a window), GQA
groups, sinks, bf16, under vmap; one query only."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfrrl_jax.models.layers import attend, attention_mask, decode_attend

# name, (batch, k_len, heads, kv_heads, head_dim, v_dim), window, sinks
CASES = [
    ("gqa3_cache_valid", (4, 37, 9, 3, 16, 16), 0, False),
    ("mha_window", (3, 40, 2, 2, 8, 8), 5, False),
    ("gqa4_sinks_window", (2, 33, 4, 1, 8, 8), 7, True),
    ("one_kv_head_wide", (2, 29, 4, 1, 24, 24), 0, False),
]


def _inputs(shape, window, seed=0):
    b, k_len, h, kvh, d, dv = shape
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, 1, h, d))
    k = jax.random.normal(ks[1], (b, k_len, kvh, d))
    v = jax.random.normal(ks[2], (b, k_len, kvh, dv))
    sinks = jax.random.normal(ks[3], (h,))
    valid_len = jax.random.randint(ks[4], (b,), 1, k_len + 1)      # each row's filled cache prefix
    q_pos = valid_len[:, None] - 1                                   # the new token is the last valid one
    k_pos = jnp.broadcast_to(jnp.arange(k_len), (b, k_len))
    mask = attention_mask(q_pos, k_pos, jnp.ones((b, 1), jnp.int32), jnp.ones_like(k_pos), window,
                          k_pos < valid_len[:, None])
    w = jax.random.normal(ks[5], (b, 1, h, dv))                      # a random cotangent
    return q, k, v, mask, sinks, w


@pytest.mark.parametrize("name,shape,window,use_sinks", CASES, ids=[c[0] for c in CASES])
def test_decode_attend_equals_attend_values_and_grads(name, shape, window, use_sinks):
    q, k, v, mask, sinks, w = _inputs(shape, window)
    s = sinks if use_sinks else None

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, mask, s) * w)

    want = jax.jit(attend)(q, k, v, mask, s)
    got = jax.jit(decode_attend)(q, k, v, mask, s)
    assert got.shape == want.shape == (shape[0], 1, shape[2], shape[5])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    g_want = jax.grad(lambda *a: loss(attend, *a), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(lambda *a: loss(decode_attend, *a), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_decode_attend_vmaps_and_keeps_bf16():
    q, k, v, mask, _, _ = _inputs((4, 21, 4, 2, 8, 8), 0)
    stacked = [jnp.stack([a, a * 0.5]) for a in (q, k, v)]
    got = jax.vmap(decode_attend, in_axes=(0, 0, 0, None))(*stacked, mask)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(attend(q * 0.5, k * 0.5, v * 0.5, mask)),
                               rtol=1e-5, atol=1e-5)
    lo = decode_attend(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mask)
    assert lo.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(lo, np.float32), np.asarray(attend(q, k, v, mask)), atol=0.05)


def test_decode_attend_refuses_more_than_one_query():
    q, k, v, mask, _, _ = _inputs((2, 9, 4, 2, 8, 8), 0)
    with pytest.raises(ValueError, match="one query token per row|serves one"):
        decode_attend(jnp.concatenate([q, q], axis=1), k, v, mask)
