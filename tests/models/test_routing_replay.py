"""Routing replay (R3, issue #21 point 1), at the router: replayed experts replace the top-k, their
weights come from the current router logits (so the router still learns), and the agreement
with what this forward would have chosen is measured."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfrrl_jax.models import moe as moe_lib

from model_fixtures import TINY, TINY_GLM, TINY_GPT_OSS

ROUTERS = pytest.mark.parametrize("cfg", [TINY, TINY_GPT_OSS, TINY_GLM], ids=["softmax_topk", "topk_softmax",
                                                                           "sigmoid_topk"])


def _inputs(cfg, tokens=24, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, cfg.d_model)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(cfg.d_model, cfg.n_experts)) * 0.3, jnp.float32)
    return x, router


def _reference_weights(cfg, x, router, ids):
    """The weights of experts `ids` [tokens, k] from the router logits, written out per router kind."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    if cfg.router == "sigmoid_topk":
        w = np.take_along_axis(1 / (1 + np.exp(-logits)), ids, axis=-1)
        return (w / w.sum(-1, keepdims=True) if cfg.norm_topk_prob else w) * cfg.router_scale
    if cfg.router == "softmax_topk":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        w = np.take_along_axis(probs, ids, axis=-1)
        return (w / w.sum(-1, keepdims=True) if cfg.norm_topk_prob else w) * cfg.router_scale
    top = np.take_along_axis(logits, ids, axis=-1)
    e = np.exp(top - top.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@ROUTERS
def test_replaying_its_own_choice_changes_nothing(cfg):
    x, router = _inputs(cfg)
    ids, weights, metrics = moe_lib.route(cfg, x, router)
    ids2, weights2, metrics2 = moe_lib.route(cfg, x, router, replay_ids=ids.astype(jnp.int16))
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(weights2, weights)
    assert float(metrics2["routing_agreement"]) == 1.0 and "routing_agreement" not in metrics
    assert float(metrics2["router_aux_loss"]) == float(metrics["router_aux_loss"])


@ROUTERS
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


@ROUTERS
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
        if cfg.router == "sigmoid_topk":
            w = jnp.take_along_axis(jax.nn.sigmoid(logits), replay, -1)
            w = (w / w.sum(-1, keepdims=True) if cfg.norm_topk_prob else w) * cfg.router_scale
        elif cfg.router == "softmax_topk":
            w = jnp.take_along_axis(jax.nn.softmax(logits, -1), replay, -1)
            w = w / w.sum(-1, keepdims=True) if cfg.norm_topk_prob else w
        else:
            w = jax.nn.softmax(jnp.take_along_axis(logits, replay, -1), -1)
        return jnp.sum(w * c)

    g, g_ref = jax.grad(loss)(router), jax.grad(reference)(router)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-7)
    assert float(jnp.max(jnp.abs(g))) > 1e-3


def test_sigmoid_routing_chooses_as_glm_and_deepseek_do():
    """sigmoid_topk against the rule written out (transformers' Glm4MoeTopkRouter): the choice is
    by sigmoid + selection bias within the best router_topk_groups groups (a group's worth: its two
    best), the weights are the chosen sigmoids without the bias, renormalised, times router_scale."""
    cfg = TINY_GLM
    x, router = _inputs(cfg, tokens=64)
    bias = jnp.asarray(np.random.default_rng(3).normal(size=cfg.n_experts) * 0.5, jnp.float32)
    ids, weights, _ = moe_lib.route(cfg, x, router, score_bias=bias)
    scores = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(router, np.float64))))
    choice = scores + np.asarray(bias, np.float64)
    grouped = choice.reshape(len(choice), cfg.router_groups, -1)
    worth = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    best_groups = np.argsort(-worth, axis=-1)[:, :cfg.router_topk_groups]
    allowed = np.full_like(grouped, -np.inf)
    for t, groups in enumerate(best_groups):
        allowed[t, groups] = grouped[t, groups]
    want = np.argsort(-allowed.reshape(len(choice), -1), axis=-1)[:, :cfg.top_k]
    assert [set(r) for r in np.asarray(ids)] == [set(r) for r in want]
    np.testing.assert_allclose(weights, _reference_weights(cfg, x, router, np.asarray(ids)), rtol=1e-5, atol=1e-6)
    # the bias and the groups both change choices here (the test can tell them apart)
    unbiased, _, _ = moe_lib.route(cfg, x, router)
    ungrouped, _, _ = moe_lib.route(cfg.replace(router_groups=1, router_topk_groups=1), x, router, score_bias=bias)
    assert np.any(np.asarray(unbiased) != np.asarray(ids)) and np.any(np.asarray(ungrouped) != np.asarray(ids))
    assert np.asarray(ids).max() < cfg.n_experts and np.allclose(np.asarray(weights).sum(-1), cfg.router_scale)



