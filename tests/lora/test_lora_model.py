"""LoRA on the model: an adapter applied unmerged (x W + s (x A) B) equals the merged weights' forward, dense and
MoE (the experts' own pairs through the grouped matmul), on a mesh as on one device; B = 0 leaves the model as it
is; the forward composes with jit / grad / vmap; bad adapters and targets are refused by name."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.models.lora import LoraAdapter, LoraConfig, adapter_shapes, init_adapter, merge_adapter
from model_fixtures import TINY, TINY_DEEPSEEK, TINY_DENSE, TINY_MIXED, host, randomize, replicate_on, \
    single_device_mesh

ALL_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_MOE = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj",
           "router")


def random_b(adapter, seed=1, scale=0.3):
    """The adapter with every B drawn too (B = 0 at init would make every check below vacuous)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(adapter.weights)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    out = [scale * jax.random.normal(k, x.shape, x.dtype) if jax.tree_util.keystr(p).endswith("['b']") else x
           for (p, x), k in zip(flat, keys)]
    out = [jax.device_put(o, x.sharding) for o, (_, x) in zip(out, flat)]
    return LoraAdapter(jax.tree.unflatten(treedef, out), adapter.config)


TOKENS = np.random.RandomState(0).randint(1, 512, (4, 10)).astype(np.int32)


@pytest.mark.parametrize("cfg,targets", [(TINY_DENSE, ALL_DENSE), (TINY, ALL_MOE),
                                         (TINY_MIXED, ALL_MOE + ("gate_proj", "up_proj", "down_proj")),
                                         (TINY_DEEPSEEK, ("q_a_proj", "q_b_proj", "kv_a_proj", "o_proj",
                                                          "experts.up_proj", "down_proj")),
                                         (dataclasses.replace(TINY, grouped_matmul="tiled"), ALL_MOE),
                                         (dataclasses.replace(TINY, grouped_matmul="ragged_dot", moe_dispatch="llep",
                                                              llep_threshold=1.0), ALL_MOE)],
                         ids=["dense", "moe", "mixed_shared_expert", "latent", "moe_grouped_tiled", "moe_llep"])
def test_unmerged_adapter_equals_merged_weights_on_a_mesh(cfg, targets):
    mesh = S.make_mesh(data=2, expert=2, tensor=2)
    params = randomize(S.init_params(cfg, mesh, seed=0), seed=2)
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    adapter = init_adapter(cfg, lora, mesh, seed=3)
    np.testing.assert_array_equal(host(S.forward(cfg, params, TOKENS, adapter=adapter)),
                                  host(S.forward(cfg, params, TOKENS)))   # B = 0: the base model, bitwise
    adapter = random_b(adapter)
    got = host(S.forward(cfg, params, TOKENS, adapter=adapter))
    merged = host(S.forward(cfg, merge_adapter(cfg, params, adapter), TOKENS))
    base = host(S.forward(cfg, params, TOKENS))
    assert np.abs(got - base).max() > 0.05                    # the adapter changes the model
    np.testing.assert_allclose(got, merged, atol=2e-4, rtol=0)
    if cfg not in (TINY_DENSE, TINY):   # the mesh against one device: dense and the plain MoE suffice
        return
    one = single_device_mesh()
    one_adapter = LoraAdapter(replicate_on(jax.tree.map(host, adapter.weights), one), lora)
    np.testing.assert_allclose(host(S.forward(cfg, replicate_on(jax.tree.map(host, params), one), TOKENS,
                                              adapter=one_adapter)), got, atol=2e-5, rtol=0)


