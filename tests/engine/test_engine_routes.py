"""Routing replay (R3) from the engine: the experts every fed token used, per Completion, equal the
training forward's (`forward_hidden(..., return_routes=True)`) on the same token sequence."""
import asyncio
import functools

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.protocols import GenerationRequest
from sfrrl_jax.engine import Engine, EngineSteps
from sfrrl_jax.engine.model_step import extend
from sfrrl_jax.generation_types import Completion
from sfrrl_jax.models.transformer import forward_hidden, moe_layer_ids

from model_fixtures import TINY, TINY_DENSE, TINY_MIXED, randomize

PROMPT = [5, 17, 300, 42, 7, 99, 260]
OBSERVATION = [9, 9, 411, 3]


@functools.lru_cache(maxsize=None)
def _setup(name):
    cfg = {"qwen3": TINY, "mixed": TINY_MIXED}[name].replace(max_seq_len=64)
    mesh = S.make_mesh(data=2, expert=4)
    return cfg, mesh, randomize(S.init_params(cfg, mesh, seed=0), seed=3, scale=0.3)


def _full_routes(cfg, mesh, params, seq):
    """The training forward's experts for `seq` [n]: [n, moe layers, top_k] (one padded shape)."""
    padded = np.zeros((1, 48), np.int32)
    padded[0, :len(seq)] = seq
    with jax.set_mesh(mesh):
        _, _, used = jax.jit(functools.partial(forward_hidden, cfg, return_routes=True))(params, padded)
    return np.asarray(used)[0, :len(seq)]  # causal: the padding after the end changes nothing


def _two_turns(engine, n1=9, n2=6):
    async def main():
        c1 = await engine.complete(GenerationRequest(tokens=PROMPT, max_new_tokens=n1, temperature=0.0))
        c2 = await engine.complete(GenerationRequest(tokens=OBSERVATION, max_new_tokens=n2, temperature=0.0,
                                                     slot_handle=c1.slot_handle))
        await engine.release(c2.slot_handle)
        return c1, c2
    return asyncio.run(main())


@pytest.mark.parametrize("paged", [False, True])
def test_completion_routes_equal_the_full_forward_over_two_turns(paged):
    cfg, mesh, params = _setup("qwen3")
    kw = dict(page_size=8, num_pages=16) if paged else {}
    engine = Engine(cfg, params, max_slots=2, max_len=48, buckets=(16,), decode_steps=2,
                    max_consecutive_faults=0, record_routes=True, **kw)
    c1, c2 = _two_turns(engine)
    layers, k = len(moe_layer_ids(cfg)), cfg.top_k
    # turn 1 fed the prompt, then each generated token but the last
    assert c1.routes.shape == (len(PROMPT) + len(c1.tokens) - 1, layers, k)
    assert c1.routes.dtype == np.int16  # 8 experts: int16 ids (see model_step.routes_dtype)
    # turn 2 fed turn 1's last token (pending in the slot), the observation, then tokens[:-1]
    assert c2.routes.shape == (1 + len(OBSERVATION) + len(c2.tokens) - 1, layers, k)
    seq = PROMPT + c1.tokens + OBSERVATION + c2.tokens
    full = _full_routes(cfg, mesh, params, seq[:-1])
    # fp32, the same layer code: the cache's attention gives the routers the same choices
    np.testing.assert_array_equal(c1.routes, full[:len(c1.routes)])
    np.testing.assert_array_equal(c2.routes, full[len(c1.routes):])
    assert len(c1.routes) + len(c2.routes) == len(seq) - 1  # the whole trajectory but its last token
    assert (full >= 0).all() and (full < cfg.n_experts).all() and len(np.unique(full)) == cfg.n_experts


def test_extend_routes_skip_dense_layers_and_change_nothing_else():
    """A mixed stack (layer 1 dense): routes hold the MoE layers 0 and 2 only, in model order;
    logits and cache are the same values with and without recording."""
    cfg, mesh, params = _setup("mixed")
    seq = PROMPT + OBSERVATION
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :len(seq)] = seq
    cache = np.zeros((cfg.n_layers, 1, 16, cfg.n_kv_heads, cfg.head_dim), np.float32)
    args = (params, tokens, np.zeros((1,), np.int32), cache, cache, np.full((1,), len(seq), np.int32))
    with jax.set_mesh(mesh):
        on = jax.jit(functools.partial(extend, cfg, with_routes=True))(*args)
        off = jax.jit(functools.partial(extend, cfg))(*args)
    assert len(off) == 3 and on[3].shape == (1, 16, 2, cfg.top_k) and on[3].dtype == np.int16
    for a, b in zip(on[:3], off):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(on[3])[0, :len(seq)], _full_routes(cfg, mesh, params, seq))


def test_recording_off_leaves_routes_none_and_bad_settings_are_refused():
    cfg, mesh, params = _setup("qwen3")
    engine = Engine(cfg, params, max_slots=2, max_len=48, buckets=(16,), decode_steps=2)
    c1, c2 = _two_turns(engine, 3, 2)
    assert c1.routes is None and c2.routes is None and engine.steps.record_routes is False
    with pytest.raises(ValueError, match="record_routes=True needs max_consecutive_faults=0"):
        Engine(cfg, params, max_slots=2, max_len=48, record_routes=True)
    with pytest.raises(ValueError, match="record_routes=True: this model has no MoE layer"):
        EngineSteps(TINY_DENSE, mesh, max_slots=2, max_len=48, record_routes=True)
    with pytest.raises(ValueError, match="Completion.routes"):
        Completion(tokens=[1, 2], logprobs=[0.0, 0.0], finish_reason="stop", routes=np.zeros((1, 2, 2), np.int16))


def test_routes_survive_paged_eviction_and_preemption():
    """A pool too small for the batch: parked trajectories are evicted and running requests
    preempted, both restored by recompute. The routes of every trajectory still cover each fed
    token exactly once (a restore records nothing: its tokens' routes were recorded when first
    fed) and are the training forward's choices (fp32; rare near-ties aside)."""
    cfg, mesh, params = _setup("qwen3")
    engine = Engine(cfg, params, max_slots=4, max_len=48, buckets=(16,), decode_steps=2, page_size=4,
                    num_pages=14, max_consecutive_faults=0, record_routes=True)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, cfg.vocab_size, 10)) for _ in range(6)]

    async def trajectory(i, prompt):
        c1 = await engine.complete(GenerationRequest(tokens=prompt, max_new_tokens=18, temperature=0.0))
        await asyncio.sleep(0.002 * (i % 3))  # a tool call: the slot stays parked
        c2 = await engine.complete(GenerationRequest(tokens=OBSERVATION, max_new_tokens=4, temperature=0.0,
                                                     slot_handle=c1.slot_handle))
        await engine.release(c2.slot_handle)
        return prompt + c1.tokens + OBSERVATION + c2.tokens, np.concatenate([c1.routes, c2.routes])

    async def main():
        return await asyncio.gather(*(trajectory(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    assert engine.stats.evictions > 0 and engine.stats.preemptions > 0, engine.stats
    same = []
    for seq, routes in results:
        assert routes.shape == (len(seq) - 1, len(moe_layer_ids(cfg)), cfg.top_k)
        same.append(np.mean(routes == _full_routes(cfg, mesh, params, seq[:-1])))
    print("route agreement with the training forward per trajectory:", np.round(same, 4))
    assert min(same) > 0.98, same
