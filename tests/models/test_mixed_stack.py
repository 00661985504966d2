"""Mixed MoE/dense layer stacks (ModelConfig.dense_layers, HF Qwen3-MoE's mlp_only_layers): the
MoE layers stacked under `layers`, the dense ones under `dense_layers`, one scan per run of
same-kind layers. Checked against a per-layer loop, across meshes, and in a train step."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sfrrl_jax as S
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.rl.config import LossConfig

from model_fixtures import TINY, TINY_MIXED, host, randomize, replicate_on, single_device_mesh


def _inputs(cfg, seed=0):
    """Two rows of 13: row 0 packs segments of 6 and 7 tokens, row 1 ends in 3 padding tokens."""
    rng = np.random.RandomState(seed)
    seg = np.ones((2, 13), np.int32)
    seg[0, 6:], seg[1, 10:] = 2, 0
    return rng.randint(0, cfg.vocab_size, (2, 13)).astype(np.int32), seg


@functools.partial(jax.jit, static_argnums=(0,))
def _per_layer_loop(cfg, params, tokens, segment_ids):
    """The reference: a Python loop over the model's layers in order, each Block taken from its
    row of its stack (`layer_slot`); no scan, no slicing of runs. Returns (logits, per-MoE-layer
    metrics in layer order)."""
    model = tfm.bind(cfg, params)
    segment_ids, positions = tfm.default_positions_and_segments(tokens, segment_ids)
    x = model.embed(tokens)
    metrics = []
    for layer in range(cfg.n_layers):
        key, row = tfm.layer_slot(cfg, layer)
        graphdef, state = nnx.split(getattr(model, key))
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[row], state))
        x, m = block(x, positions, segment_ids, cfg.layer_windows[layer], segment_ids > 0)
        if m:
            metrics.append(m)
    logits = tfm.logits_from_hidden(cfg, params, model.final_norm(x))
    return logits, metrics


def test_layout_runs_and_config_checks():
    cfg = TINY_MIXED
    assert tfm.layer_stacks(cfg) == (("layers", (0, 2)), ("dense_layers", (1,)))
    assert tfm.layer_runs(cfg) == (("layers", 0, 1, 0), ("dense_layers", 0, 1, 1), ("layers", 1, 2, 2))
    assert tfm.layer_runs(cfg.replace(n_layers=5, dense_layers=(3, 1, 2), layer_types=None)) == (
        ("layers", 0, 1, 0), ("dense_layers", 0, 3, 1), ("layers", 1, 2, 4))
    shapes = tfm.param_shapes(cfg)
    assert "moe" not in shapes["dense_layers"] and "mlp" not in shapes["layers"]
    assert shapes["dense_layers"]["mlp"]["w_gate"].shape == (1, 64, 40)
    assert shapes["layers"]["moe"]["w_gate"].shape == (2, 8, 64, 64)
    assert tfm.param_logical_axes(cfg)["dense_layers"]["mlp"]["w_down"] == ("layers", "mlp", "embed")
    assert "dense_layers" not in tfm.param_shapes(TINY)     # uniform models: the layout of before
    for bad, message in ((dict(dense_layers=(3,)), "dense_layers[0] must be in [0, 2], got 3"),
                         (dict(dense_layers=(1, 1)), "dense_layers=(1, 1) repeats"),
                         (dict(d_ff=0), "dense_layers=(1,) needs d_ff >= 1"),
                         (dict(dense_layers=(0, 1, 2)), "names every layer"),
                         (dict(dense_layers=1), "dense_layers must be a tuple")):
        with pytest.raises(ValueError, match=re.escape(message)):
            cfg.replace(**bad)
    with pytest.raises(ValueError, match="dense_layers=.* needs n_experts > 0"):
        cfg.replace(n_experts=0, d_ff_shared=0, shared_expert_gate=False)
    with pytest.raises(ValueError, match="d_ff_shared=24 needs n_experts > 0"):
        cfg.replace(n_experts=0, dense_layers=())
    with pytest.raises(ValueError, match="shared_expert_gate needs d_ff_shared >= 1"):
        cfg.replace(d_ff_shared=0)
    assert shapes["layers"]["shared_expert"]["w_up"].shape == (2, 64, 24)   # MoE layers only
    assert shapes["layers"]["shared_gate"].shape == (2, 64, 1) and "shared_gate" not in shapes["dense_layers"]
    assert cfg.replace(dense_layers=[2, 0]).dense_layers == (0, 2)   # gin/JSON lists, any order


def test_forward_under_vmap_equals_a_per_layer_loop_and_context_parallel():
    cfg = TINY_MIXED
    one = single_device_mesh()
    params = randomize(S.init_params(cfg, one, seed=1), seed=2)
    assert tfm.count_params(params) == cfg.param_count()
    tokens, seg = _inputs(cfg)
    with jax.set_mesh(one):
        # the forward under a user's vmap (a leading axis of 1) and jit: a pure function
        logits, aux = jax.jit(jax.vmap(lambda t, s: tfm.forward_with_aux(cfg, params, t, s)))(tokens[None], seg[None])
        ref, per_layer = jax.device_get(_per_layer_loop(cfg, params, tokens, seg))
    assert len(per_layer) == 2   # the MoE layers only: a dense layer has no router
    np.testing.assert_allclose(host(logits)[0], ref, atol=2e-6, rtol=0)
    for k, v in aux.items():     # the aux metrics are means over the MoE layers
        np.testing.assert_allclose(float(v[0]), np.mean([m[k] for m in per_layer]), rtol=1e-6, err_msg=k)
    # context parallelism (zig-zag over 4 shards) with expert parallelism on one mesh
    mesh = S.make_mesh(expert=2, context=4)
    cp = S.forward(cfg, replicate_on(params, mesh), tokens, seg)
    np.testing.assert_allclose(host(cp), ref, atol=1e-5, rtol=0)


def test_train_step_on_a_mesh_equals_one_device():
    cfg = TINY_MIXED.replace(remat="full")
    mesh = S.make_mesh(data=2, expert=2, tensor=2)
    params = randomize(S.init_params(cfg, mesh, seed=3), seed=4)
    mlp = params["dense_layers"]["mlp"]
    assert mlp["w_gate"].sharding.spec[2] == "tensor" and mlp["w_down"].sharding.spec[1] == "tensor"
    assert params["layers"]["moe"]["w_down"].sharding.spec[1] == "expert"
    rng = np.random.RandomState(1)
    tokens = rng.randint(1, cfg.vocab_size, (4, 12)).astype(np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens, np.float32),
             "advantages": rng.normal(size=4).astype(np.float32),
             "rollout_logprobs": np.full(tokens.shape, -2.0, np.float32)}
    one = replicate_on(jax.tree.map(host, params), single_device_mesh())   # no buffer shared (donated below)
    before = {k: host(params[k]["attn"]["q_proj"]) for k in ("layers", "dense_layers")}
    before_mlp = host(mlp["w_down"])
    # Adam's eps 1e-6, not 1e-8: Adam moves every entry by about lr whatever its gradient's size, so
    # an entry whose gradient is at rounding level (the order of the sums decides it) moved by 6 %
    # of a step between the two meshes on one CPU model; with eps above that noise such an entry
    # stays put, and the worst difference is 7e-7
    ts = make_train_step(cfg, LossConfig(router_aux_coef=0.01), OptimizerConfig(learning_rate=1e-3, eps=1e-6))
    new, _, metrics = ts.step(params, ts.init_opt_state(params), batch)     # params donated
    new_one, _, metrics_one = ts.step(one, ts.init_opt_state(one), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(metrics_one["loss"]), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(new_one)):
        # as the dense-family test: 5e-5 is 5 % of one Adam step at lr 1e-3
        np.testing.assert_allclose(host(a), host(b), atol=5e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
    # both stacks train (each layer's attention, the dense MLP)
    for k in before:
        assert np.abs(host(new[k]["attn"]["q_proj"]) - before[k]).max(axis=(1, 2, 3)).min() > 1e-5, k
    assert np.abs(host(new["dense_layers"]["mlp"]["w_down"]) - before_mlp).max() > 1e-5
