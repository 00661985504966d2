"""The per-layer param layout (`ModelConfig.scan_layers=False`): one array per layer's weight, each
stack a list of per-layer dicts. The same model as the stacked layout: forward, gradients, the
engine's greedy tokens and log-probs (layers unrolled), MoE routes, LoRA views, shardings, and HF
save / load, for dense, MoE, mixed-stack and windowed/sink models."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.engine.model_step import extend
from sfrrl_jax.models import lora
from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.models.api import param_shardings

from model_fixtures import TINY, TINY_DENSE, TINY_GPT_OSS, TINY_MIXED, randomize, single_device_mesh

TOL = dict(rtol=1e-5, atol=1e-5)
CFGS = {"moe": TINY, "gpt_oss_sinks": TINY_GPT_OSS, "mixed_stack": TINY_MIXED}


def _per_layer(cfg):
    return dataclasses.replace(cfg, scan_layers=False)


def _both(cfg, mesh, seed=0):
    stacked = randomize(S.init_params(cfg, mesh, seed=seed), seed=seed)
    cfg_pl = _per_layer(cfg)
    return stacked, cfg_pl, jax.jit(lambda p: tfm.unstack_layers(cfg_pl, p),
                                    out_shardings=param_shardings(cfg_pl, mesh))(stacked)


def _close(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **(tol or TOL))


@pytest.mark.parametrize("name", ["moe", "gpt_oss_sinks", "mixed_stack"])
def test_per_layer_forward_and_gradients_equal_the_stacked_ones(name):
    cfg = CFGS[name]
    mesh = single_device_mesh()
    stacked, cfg_pl, per_layer = _both(cfg, mesh)
    assert isinstance(per_layer["layers"], list) and tfm.is_per_layer(per_layer)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), per_layer) == jax.tree.map(
        lambda s: (s.shape, s.dtype), tfm.param_shapes(cfg_pl))
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 11)), jnp.int32)
    _close(S.forward(cfg_pl, per_layer, tokens), S.forward(cfg, stacked, tokens))
    w = jax.random.normal(jax.random.key(2), (2, 11, cfg.vocab_size))

    def loss(c):
        return lambda p: jnp.sum(tfm.forward_with_aux(c, p, tokens)[0] * w)

    with jax.set_mesh(mesh):
        g_stacked = jax.jit(jax.grad(loss(cfg)))(stacked)
        g_pl = jax.jit(jax.grad(loss(cfg_pl)))(per_layer)
    assert isinstance(g_pl["layers"], list)
    _close(jax.jit(lambda g: tfm.unstack_layers(cfg_pl, g))(g_stacked), g_pl, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["mixed_stack"])   # MoE and dense layers, windows
def test_per_layer_engine_gives_the_stacked_engines_tokens_logprobs_and_routes(name):
    cfg = CFGS[name]
    mesh = single_device_mesh()
    stacked, cfg_pl, per_layer = _both(cfg, mesh, seed=3)
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 8, 1, 4, 6]]
    kw = dict(max_new_tokens=7, temperature=0.0)
    want = S.generate(cfg, stacked, prompts, **kw)
    got = S.generate(cfg_pl, per_layer, prompts, **kw)
    # a config saying per-layer over params loaded stacked (per-layer caches, stacked weights) runs
    # unrolled over the stack's rows: slower, the same numbers
    mixed = S.generate(cfg_pl, stacked, prompts, **kw)
    for g, m, w_ in zip(got, mixed, want):
        assert g.tokens == w_.tokens == m.tokens
        np.testing.assert_allclose(g.raw_logprobs, w_.raw_logprobs, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(m.raw_logprobs, w_.raw_logprobs, rtol=1e-4, atol=1e-4)
    if cfg.n_experts:   # the routes a decode step records (R3), stacked over the MoE layers either way
        tokens = jnp.asarray([[5, 9, 2, 7]], jnp.int32)
        shape = (cfg.n_layers, 1, 16, cfg.n_kv_heads, cfg.head_dim)
        cache = jnp.zeros(shape, jnp.float32)
        starts = jnp.zeros((1,), jnp.int32)
        with jax.set_mesh(mesh):
            r_want = jax.jit(lambda p: extend(cfg, p, tokens, starts, cache, cache, starts + 4, with_routes=True)[3])(
                stacked)
            r_got = jax.jit(lambda p: extend(cfg_pl, p, tokens, starts, cache, cache, starts + 4,
                                             with_routes=True)[3])(per_layer)
        assert r_got.shape == r_want.shape and np.array_equal(np.asarray(r_got), np.asarray(r_want))


def test_per_layer_params_shard_as_their_stacked_rows():
    mesh = S.make_mesh(data=2, expert=4)
    cfg_pl = _per_layer(TINY)
    params = S.init_params(cfg_pl, mesh, seed=0)
    stacked = S.init_params(TINY, mesh, seed=0)
    assert len(params["layers"]) == TINY.n_layers
    for row in range(TINY.n_layers):
        for (path, leaf), ref in zip(jax.tree.leaves_with_path(params["layers"][row]),
                                     jax.tree.leaves(stacked["layers"])):
            assert tuple(leaf.sharding.spec) == tuple(ref.sharding.spec)[1:len(leaf.shape) + 1], path
            np.testing.assert_allclose(np.asarray(leaf), np.asarray(ref[row]), **TOL)   # the same init draw


def test_lora_view_of_per_layer_params_equals_the_stacked_view():
    cfg = TINY_DENSE
    mesh = single_device_mesh()
    stacked, cfg_pl, per_layer = _both(cfg, mesh)
    lcfg = lora.LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "gate_proj"))
    adapter = lora.init_adapter(cfg, lcfg, mesh, seed=1)
    adapter = dataclasses.replace(adapter, weights=randomize(adapter.weights, seed=5))   # b != 0
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    want = S.forward(cfg, lora.AdaptedParams(stacked, adapter), tokens)
    got = S.forward(cfg_pl, per_layer, tokens, adapter=adapter)   # adapters stay stacked in either layout
    _close(got, want)
    merged = lora.merge_adapter(cfg_pl, per_layer, adapter)
    assert isinstance(merged["layers"], list)
    _close(S.forward(cfg_pl, merged, tokens), want)


def test_hf_save_of_per_layer_params_loads_back_in_either_layout(tmp_path):
    cfg = TINY_DENSE
    mesh = single_device_mesh()
    stacked, cfg_pl, per_layer = _both(cfg, mesh)
    S.save_hf(cfg_pl, per_layer, tmp_path / "hf")
    cfg_a, back_stacked = S.load_hf(tmp_path / "hf", mesh)
    cfg_b, back_pl = S.load_hf(tmp_path / "hf", mesh, scan_layers=False)
    assert cfg_a.scan_layers and not cfg_b.scan_layers and isinstance(back_pl["layers"], list)
    for a, b in zip(jax.tree.leaves(back_stacked), jax.tree.leaves(stacked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(back_pl), jax.tree.leaves(per_layer)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="scan_layers"):
        S.load_hf(tmp_path / "hf", mesh, scan_layers="no")


def _stacked_cache(c):
    return np.stack([np.asarray(x) for x in c]) if isinstance(c, list) else np.asarray(c)


@pytest.mark.parametrize("paging", [None, (4, 40)], ids=["dense", "paged"])
def test_per_layer_engine_steps_equal_the_stacked_ones(paging):
    """Every engine step on per-layer params (dense: a per-layer KV cache list) gives the stacked
    params' tokens, log-probs and cache: shared-prompt prefill (rows copied to the sharers), decode
    chunks, appends one by one and together."""
    from sfrrl_jax.engine import SlotRequest
    from sfrrl_jax.engine.paged import engine_steps

    cfg = TINY_MIXED.replace(max_seq_len=64)
    # dense: the per-layer caches split over two devices' slots and experts; paged: one device (its
    # pools are the stacked engine's, only the layers' loop differs)
    mesh = S.make_mesh(data=1, expert=2, devices=jax.devices()[:2]) if paging is None else single_device_mesh()
    stacked, cfg_pl, per_layer = _both(cfg, mesh, seed=4)
    prompts = [[5, 9, 1, 7, 3], [11, 4]]
    out = {}
    for name, c, p in (("stacked", cfg, stacked), ("per_layer", cfg_pl, per_layer)):
        steps = engine_steps(c, mesh, 4, 32, (8, 16), None, paging, False, (16, 32))
        state = steps.init_decode_state()
        if name == "per_layer" and paging is None:
            assert isinstance(state.cache_k, list) and len(state.cache_k) == cfg.n_layers
        reqs = [SlotRequest.make(temperature=1.0, seed=s, max_new=20) for s in range(4)]
        tokens = np.concatenate([steps.pad(q) for q in prompts])
        state, first = steps.prefill_many(p, state, [0, 1, 2, 3], tokens, [5, 2], reqs, sources=[0, 0, 1, 1])
        state, r1 = steps.generate(p, state, 3, 16)
        state, a1 = steps.append_prefill(p, state, 0, steps.pad([int(np.asarray(state.last_token)[0]), 12, 13]), 3,
                                         reqs[0])
        feeds = [[int(np.asarray(state.last_token)[s]), 7, 7, 2] for s in (1, 3)]
        state, a2 = steps.append_many(p, state, [1, 3], np.concatenate([steps.pad(f) for f in feeds]), [4, 4],
                                      [reqs[1], reqs[3]])
        state, r2 = steps.generate(p, state, 4, 16)   # every slot ends within 16 tokens: one decode compile
        out[name] = dict(tokens=[np.asarray(x.tokens) for x in (first, r1, a1, a2, r2)],
                         logprobs=[np.asarray(x.raw_logprobs) for x in (first, r1, a1, a2, r2)],
                         cache_k=_stacked_cache(state.cache_k), lengths=np.asarray(state.lengths))
    want, got = out["stacked"], out["per_layer"]
    for a, b in zip(got["tokens"], want["tokens"]):
        assert a.tolist() == b.tolist()
    for a, b in zip(got["logprobs"], want["logprobs"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert got["lengths"].tolist() == want["lengths"].tolist()
    np.testing.assert_allclose(got["cache_k"], want["cache_k"], rtol=1e-4, atol=1e-4)


def test_per_layer_params_and_moments_round_trip_through_a_checkpoint(tmp_path):
    """A trainer checkpoint (orbax) of per-layer params and their AdamW moments restores bit for bit
    into the per-layer layout's abstract state (the stacked one is a different tree, refused)."""
    from sfrrl_jax.checkpoints.orbax_store import Checkpointer, CheckpointMismatchError, abstract_of
    from sfrrl_jax.learner import OptimizerConfig, make_train_step
    from sfrrl_jax.rl import LossConfig

    mesh = S.make_mesh(data=2, expert=4)
    cfg_pl = _per_layer(TINY)
    params = randomize(S.init_params(cfg_pl, mesh, seed=0), seed=1)
    ts = make_train_step(cfg_pl, LossConfig(objective="sft", vocab_chunk=128, seq_chunk=8), OptimizerConfig())
    opt_state = jax.tree.map(lambda a: a + 0.5 if jnp.issubdtype(a.dtype, jnp.floating) else a,
                             ts.init_opt_state(params))
    state = {"params": params, "opt_state": opt_state}
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=1)
    assert ckpt.maybe_save(1, state, {"note": "per-layer"})
    ckpt.close()
    step, got, _ = Checkpointer(tmp_path / "ckpt", save_every=1).restore_latest(abstract_of(state))
    assert step == 1 and isinstance(got["params"]["layers"], list)
    assert jax.tree.structure(got) == jax.tree.structure(state)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    stacked = {"params": S.init_params(TINY, mesh, seed=0), "opt_state": opt_state}
    with pytest.raises((CheckpointMismatchError, ValueError)):
        Checkpointer(tmp_path / "ckpt", save_every=1).restore_latest(abstract_of(stacked))
