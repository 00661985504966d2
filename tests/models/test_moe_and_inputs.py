"""Dropless MoE under adversarial routing, packed-sequence isolation, and input validation."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.models import moe as moe_lib

from model_fixtures import TINY, TINY_GPT_OSS, host, randomize


def _dense_reference(cfg, x, ids, weights, w):
    """Every token through every chosen expert, one expert at a time (no dispatch at all)."""
    x, ids, weights = map(np.asarray, (x, ids, weights))
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    out = np.zeros(x.shape, np.float64)
    for e in range(cfg.n_experts):
        g = x @ w["w_gate"][e]
        u = x @ w["w_up"][e]
        if cfg.expert_bias:
            g, u = g + w["b_gate"][e], u + w["b_up"][e]
        if cfg.expert_act == "gptoss_swiglu":
            g = np.minimum(g, cfg.swiglu_limit)
            u = np.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
            h = (u + 1) * g / (1 + np.exp(-cfg.swiglu_alpha * g))
        else:
            h = g / (1 + np.exp(-g)) * u
        y = h @ w["w_down"][e] + (w["b_down"][e] if cfg.expert_bias else 0)
        gate = np.sum(np.where(ids == e, weights, 0.0), axis=1)
        out += gate[:, None] * y
    return out


@pytest.mark.parametrize("cfg", [TINY, TINY_GPT_OSS], ids=["swiglu", "gptoss"])
@pytest.mark.parametrize("dispatch", ["padded", "ragged"])
@pytest.mark.parametrize("gmm", ["auto", "tiled"])
def test_dropless_when_every_token_picks_the_same_experts(cfg, dispatch, gmm):
    cfg = cfg.replace(moe_dispatch=dispatch, grouped_matmul=gmm)
    mesh = S.make_mesh(data=2, expert=4)
    params = randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)
    w = {k: v[0] for k, v in params["layers"]["moe"].items() if k.startswith(("w_", "b_"))}
    n = 24
    rng = np.random.RandomState(0)
    x = rng.randn(n, cfg.d_model).astype(np.float32)
    # adversarial: all tokens choose experts 7, 6, ... (the last shard holds every assignment)
    ids = np.tile(np.arange(cfg.n_experts - 1, cfg.n_experts - 1 - cfg.top_k, -1), (n, 1)).astype(np.int32)
    weights = rng.dirichlet(np.ones(cfg.top_k), size=n).astype(np.float32)
    fn = jax.jit(functools.partial(moe_lib.moe_experts, cfg))
    with jax.set_mesh(mesh):
        got = host(fn(x, ids, weights, w))
    want = _dense_reference(cfg, x, ids, weights, w)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.all(np.abs(got).sum(axis=1) > 0), "a token was dropped"
    # a random routing with a hot expert, too
    ids = np.stack([rng.choice(cfg.n_experts, cfg.top_k, replace=False, p=[.65] + [.05] * 7)
                    for _ in range(n)]).astype(np.int32)
    with jax.set_mesh(mesh):
        got = host(fn(x, ids, weights, w))
    np.testing.assert_allclose(got, _dense_reference(cfg, x, ids, weights, w), atol=1e-4, rtol=1e-4)


def test_router_metrics_hand_computed():
    cfg = TINY.replace(n_experts=4, top_k=1, norm_topk_prob=False)
    x = np.eye(4, dtype=np.float32)[:, :4]
    x = np.pad(x, ((0, 0), (0, cfg.d_model - 4)))
    router = np.zeros((cfg.d_model, 4), np.float32)
    router[0, 0] = router[1, 0] = router[2, 1] = router[3, 2] = np.log(3.0)
    ids, weights, m = moe_lib.route(cfg, jnp.asarray(x), jnp.asarray(router))
    assert host(ids).ravel().tolist() == [0, 0, 1, 2]
    p = 3 / 6  # softmax of [log3, 0, 0, 0] at the chosen expert
    np.testing.assert_allclose(host(weights).ravel(), [p] * 4, rtol=1e-6)
    frac = np.array([0.5, 0.25, 0.25, 0.0])
    mean_prob = np.array([(0.5 + 0.5 + 1 / 6 + 1 / 6) / 4, (1 / 6 * 3 + 0.5) / 4,
                          (1 / 6 * 3 + 0.5) / 4, 1 / 6])
    np.testing.assert_allclose(float(m["router_aux_loss"]), 4 * np.sum(frac * mean_prob), rtol=1e-6)
    np.testing.assert_allclose(float(m["router_z_loss"]), np.log(6.0) ** 2, rtol=1e-6)


def test_packed_segments_do_not_see_each_other():
    cfg = TINY_GPT_OSS
    mesh = S.make_mesh(data=2, expert=4)
    params = randomize(S.init_params(cfg, mesh, seed=0), seed=1)
    rng = np.random.RandomState(3)
    tokens = rng.randint(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    seg = np.array([[1] * 5 + [2] * 7, [1] * 12], np.int32)
    base = host(S.forward(cfg, params, tokens, segment_ids=seg))
    changed = tokens.copy()
    changed[0, :5] = (changed[0, :5] + 7) % cfg.vocab_size  # rewrite segment A of row 0
    after = host(S.forward(cfg, params, changed, segment_ids=seg))
    np.testing.assert_array_equal(after[0, 5:], base[0, 5:])  # segment B bit-identical
    assert np.abs(after[0, :5] - base[0, :5]).max() > 1e-4
    # a packed segment equals the same tokens run alone (positions restart at its start)
    alone = host(S.forward(cfg, params, tokens[:1, 5:]))
    np.testing.assert_allclose(base[0, 5:], alone[0], atol=1e-5)


def test_bad_inputs_get_clear_errors():
    cfg = TINY.replace(max_seq_len=16)
    params = S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=0)
    ok = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=512\); found min 1, max 512"):
        S.forward(cfg, params, np.array([[1, 512]], np.int32))
    with pytest.raises(ValueError, match="found min -1"):
        S.forward(cfg, params, np.array([[-1, 3]], np.int32))
    with pytest.raises(ValueError, match="seq length 17 > ModelConfig.max_seq_len=16"):
        S.forward(cfg, params, np.zeros((1, 17), np.int32))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\]"):
        S.forward(cfg, params, np.zeros((4,), np.int32))
    with pytest.raises(TypeError, match="integer ids"):
        S.forward(cfg, params, np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="segment_ids shape"):
        S.forward(cfg, params, ok, segment_ids=np.ones((2, 3), np.int32))
    with pytest.raises(ValueError, match="n_experts=6 is not divisible by the mesh's expert axis size 4"):
        S.init_params(TINY.replace(n_experts=6), S.make_mesh(data=2, expert=4))


def test_top_k_by_argmax_is_lax_top_k_and_keeps_tokens_sharded():
    from jax.sharding import NamedSharding, PartitionSpec

    from sfrrl_jax.models.moe import route, top_k_by_argmax

    x = jax.random.normal(jax.random.key(0), (64, 16))
    x = x.at[3, 5].set(x[3, 7])  # a tie: the lower expert id comes first, as in lax.top_k
    for k in (1, 2, 4):
        want_v, want_i = jax.lax.top_k(x, k)
        got_v, got_i = top_k_by_argmax(x, k)
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
        g_want = jax.grad(lambda a: jnp.sum(jax.lax.top_k(a, k)[0] ** 2))(x)
        g_got = jax.grad(lambda a: jnp.sum(top_k_by_argmax(a, k)[0] ** 2))(x)
        np.testing.assert_array_equal(np.asarray(g_got), np.asarray(g_want))
    # routing tokens split over 8 devices gathers no [tokens, experts] array (lax.top_k's did)
    mesh = S.make_mesh(data=2, expert=4)
    cfg = S.ModelConfig.preset("tiny-moe")
    xs = jax.device_put(jax.random.normal(jax.random.key(1), (64, cfg.d_model)),
                        NamedSharding(mesh, PartitionSpec(("data", "expert"))))
    w = jax.random.normal(jax.random.key(2), (cfg.d_model, cfg.n_experts))
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda a: route(cfg, a, w)[:2]).lower(xs).compile().as_text()
    assert f",{cfg.n_experts}]" not in "".join(l for l in hlo.splitlines() if "all-gather" in l)


@pytest.mark.parametrize("dispatch", ["padded", "ragged", "llep"])
def test_dispatch_in_token_chunks_is_the_same_function(dispatch):
    """moe_chunk_tokens: the device's tokens dispatched 4 at a time (7 per device here: a padded
    last chunk) give the unchunked values and gradients (x and every expert weight)."""
    cfg = TINY_GPT_OSS.replace(moe_dispatch=dispatch)
    mesh = S.make_mesh(data=2, expert=4)
    params = randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)
    w = {k: v[0] for k, v in params["layers"]["moe"].items() if k.startswith(("w_", "b_"))}
    rng = np.random.RandomState(2)
    n = 56
    x = rng.randn(n, cfg.d_model).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_experts, cfg.top_k, replace=False, p=[.5] + [.5 / 7] * 7)
                    for _ in range(n)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(cfg.top_k), size=n).astype(np.float32)
    probe = rng.randn(n, cfg.d_model).astype(np.float32)
    out = {}
    for chunk in (0, 4):
        c = cfg.replace(moe_chunk_tokens=chunk)
        loss = lambda x_, w_, c=c: jnp.sum(moe_lib.moe_experts(c, x_, ids, weights, w_) * probe)
        with jax.set_mesh(mesh):
            out[chunk] = jax.device_get(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w))
    (v0, (gx0, gw0)), (v4, (gx4, gw4)) = out[0], out[4]
    np.testing.assert_allclose(v4, v0, rtol=1e-5)
    np.testing.assert_allclose(gx4, gx0, rtol=1e-5, atol=1e-5)
    for k in gw0:
        np.testing.assert_allclose(gw4[k], gw0[k], rtol=1e-5, atol=1e-5, err_msg=k)
    assert np.abs(gw0["w_down"]).max() > 1e-3


@pytest.mark.parametrize("cfg", [TINY, TINY_GPT_OSS], ids=["swiglu", "gptoss"])
def test_all_experts_path_is_the_sparse_function_values_and_grads(cfg):
    """A few tokens on one expert shard take `all_experts_ffn` (every expert, weights zero where
    not chosen); its values and gradients (x, routing weights, every expert param) equal the
    sorted sparse path's (grouped_matmul forced) and the per-expert reference, also with the
    experts' mlp split over tensor=2."""
    params = randomize(S.init_params(cfg, S.make_mesh(data=8), seed=0), seed=5, scale=0.3)
    w = {k: host(v[0]) for k, v in params["layers"]["moe"].items() if k.startswith(("w_", "b_"))}
    rng = np.random.RandomState(1)
    n = 12
    x = rng.randn(n, cfg.d_model).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_experts, cfg.top_k, replace=False) for _ in range(n)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(cfg.top_k), size=n).astype(np.float32)
    cot = rng.randn(n, cfg.d_model).astype(np.float32)
    assert moe_lib._all_experts_is_cheaper(cfg, n, w)
    assert not moe_lib._all_experts_is_cheaper(cfg.replace(grouped_matmul="ragged_dot"), n, w)
    assert not moe_lib._all_experts_is_cheaper(cfg, 4096, w)

    def vjp(cfg, mesh):
        def f(x, weights, w):
            return jnp.sum(moe_lib.moe_experts(cfg, x, ids, weights, w) * cot)
        with jax.set_mesh(mesh):
            y = jax.jit(functools.partial(moe_lib.moe_experts, cfg))(x, ids, weights, w)
            return host(y), jax.tree.map(host, jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, weights, w))

    for mesh in (S.make_mesh(data=8), S.make_mesh(data=4, tensor=2)):
        got, got_grads = vjp(cfg, mesh)
        want, want_grads = vjp(cfg.replace(grouped_matmul="ragged_dot"), mesh)
        np.testing.assert_allclose(got, _dense_reference(cfg, x, ids, weights, w), atol=1e-4, rtol=1e-4)
        # fp32 sums in another order, relative to each array's scale (grads reach ~200 here):
        # measured at most 1e-6 of it
        for a, b in zip([got] + jax.tree.leaves(got_grads), [want] + jax.tree.leaves(want_grads)):
            assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, float(np.max(np.abs(b))))


def test_all_experts_path_masks_an_overflowing_unchosen_expert():
    """An expert no token chose overflows to inf on these inputs; the all-experts path masks it
    out (a 0 x inf would be nan) and returns the sparse path's finite result."""
    cfg = TINY
    params = randomize(S.init_params(cfg, S.make_mesh(data=8), seed=0), seed=5, scale=0.3)
    w = {k: host(v[0]) for k, v in params["layers"]["moe"].items() if k.startswith(("w_", "b_"))}
    w["w_up"] = w["w_up"].copy()
    w["w_up"][cfg.n_experts - 1] = 3e38   # expert 7 overflows: its output is inf or nan
    rng = np.random.RandomState(2)
    x = rng.randn(6, cfg.d_model).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_experts - 1, cfg.top_k, replace=False) for _ in range(6)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(cfg.top_k), size=6).astype(np.float32)
    got = host(jax.jit(functools.partial(moe_lib.all_experts_ffn, cfg))(x, ids, weights, w))
    want = host(jax.jit(functools.partial(moe_lib.moe_experts, cfg.replace(grouped_matmul="ragged_dot")))(
        x, ids, weights, w))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
