"""Expert-parallel forward == single-device forward, for logits and param gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.models import transformer as tfm

from model_fixtures import TINY, TINY_GPT_OSS, TINY_MIXTRAL, host, randomize, replicate_on, single_device_mesh

CASES = {
    "qwen3": TINY,
    "gpt_oss": TINY_GPT_OSS,
    "mixtral": TINY_MIXTRAL,
}


def _loss(cfg, params, tokens, probe):
    logits, aux = tfm.forward_with_aux(cfg, params, tokens)
    return jnp.sum(logits * probe) + aux["router_aux_loss"] + aux["router_z_loss"], logits


@functools.partial(jax.jit, static_argnums=(0,))
def _outputs(cfg, params, tokens, probe):
    """(loss, logits), grads in one compile."""
    return jax.value_and_grad(functools.partial(_loss, cfg), has_aux=True)(params, tokens, probe)


def _run(cfg, params, tokens, probe):
    with jax.set_mesh(S.models.mesh_of(params)):
        return jax.device_get(_outputs(cfg, params, tokens, probe))


@functools.lru_cache(maxsize=None)
def _case(family):
    """Inputs and the single-device reference (independent of the dispatch path)."""
    cfg = CASES[family]
    params = randomize(S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=1), seed=2)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (4, 10)).astype(np.int32)  # 40 tokens: padded to 8 shards
    probe = rng.randn(4, 10, cfg.vocab_size).astype(np.float32)
    return params, tokens, probe, _run(cfg, replicate_on(params, single_device_mesh()), tokens, probe)


# Every family on the padded dispatch; the ragged exchange (family-independent) on two of them.
@pytest.mark.parametrize("family,dispatch", [(f, "padded") for f in sorted(CASES)]
                         + [("gpt_oss", "ragged"), ("qwen3", "ragged")])
def test_expert_parallel_matches_single_device(family, dispatch):
    params, tokens, probe, ((v1, logits1), g1) = _case(family)
    cfg = CASES[family].replace(moe_dispatch=dispatch)
    (v8, logits8), g8 = _run(cfg, params, tokens, probe)
    np.testing.assert_allclose(logits8, logits1, atol=1e-5, rtol=0)
    np.testing.assert_allclose(v8, v1, rtol=1e-5)
    flat1 = dict(jax.tree_util.tree_flatten_with_path(g1)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(g8)[0]:
        # a gradient entry is a sum over every token's contribution, and one that nearly cancels
        # (-0.46 among entries of +-65) keeps the rounding of its large terms: the absolute bound
        # scales with the leaf's largest entry (a wrong dispatch errs by the order of the entries)
        want = flat1[path]
        np.testing.assert_allclose(a, want, atol=max(1e-5, 1e-6 * float(np.abs(want).max())), rtol=1e-5,
                                   err_msg=str(path))
    # the router and the experts both receive gradient (the comparison is not of zeros)
    assert np.abs(g8["layers"]["moe"]["w_down"]).max() > 1e-3
    assert np.abs(g8["layers"]["moe"]["router"]).max() > 1e-3


def test_tensor_axis_matches_single_device():
    cfg = TINY_GPT_OSS
    mesh = S.make_mesh(data=2, expert=2, tensor=2)
    params = randomize(S.init_params(cfg, mesh, seed=3), seed=4)
    # expert mlp hidden (48) is split over tensor: partial sums are reduced inside the MoE
    assert params["layers"]["moe"]["w_down"].sharding.spec[2] == "tensor"
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (4, 8)).astype(np.int32)
    got = S.forward(cfg, params, tokens)
    want = S.forward(cfg, replicate_on(params, single_device_mesh()), tokens)
    np.testing.assert_allclose(host(got), host(want), atol=1e-5, rtol=0)


def test_param_shardings_follow_the_rules_table():
    cfg = TINY_GPT_OSS
    mesh = S.make_mesh(data=2, expert=4)
    params = S.init_params(cfg, mesh, seed=0)
    axes = S.param_logical_axes(cfg)
    from sfrrl_jax.mesh import sharding_for

    def check(a, x):
        assert x.sharding == sharding_for(mesh, a, x.shape)
        assert x.ndim == len(a)
    jax.tree.map(check, axes, params, is_leaf=lambda t: isinstance(t, tuple))
    moe = params["layers"]["moe"]
    for name in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"):
        assert moe[name].sharding.spec[1] == "expert", name
        # each device holds 2 of the 8 experts
        assert moe[name].addressable_shards[0].data.shape[1] == cfg.n_experts // 4
    # dense weights replicate over data (and expert): every device holds the whole q projection
    q = params["layers"]["attn"]["q_proj"]
    assert q.addressable_shards[0].data.shape == q.shape


@pytest.mark.parametrize("remat", ["full", "dots_attention_out"])
def test_remat_policies_change_memory_not_results(remat):
    params, tokens, probe, ((v1, logits1), g1) = _case("qwen3")
    (v, logits), g = _run(CASES["qwen3"].replace(remat=remat), params, tokens, probe)
    np.testing.assert_allclose(logits, logits1, atol=1e-5, rtol=0)
    flat1 = dict(jax.tree_util.tree_flatten_with_path(g1)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(g)[0]:
        np.testing.assert_allclose(a, flat1[path], atol=1e-5, rtol=1e-5, err_msg=str(path))


def test_attention_out_remat_keeps_the_attention_forward_from_rerunning():
    """'attention_out' saves the blockwise core's output and log-sum-exp: the backward then has
    as many loops as without remat, while 'full' re-runs each layer's attention forward loops.
    Counted in the program jax lowers (where remat acts), not in XLA's compiled one: XLA:CPU's
    loop emitters (the tests' compile flags) expand other ops into loops of their own."""
    import re

    mesh = single_device_mesh()
    counts = {}
    params = S.init_params(CASES["qwen3"], mesh)  # remat does not change the params: one init
    for remat in ("none", "attention_out", "full"):
        # ragged_dot experts: the tiled grouped matmul is a loop too, and these counts are attention's
        cfg = CASES["qwen3"].replace(remat=remat, attention_block_q=16, attention_block_k=16,
                                     grouped_matmul="ragged_dot")
        tokens = np.zeros((1, 64), np.int32)
        loss = lambda p: jnp.sum(tfm.forward_hidden(cfg, p, tokens)[0] ** 2)  # noqa: E731
        with jax.set_mesh(mesh):
            lowered = jax.jit(jax.grad(loss)).lower(params).as_text()
        counts[remat] = len(re.findall(r"stablehlo\.while", lowered))
    assert counts["attention_out"] == counts["none"] < counts["full"], counts
