"""Chunked log-probs/entropy == naive ones (values and gradients) at a fraction of the memory."""
import chex
import jax
import jax.numpy as jnp
import pytest

from sfrrl_jax.rl import naive_token_logprobs_and_entropy, token_logprobs_and_entropy


def _inputs(b, t, d, v, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (b, t, d)).astype(dtype)
    w = (jax.random.normal(k[1], (d, v)) * 0.7).astype(dtype)
    y = jax.random.randint(k[2], (b, t), 0, v)
    c1 = jax.random.normal(k[3], (b, t))
    c2 = jax.random.normal(k[4], (b, t))
    return h, w, y, c1, c2


def _scalar(fn, y, c1, c2):
    def f(h, w):
        logp, ent = fn(h, w, y)
        return jnp.sum(logp * c1) + jnp.sum(ent * c2)
    return f


def _values_and_grads(fn, h, w, y, c1, c2):
    """((logp, entropy), (d/dh, d/dw)) of a random linear functional, in one jit."""
    def f(h, w):
        logp, ent = fn(h, w, y)
        return jnp.sum(logp * c1) + jnp.sum(ent * c2), (logp, ent)
    (_, values), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)
    return values, grads


# (vocab_chunk, seq_chunk): both dividing, neither dividing, one chunk each
@pytest.mark.parametrize("vc,tc", [(64, 4), (100, 5), (1000, 64)])
def test_chunked_matches_naive_values_and_gradients(vc, tc):
    h, w, y, c1, c2 = _inputs(2, 13, 16, 300)
    chunked = lambda h, w, y: token_logprobs_and_entropy(h, w, y, vocab_chunk=vc, seq_chunk=tc)
    got, g = _values_and_grads(chunked, h, w, y, c1, c2)
    want, g_ref = _values_and_grads(naive_token_logprobs_and_entropy, h, w, y, c1, c2)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-5


def test_bfloat16_inputs_give_float32_outputs_and_input_dtype_grads():
    h, w, y, c1, c2 = _inputs(1, 8, 16, 128, jnp.bfloat16)
    chunked = lambda h, w, y: token_logprobs_and_entropy(h, w, y, vocab_chunk=32, seq_chunk=4)
    (logp, ent), (gh, gw) = _values_and_grads(chunked, h, w, y, c1, c2)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    want = jax.jit(naive_token_logprobs_and_entropy)(h, w, y)
    chex.assert_trees_all_close((logp, ent), want, rtol=1e-4, atol=1e-4)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16


def test_entropy_of_uniform_is_log_vocab():
    h = jnp.zeros((1, 3, 4))
    w = jnp.ones((4, 50))
    logp, ent = token_logprobs_and_entropy(h, w, jnp.zeros((1, 3), jnp.int32), vocab_chunk=16, seq_chunk=2)
    chex.assert_trees_all_close(ent, jnp.full((1, 3), jnp.log(50.0)), rtol=1e-6)
    chex.assert_trees_all_close(logp, jnp.full((1, 3), -jnp.log(50.0)), rtol=1e-6)


def test_compiled_memory_is_below_naive_by_the_logits():
    b, t, d, v = 2, 128, 16, 4096
    h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    y = jnp.zeros((b, t), jnp.int32)
    logits_bytes = b * t * v * 4
    chunked = lambda h, w, y: token_logprobs_and_entropy(h, w, y, vocab_chunk=512, seq_chunk=32)
    for make in (lambda fn: (lambda h, w: fn(h, w, y)),                                # forward
                 lambda fn: jax.grad(_scalar(fn, y, 1.0, 1.0), argnums=(0, 1))):        # backward
        temp = {}
        for name, fn in (("chunked", chunked), ("naive", naive_token_logprobs_and_entropy)):
            temp[name] = jax.jit(make(fn)).lower(h, w).compile().memory_analysis().temp_size_in_bytes
        assert temp["chunked"] <= temp["naive"] - logits_bytes, temp


def test_shape_errors_name_the_inputs():
    with pytest.raises(ValueError, match="d_model"):
        token_logprobs_and_entropy(jnp.zeros((1, 2, 4)), jnp.zeros((5, 7)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_and_entropy(jnp.zeros((1, 2, 4)), jnp.zeros((4, 7)), jnp.zeros((2,), jnp.int32))
