"""LLEP (least-loaded expert parallelism) == padded EP, forward and grads, under skewed routing;
and its plan really spills: lower per-device load than standard EP, within the static buffer."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.models import llep
from sfrrl_jax.models import moe as moe_lib
from sfrrl_jax.models import transformer as tfm

from model_fixtures import TINY, TINY_GPT_OSS, randomize

CFG = TINY.replace(router_bias=True)  # a router bias lets the test force the skew


def _router_bias(kind: str, n_experts: int) -> np.ndarray:
    if kind == "uniform":
        return np.zeros(n_experts, np.float32)
    if kind == "zipf":  # top-1 odds ~ 1 / rank^1.5 (the router's own logits blur it a little)
        return -1.5 * np.log(np.arange(1, n_experts + 1, dtype=np.float32))
    bias = np.zeros(n_experts, np.float32)  # "one": every token's first choice is expert 0
    bias[0] = 30.0
    return bias


def _loss(cfg, params, tokens, probe):
    logits, aux = tfm.forward_with_aux(cfg, params, tokens)
    return jnp.sum(logits * probe) + aux["router_aux_loss"] + aux["router_z_loss"], logits


@functools.partial(jax.jit, static_argnums=(0,))
def _outputs(cfg, params, tokens, probe):
    return jax.value_and_grad(functools.partial(_loss, cfg), has_aux=True)(params, tokens, probe)


@functools.lru_cache(maxsize=None)
def _inputs():
    mesh = S.make_mesh(data=2, expert=4)
    params = randomize(S.init_params(CFG, mesh, seed=1), seed=2)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, CFG.vocab_size, (4, 10)).astype(np.int32)  # 40 tokens: padded to 8 shards
    probe = rng.randn(4, 10, CFG.vocab_size).astype(np.float32)
    return mesh, params, tokens, probe


@pytest.mark.parametrize("routing", ["uniform", "zipf", "one"])
def test_llep_matches_padded_forward_and_grads(routing):
    mesh, params, tokens, probe = _inputs()
    moe = dict(params["layers"]["moe"])
    old = moe["router_bias"]
    bias = np.broadcast_to(_router_bias(routing, CFG.n_experts), old.shape)
    moe["router_bias"] = jax.device_put(jnp.asarray(bias), old.sharding)
    params = {**params, "layers": {**params["layers"], "moe": moe}}
    with jax.set_mesh(mesh):
        (v0, logits0), g0 = jax.device_get(_outputs(CFG, params, tokens, probe))
        (v1, logits1), g1 = jax.device_get(_outputs(CFG.replace(moe_dispatch="llep"), params, tokens, probe))
    np.testing.assert_allclose(logits1, logits0, atol=1e-5, rtol=0)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    flat0 = dict(jax.tree_util.tree_flatten_with_path(g0)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(g1)[0]:
        # an entry that nearly cancels (-0.04 among entries of +-35) keeps the rounding of its large
        # terms, which the order of the sums decides (measured 1.5e-5 on one CPU model): the bound
        # scales with the leaf's largest entry, as in test_forward_parallel (a wrong dispatch errs
        # by the order of the entries)
        want = flat0[path]
        np.testing.assert_allclose(a, want, atol=max(1e-5, 5e-6 * float(np.abs(want).max())), rtol=1e-5,
                                   err_msg=str(path))
    assert np.abs(g1["layers"]["moe"]["w_down"]).max() > 1e-3
    assert np.abs(g1["layers"]["moe"]["router"]).max() > 1e-3


def _skewed_ids(kind, n, cfg, rng):
    e = cfg.n_experts
    if kind == "one":  # every token picks experts 0..k-1: one device natively holds everything
        return np.tile(np.arange(cfg.top_k), (n, 1)).astype(np.int32)
    p = np.ones(e) if kind == "uniform" else 1.0 / np.arange(1, e + 1) ** {"zipf1": 1.0, "zipf15": 1.5}[kind]
    return np.stack([rng.choice(e, cfg.top_k, replace=False, p=p / p.sum()) for _ in range(n)]).astype(np.int32)


@pytest.mark.parametrize("kind", ["zipf1", "zipf15", "one"])
def test_plan_spills_under_skew_and_fits_the_buffer(kind):
    cfg, shards, n = TINY, 4, 64
    n_local, a = cfg.n_experts // shards, 64 * cfg.top_k
    ids = _skewed_ids(kind, shards * n, cfg, np.random.RandomState(1))
    counts = np.stack([np.bincount(ids[s * n:(s + 1) * n].ravel(), minlength=cfg.n_experts)
                       for s in range(shards)])
    z = llep.default_spill_slots(cfg.n_experts, shards)
    rows, slots = map(np.asarray, llep.plan_spill(jnp.asarray(counts), n_local, a, cfg.llep_threshold,
                                                  llep.CAPACITY_FACTOR, z))
    np.testing.assert_array_equal(rows.sum(axis=1), counts.sum(axis=0))  # every assignment placed
    native = counts.sum(axis=0).reshape(shards, n_local).sum(axis=1)
    load = rows.sum(axis=0)
    assert load.max() < native.max(), (load, native)
    assert load.max() <= llep.buffer_rows(a, shards, n_local, cfg.llep_threshold, llep.CAPACITY_FACTOR, z)
    off_native = rows * (np.arange(cfg.n_experts)[:, None] // n_local != np.arange(shards)[None, :])
    assert set(np.nonzero(off_native.sum(axis=1))[0]) <= set(slots.tolist())  # spilled => has a slot


def test_llep_exact_with_expert_biases_and_split_mlp():
    """GPT-OSS experts (biases, clamped SwiGLU) with mlp split over `tensor`: the guest weight
    table is each tensor shard's mlp slice; every token on two experts of one device."""
    cfg = TINY_GPT_OSS
    mesh = S.make_mesh(data=1, expert=4, tensor=2)
    params = randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)
    w = {k: v[0] for k, v in params["layers"]["moe"].items() if k.startswith(("w_", "b_"))}
    rng = np.random.RandomState(0)
    n = 32
    x = rng.randn(n, cfg.d_model).astype(np.float32)
    ids = _skewed_ids("one", n, cfg, rng)
    weights = rng.dirichlet(np.ones(cfg.top_k), size=n).astype(np.float32)

    def run(dispatch):
        c = cfg.replace(moe_dispatch=dispatch)
        f = lambda x, w: jnp.sum(jnp.sin(moe_lib.moe_experts(c, x, ids, weights, w)))  # noqa: E731
        with jax.set_mesh(mesh):
            return jax.device_get(jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w))

    (v0, (gx0, gw0)), (v1, (gx1, gw1)) = run("padded"), run("llep")
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    np.testing.assert_allclose(gx1, gx0, atol=1e-5, rtol=1e-5)
    for k in gw0:
        np.testing.assert_allclose(gw1[k], gw0[k], atol=1e-5, rtol=1e-5, err_msg=k)