def test_group_limited_softmax_routing_chooses_as_deepseek_v2_does():
    """softmax_topk with groups against the rule written out (transformers' DeepseekV2TopkRouter,
    'group_limited_greedy'): the top k probabilities within the router_topk_groups groups whose
    best probability is highest, weighted by those probabilities (not renormalised here) times
    router_scale; replayed choices keep their own weights."""
    # 3 of 8 experts from 2 of 4 groups (with k <= the groups kept the best group maxima hold the top k)
    cfg = TINY_GLM.replace(router="softmax_topk", norm_topk_prob=False, router_scale=1.6, top_k=3)
    x, router = _inputs(cfg, tokens=64)
    ids, weights, _ = moe_lib.route(cfg, x, router)
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    grouped = probs.reshape(len(probs), cfg.router_groups, -1)
    best_groups = np.argsort(-grouped.max(-1), axis=-1)[:, :cfg.router_topk_groups]
    allowed = np.zeros_like(grouped)   # transformers masks the other groups with 0
    for t, groups in enumerate(best_groups):
        allowed[t, groups] = grouped[t, groups]
    want = np.argsort(-allowed.reshape(len(probs), -1), axis=-1)[:, :cfg.top_k]
    assert [set(r) for r in np.asarray(ids)] == [set(r) for r in want]
    np.testing.assert_allclose(weights, _reference_weights(cfg, x, router, np.asarray(ids)), rtol=1e-5, atol=1e-6)
    ungrouped, _, _ = moe_lib.route(cfg.replace(router_groups=1, router_topk_groups=1), x, router)
    assert np.any(np.asarray(ungrouped) != np.asarray(ids))   # the groups change choices here
    replayed, replayed_w, m = moe_lib.route(cfg, x, router, replay_ids=ungrouped)
    np.testing.assert_array_equal(replayed, ungrouped)
    np.testing.assert_allclose(replayed_w, _reference_weights(cfg, x, router, np.asarray(ungrouped)), rtol=1e-5,
                               atol=1e-6)
    assert float(m["routing_agreement"]) < 1.0

# -- through the forward ---------------------------------------------------------------------------

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.models import transformer as tfm  # noqa: E402

from model_fixtures import TINY_MIXED  # noqa: E402


def _params(cfg, seed=0):
    return S.init_params(cfg, S.make_mesh(data=1, expert=1, devices=jax.devices()[:1]), seed=seed)


