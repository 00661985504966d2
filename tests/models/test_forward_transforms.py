"""The public `forward` is a JAX function like any other: jax.grad, jax.jit and jax.vmap of it
work and agree with the library's own jitted path (issue: grad failed on a host-side sharding
check, jit with a ConcretizationTypeError, vmap inside ragged_dot's batching rule)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.models import transformer as tfm

from model_fixtures import TINY, TINY_GPT_OSS, randomize

CASES = {"qwen3": TINY, "gpt_oss": TINY_GPT_OSS}


@functools.lru_cache(maxsize=None)
def _case(family):
    cfg = CASES[family]
    params = randomize(S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=1), seed=2)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (4, 8)).astype(np.int32)
    probe = rng.randn(4, 8, cfg.vocab_size).astype(np.float32)
    return cfg, params, tokens, probe


def _reference_grad(cfg, params, tokens, probe):
    """The way the library's own train step differentiates: inside jit, under set_mesh."""
    loss = lambda p: jnp.sum(tfm.forward_with_aux(cfg, p, tokens)[0] * probe)
    with jax.set_mesh(S.models.mesh_of(params)):
        return jax.device_get(jax.jit(jax.grad(loss))(params))


@functools.partial(jax.jit, static_argnums=0)
def _reference_grad_jit(cfg, params, tokens, probe):
    return jax.grad(lambda p: jnp.sum(tfm.forward_with_aux(cfg, p, tokens)[0] * probe))(params)


def _reference_grads(cfg, params, tokens, probe):
    """`_reference_grad` of each example in turn, with one compile for all of them (the tokens
    and probe are arguments of the jit, not constants baked into a new one per example)."""
    with jax.set_mesh(S.models.mesh_of(params)):
        return [jax.device_get(_reference_grad_jit(cfg, params, tokens[i:i + 1], probe[i:i + 1]))
                for i in range(len(tokens))]


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _max_rel_diff(a, b):
    """Per leaf, the largest |a - b| over the leaf's largest |b|; the worst leaf. Two differently
    compiled programs (grad of a jitted forward, and a jitted grad) may sum in another order."""
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / max(np.max(np.abs(np.asarray(y))), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# One family keeps the suite in its time budget: the transformations are the same code path for
# both; gpt_oss (sinks, windows, biases: the superset but qk-norm) carries every test here, so the
# tests share its params and its forward's compile (qwen3's jit and grad run in every trainer test).
@pytest.mark.parametrize("family", ["gpt_oss"])
def test_grad_and_jit_of_forward(family):
    cfg, params, tokens, probe = _case(family)
    loss = lambda p: jnp.sum(S.forward(cfg, p, tokens) * probe)
    reference = _reference_grad(cfg, params, tokens, probe)
    assert _max_rel_diff(jax.grad(loss)(params), reference) < 1e-4
    assert _max_rel_diff(jax.jit(jax.grad(loss))(params), reference) < 1e-4
    logits = S.forward(cfg, params, tokens)
    jitted = jax.jit(lambda p, t: S.forward(cfg, p, t))(params, tokens)
    assert np.array_equal(np.asarray(jitted), np.asarray(logits))


@pytest.mark.parametrize("family", ["gpt_oss"])
def test_vmap_of_forward_and_per_example_grads(family):
    cfg, params, tokens, probe = _case(family)
    logits = np.asarray(S.forward(cfg, params, tokens))
    # vmap over rows (each a batch of one) and over a leading axis of two batches of two
    rows = jax.vmap(lambda t: S.forward(cfg, params, t[None])[0])(tokens)
    # jit of a closure over the params: the jit learns the devices from the MoE's shard_map
    pairs = jax.jit(jax.vmap(lambda t: S.forward(cfg, params, t)))(tokens.reshape(2, 2, 8))
    np.testing.assert_allclose(np.asarray(rows), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pairs).reshape(logits.shape), logits, rtol=1e-5, atol=1e-5)
    # per-example gradients: vmap of grad == one grad per example
    per_example = lambda t, q: jax.grad(lambda p: jnp.sum(S.forward(cfg, p, t[None]) * q[None]))(params)
    batched = jax.vmap(per_example)(tokens[:2], probe[:2])
    for i, one in enumerate(_reference_grads(cfg, params, tokens[:2], probe[:2])):
        assert _max_diff(jax.tree.map(lambda g: g[i], batched), one) < 1e-4


def test_checks_still_name_the_bad_input_under_a_transformation():
    cfg, params, tokens, _ = _case("gpt_oss")
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\], got shape \(32,\)"):
        jax.jit(lambda p: S.forward(cfg, p, tokens.reshape(-1)))(params)
    with pytest.raises(TypeError, match="integer ids"):
        jax.grad(lambda p: S.forward(cfg, p, tokens.astype(np.float32)).sum())(params)
    with pytest.raises(ValueError, match="vocab_size"):  # concrete outside a trace: values checked
        S.forward(cfg, params, tokens + cfg.vocab_size)