def test_adapter_is_sharded_like_the_weights_it_adapts():
    mesh = S.make_mesh(data=2, expert=2, tensor=2)
    adapter = init_adapter(TINY, LoraConfig(rank=4, targets=ALL_MOE), mesh)
    w = adapter.weights["layers"]
    assert w["moe"]["w_gate"]["a"].shape == (2, 8, 64, 4) and w["moe"]["w_gate"]["b"].shape == (2, 8, 4, 64)
    assert w["moe"]["w_gate"]["a"].sharding.spec[1] == "expert" and w["moe"]["w_gate"]["b"].sharding.spec[1] == "expert"
    assert w["moe"]["w_gate"]["b"].sharding.spec[3] == "tensor"      # the mlp dim, as the base's
    assert w["moe"]["w_down"]["a"].sharding.spec[2] == "tensor"
    assert w["attn"]["q_proj"]["b"].shape == (2, 4, 4, 16) and w["attn"]["q_proj"]["b"].sharding.spec[2] == "tensor"
    assert w["attn"]["o_proj"]["a"].shape == (2, 4, 16, 4)
    assert not np.any(host(w["attn"]["q_proj"]["b"]))                  # B starts at zero
    a = host(w["attn"]["q_proj"]["a"])
    assert 0 < np.abs(a).max() <= 1 / np.sqrt(64)                       # PEFT's kaiming-uniform bound
    assert jax.tree.map(lambda x: x.shape, adapter.weights) == jax.tree.map(
        lambda s: s.shape, adapter_shapes(TINY, adapter.config))


def test_forward_with_adapter_composes_with_jit_grad_vmap():
    mesh = S.make_mesh(data=2, expert=2, tensor=2)
    params = randomize(S.init_params(TINY, mesh, seed=0), seed=2)
    adapter = random_b(init_adapter(TINY, LoraConfig(rank=2, targets=ALL_MOE), mesh, seed=1))

    def loss(ad, p):
        return jnp.mean(S.forward(TINY, p, TOKENS, adapter=ad) ** 2)

    g = jax.jit(jax.grad(loss))(adapter, params)
    assert isinstance(g, LoraAdapter) and g.config == adapter.config
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g))   # every A and B gets a gradient
    # grad w.r.t. a B by finite differences of one entry
    b = adapter.weights["layers"]["moe"]["w_down"]["b"]
    eps = 1e-2
    bumped = dataclasses.replace(adapter, weights=jax.tree.map(lambda x: x, adapter.weights))
    bumped.weights["layers"]["moe"]["w_down"]["b"] = b.at[0, 1, 0, 3].add(eps)
    fd = (float(loss(bumped, params)) - float(loss(adapter, params))) / eps
    np.testing.assert_allclose(fd, float(g.weights["layers"]["moe"]["w_down"]["b"][0, 1, 0, 3]), rtol=0.1, atol=1e-4)
    # vmap over two batches equals two calls
    batches = np.stack([TOKENS, TOKENS[::-1]])
    v = jax.vmap(lambda t: S.forward(TINY, params, t, adapter=adapter))(batches)
    np.testing.assert_allclose(host(v[1]), host(S.forward(TINY, params, TOKENS[::-1], adapter=adapter)), atol=2e-5)


def test_lora_config_and_adapter_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="LoraConfig.rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="unknown target 'qproj'"):
        LoraConfig(targets=("qproj",))
    with pytest.raises(ValueError, match="kv_b_proj is absorbed"):
        LoraConfig(targets=("kv_b_proj",))
    with pytest.raises(ValueError, match="LoraConfig.targets must be a list"):
        LoraConfig(targets="q_proj")
    mesh = S.make_mesh(data=2, expert=2, tensor=2)
    with pytest.raises(ValueError, match=r"\['experts.gate_proj'\] adapt no weight of this qwen2 model"):
        init_adapter(TINY_DENSE, LoraConfig(targets=("q_proj", "experts.gate_proj")), mesh)
    params = S.init_params(TINY, mesh)
    other = init_adapter(TINY_DENSE, LoraConfig(rank=2), mesh)
    with pytest.raises(ValueError, match="adapter leaf layers/attn/q_proj/b has shape"):
        S.forward(TINY, params, TOKENS, adapter=LoraAdapter(
            {"layers": {"attn": {k: {"a": v["a"], "b": v["b"][:, :1]} for k, v in
                                 init_adapter(TINY, LoraConfig(rank=2), mesh).weights["layers"]["attn"].items()}}},
            LoraConfig(rank=2)))
    del other
    with pytest.raises(TypeError, match="adapter must be a LoraAdapter"):
        S.forward(TINY, params, TOKENS, adapter={"layers": {}})