def test_the_forward_replays_its_own_routes_exactly_and_reports_agreement_per_moe_layer():
    cfg = TINY_MIXED
    params = _params(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    fwd = jax.jit(lambda p, t, r: tfm.forward_hidden(cfg, p, t, routes=r, return_routes=True))
    hidden, aux, used = jax.jit(lambda p, t: tfm.forward_hidden(cfg, p, t, return_routes=True))(params, tokens)
    moe = tfm.moe_layer_ids(cfg)
    assert used.shape == (2, 11, len(moe), cfg.top_k) and len(moe) < cfg.n_layers
    hidden2, aux2, used2 = fwd(params, tokens, used.astype(jnp.int8))
    np.testing.assert_array_equal(used2, used)
    np.testing.assert_array_equal(hidden2, hidden)
    assert float(aux2["routing_agreement"]) == 1.0 and "routing_agreement" not in aux
    assert sorted(k for k in aux2 if k.startswith("routing_agreement/")) == \
        sorted(f"routing_agreement/layer_{i}" for i in moe)
    with pytest.raises(ValueError, match=r"routes has shape \(2, 11, 1, 2\)"):
        tfm.forward_hidden(cfg, params, tokens, routes=used[:, :, :1])


def test_bf16_shapes_change_routing_and_replay_restores_the_engines_experts():
    """The engine's and the trainer's forwards see a sequence in batches of different shapes; in
    bf16 some top-k choices may flip (the share is printed: it depends on the CPU's rounding).
    Replayed routes (here the engine's, shifted by one expert so that they surely differ from the
    trainer's own) are exactly the experts the second forward uses where the mask says, its own
    choice elsewhere, and the router still gets a gradient."""
    cfg = TINY.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = _params(cfg, seed=3)
    rng = np.random.default_rng(4)
    seq = rng.integers(0, cfg.vocab_size, 40)
    alone = jnp.asarray(seq[None], jnp.int32)                                    # [1, 40]
    batch = np.zeros((3, 56), np.int32)                                          # [3, 56], padded
    batch[0, :40], batch[1] = seq, rng.integers(0, cfg.vocab_size, 56)
    batch[2, :30] = rng.integers(0, cfg.vocab_size, 30)
    segments = np.zeros((3, 56), np.int32)
    segments[0, :40], segments[1], segments[2, :30] = 1, 1, 1
    batch, segments = jnp.asarray(batch), jnp.asarray(segments)
    run = jax.jit(lambda p, r, m: tfm.forward_hidden(cfg, p, batch, segments, routes=r, routes_mask=m,
                                                     return_routes=True))
    _, _, engine = jax.jit(lambda p, t: tfm.forward_hidden(cfg, p, t, return_routes=True))(params, alone)
    engine = np.asarray(engine)[0]                                               # [40, layers, k]
    routes = np.zeros((3, 56) + engine.shape[1:], np.int16)
    _, _, own = run(params, jnp.asarray(routes), jnp.zeros((3, 56), bool))      # nothing replayed
    own = np.asarray(own)
    print(f"bf16: {np.mean(own[0, :40] != engine):.2%} of (token, layer, choice) routing decisions differ "
          "between the two batch shapes")
    routes[0, :40] = (engine + 1) % cfg.n_experts
    mask = np.zeros((3, 56), bool)
    mask[0, :40] = True
    _, aux, used = run(params, jnp.asarray(routes), jnp.asarray(mask))
    used = np.asarray(used)
    np.testing.assert_array_equal(used[0, :40], routes[0, :40])
    np.testing.assert_array_equal(used[1:], own[1:])
    assert 0.0 <= float(aux["routing_agreement"]) < 1.0

    def loss(p):
        hidden, _ = tfm.forward_hidden(cfg, p, batch, segments, routes=jnp.asarray(routes), routes_mask=jnp.asarray(mask))
        return jnp.sum(hidden[0, :40].astype(jnp.float32) ** 2)

    router_grad = jax.grad(loss)(params)["layers"]["moe"]["router"]
    assert float(jnp.max(jnp.abs(router_grad.astype(jnp.float32)))) > 0


def test_public_forward_replays_routes_under_jit_and_grad_and_names_bad_ones():
    """`S.forward(..., routes=, routes_mask=, return_routes=)`: replaying its own routes changes
    nothing, it composes with jit and grad (the router gets a gradient), and bad routes are named."""
    cfg = TINY
    params = _params(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    logits, aux, used = S.forward(cfg, params, tokens, return_aux=True, return_routes=True)
    assert used.shape == (2, 9, cfg.n_layers, cfg.top_k) and "routing_agreement" not in aux
    again, aux2 = S.forward(cfg, params, tokens, return_aux=True, routes=np.asarray(used, np.int16))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(logits))
    assert float(aux2["routing_agreement"]) == 1.0
    other = (np.asarray(used) + 1) % cfg.n_experts
    mask = np.zeros((2, 9), bool)
    mask[0] = True

    def loss(p):
        return jnp.sum(S.forward(cfg, p, tokens, routes=other, routes_mask=mask) ** 2)
    grads = jax.jit(jax.grad(loss))(params)
    assert float(jnp.max(jnp.abs(grads["layers"]["moe"]["router"]))) > 0
    replayed = S.forward(cfg, params, tokens, routes=other, routes_mask=mask, return_routes=True)[1]
    np.testing.assert_array_equal(np.asarray(replayed)[0], other[0])
    np.testing.assert_array_equal(np.asarray(replayed)[1], np.asarray(used)[1])
    with pytest.raises(ValueError, match=r"routes has shape \(2, 9, 1, 2\)"):
        S.forward(cfg, params, tokens, routes=other[:, :, :1])
    with pytest.raises(ValueError, match=r"expert ids in \[0, n_experts=8\); found min \d+, max 8"):
        S.forward(cfg, params, tokens, routes=other + 1)
    with pytest.raises(TypeError, match="integer expert ids"):
        S.forward(cfg, params, tokens, routes=other.astype(np.float32))
    with pytest.raises(ValueError, match="routes_mask without routes"):
        S.forward(cfg, params, tokens, routes_mask=mask)
