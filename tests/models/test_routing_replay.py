"""Routing replay (R3, issue #21 point 1), at the router: replayed experts replace the top-k, their
weights come from the current router logits (so the router still learns), and the agreement
with what this forward would have chosen is measured."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfrrl_jax.models import moe as moe_lib

from model_fixtures import TINY, TINY_GPT_OSS


def _inputs(cfg, tokens=24, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, cfg.d_model)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(cfg.d_model, cfg.n_experts)) * 0.3, jnp.float32)
    return x, router


def _reference_weights(cfg, x, router, ids):
    """The weights of experts `ids` [tokens, k] from the router logits, written out per router kind."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    if cfg.router == "softmax_topk":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        w = np.take_along_axis(probs, ids, axis=-1)
        return w / w.sum(-1, keepdims=True) if cfg.norm_topk_prob else w
    top = np.take_along_axis(logits, ids, axis=-1)
    e = np.exp(top - top.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("cfg", [TINY, TINY_GPT_OSS], ids=["softmax_topk", "topk_softmax"])
def test_replaying_its_own_choice_changes_nothing(cfg):
    x, router = _inputs(cfg)
    ids, weights, metrics = moe_lib.route(cfg, x, router)
    ids2, weights2, metrics2 = moe_lib.route(cfg, x, router, replay_ids=ids.astype(jnp.int16))
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(weights2, weights)
    assert float(metrics2["routing_agreement"]) == 1.0 and "routing_agreement" not in metrics
    assert float(metrics2["router_aux_loss"]) == float(metrics["router_aux_loss"])


@pytest.mark.parametrize("cfg", [TINY, TINY_GPT_OSS], ids=["softmax_topk", "topk_softmax"])
def test_replayed_experts_are_used_where_masked_with_weights_from_the_current_router(cfg):
    x, router = _inputs(cfg)
    own, _, _ = moe_lib.route(cfg, x, router)
    rng = np.random.default_rng(1)
    # other experts for every token (distinct per row), replayed on the even tokens only
    replay = np.stack([rng.permutation(cfg.n_experts)[:cfg.top_k] for _ in range(x.shape[0])]).astype(np.int8)
    mask = np.arange(x.shape[0]) % 2 == 0
    ids, weights, metrics = moe_lib.route(cfg, x, router, replay_ids=jnp.asarray(replay),
                                          replay_mask=jnp.asarray(mask))
    want = np.where(mask[:, None], replay, np.asarray(own))
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(weights, _reference_weights(cfg, x, router, want), rtol=1e-5, atol=1e-6)
    agree = np.mean([[r in set(np.asarray(own)[t]) for r in replay[t]] for t in range(len(replay)) if mask[t]])
    assert float(metrics["routing_agreement"]) == pytest.approx(agree, abs=1e-6)
    assert agree < 1.0   # the permutations differ from the router's own choice somewhere


@pytest.mark.parametrize("cfg", [TINY, TINY_GPT_OSS], ids=["softmax_topk", "topk_softmax"])
def test_the_router_gets_the_gradient_of_the_replayed_weights(cfg):
    """d(sum(weights * c))/d(router) equals the gradient of the written-out formula at the
    replayed ids, and is not zero: replay keeps the router learning."""
    x, router = _inputs(cfg)
    replay = jnp.asarray(np.stack([np.random.default_rng(t).permutation(cfg.n_experts)[:cfg.top_k]
                                   for t in range(x.shape[0])]), jnp.int32)
    c = jnp.asarray(np.random.default_rng(2).normal(size=replay.shape), jnp.float32)

    def loss(r):
        return jnp.sum(moe_lib.route(cfg, x, r, replay_ids=replay)[1] * c)

    def reference(r):
        logits = x @ r
        if cfg.router == "softmax_topk":
            w = jnp.take_along_axis(jax.nn.softmax(logits, -1), replay, -1)
            w = w / w.sum(-1, keepdims=True) if cfg.norm_topk_prob else w
        else:
            w = jax.nn.softmax(jnp.take_along_axis(logits, replay, -1), -1)
        return jnp.sum(w * c)

    g, g_ref = jax.grad(loss)(router), jax.grad(reference)(router)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-7)
    assert float(jnp.max(jnp.abs(g))) > 1e-3
