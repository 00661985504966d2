"""Rollout at engine speed (issue #44.2): a prompt several requests share is prefilled once.

A GRPO group's G samples start from one prompt; the engine admitted them together but ran the
prompt through the model G times (at 8 prompts x 8 samples on SmolLM2-135M, prefill was a third
of the rollout). `prefill_many(sources=...)` runs each distinct prompt once and hands its cache
rows and last logits to every slot that names it; each slot samples with its own request."""
import asyncio
import functools

import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.tasks.environments import calculator_environment
from sfrrl_jax.agents.loop import AgentConfig, run_many
from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
from sfrrl_jax.engine import Engine, SlotRequest
from sfrrl_jax.engine.pages import PageTable, check_paging
from sfrrl_jax.engine.paged import engine_steps
from sfrrl_jax.generation_types import GenerationRequest
from sfrrl_jax.tokenizer import load_tokenizer

from model_fixtures import TINY, host, randomize


@functools.lru_cache(maxsize=None)
def _setup(max_seq_len=64):
    cfg = TINY.replace(max_seq_len=max_seq_len)
    mesh = S.make_mesh(data=2, expert=4)
    return cfg, mesh, randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)


def _rows(state, slots, n):
    return host(state.cache_k)[:, slots, :n], host(state.cache_v)[:, slots, :n]


def test_shared_prompts_are_computed_once_and_each_slot_gets_its_rows_bit_for_bit():
    cfg, mesh, params = _setup()
    steps = engine_steps(cfg, mesh, 8, 32, (8, 16), None, None, False, None)
    prompts = [[5, 9, 1, 7, 3], [11, 4]]
    # slots 6, 1, 3 share prompt 0; slots 0, 4 prompt 1; every slot its own sampling settings
    slots, sources = [6, 0, 1, 3, 4], [0, 1, 0, 0, 1]
    reqs = [SlotRequest.make(temperature=1.0, seed=s, max_new=20) for s in (3, 8, 5, 1, 7)]
    reqs[2] = SlotRequest.make(temperature=0.0, max_new=20)
    tokens = np.concatenate([steps.pad(p) for p in prompts])
    shared = steps.init_decode_state()
    shared, first = steps.prefill_many(params, shared, slots, tokens, [5, 2], reqs, sources=sources)
    assert host(first.tokens).shape == (8,)  # slots padded to many_rows(5) = 8
    with pytest.raises(ValueError, match="sources must name each of the 2 prompt rows"):
        steps.prefill_many(params, steps.init_decode_state(), [0, 1], tokens, [5, 2], reqs[:2], sources=[0, 0])

    # Reference: the same two prompt rows without sharing (one call per pair of slots, the same
    # [2, 8] forward), each slot with its own request.
    ref, want = steps.init_decode_state(), {}
    for pair in ((6, 0), (1, 4)):
        i, j = slots.index(pair[0]), slots.index(pair[1])
        ref, f = steps.prefill_many(params, ref, list(pair), tokens, [5, 2], [reqs[i], reqs[j]])
        want[pair[0]], want[pair[1]] = (jax_row(f, 0), jax_row(f, 1))
    # cache rows: bit for bit those of the unshared [2, 8] call; sharers identical to each other
    for got, exp in zip(_rows(shared, [6, 1, 0, 4], 8), _rows(ref, [6, 1, 0, 4], 8)):
        assert np.array_equal(got, exp)
    k = host(shared.cache_k)
    assert np.array_equal(k[:, 6, :8], k[:, 1, :8]) and np.array_equal(k[:, 6, :8], k[:, 3, :8])
    got = {s: jax_row(first, i) for i, s in enumerate(slots)}
    for s in (6, 0, 1, 4):
        assert got[s]["tokens"] == want[s]["tokens"] and got[s]["done"] == want[s]["done"]
        np.testing.assert_allclose(got[s]["raw_logprobs"], want[s]["raw_logprobs"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got[s]["logprobs"], want[s]["logprobs"], rtol=0, atol=1e-6)
    assert host(shared.lengths)[[6, 0, 1, 3, 4]].tolist() == [5, 2, 5, 5, 2]
    assert host(shared.active)[[6, 0, 1, 3, 4]].all() and not host(shared.active)[[2, 5, 7]].any()
    assert host(shared.last_token)[slots].tolist() == [got[s]["tokens"] for s in slots]
    assert host(shared.request.sampling.seed)[slots].tolist() == [3, 8, 0, 1, 7]


def jax_row(first, i) -> dict:
    return {k: (None if v is None else host(v)[i].item()) for k, v in
            (("tokens", first.tokens), ("logprobs", first.logprobs), ("raw_logprobs", first.raw_logprobs),
             ("done", first.done))}


def test_paged_cache_takes_shared_prefills_as_the_dense_one():
    cfg, mesh, params = _setup()
    dense = engine_steps(cfg, mesh, 4, 32, (8, 16), None, None, False, (16,))
    paging = check_paging(4, 24, 32, 4, cfg.layer_windows, 3)
    paged = engine_steps(cfg, mesh, 4, 32, (8, 16), None, paging, False, (16,))
    prompt, slots = [8, 8, 2, 6, 1, 9, 10], [2, 0, 3]
    reqs = [SlotRequest.make(temperature=1.0, seed=s, max_new=20) for s in (1, 2, 3)]
    tokens = dense.pad(prompt)
    d, first = dense.prefill_many(params, dense.init_decode_state(), slots, tokens, [7], reqs, sources=[0, 0, 0])
    pt = PageTable(4, 32, *paging)
    assert all(pt.ensure(s, len(prompt) + 6, start=len(prompt)) for s in slots)
    p = paged.init_decode_state()
    p.page_table = paged.upload_table(pt.snapshot()[1])
    p, pfirst = paged.prefill_many(params, p, slots, tokens, [7], reqs, sources=[0, 0, 0])
    assert host(pfirst.tokens).tolist() == host(first.tokens).tolist()
    for _ in range(2):   # decode on: the same tokens from the same caches
        d, dr = dense.generate(params, d, 3, 16)
        p, pr = paged.generate(params, p, 3, 16)
        assert host(dr.tokens).tolist() == host(pr.tokens).tolist()
        assert host(dr.raw_logprobs).tolist() == host(pr.raw_logprobs).tolist()


def _complete_all(engine, requests):
    async def main():
        async def one(r):
            c = await engine.complete(r)
            await engine.release(c.slot_handle)
            return c
        return await asyncio.gather(*(one(r) for r in requests))
    return asyncio.run(main())


def test_engine_prefills_a_groups_shared_prompt_once_with_the_completions_of_one_at_a_time():
    """3 prompts x 4 samples arriving together: one prefill call computing 3 rows; each sample's
    completion is the one it gets when sent alone (up to float rounding of batched matmuls)."""
    cfg, mesh, params = _setup()
    prompts = [[3, 4, 5], [9, 9, 2, 1], [1, 2, 3, 4, 5, 6]]
    requests = [GenerationRequest(tokens=list(p), max_new_tokens=10, temperature=1.0, seed=10 * i + s)
                for i, p in enumerate(prompts) for s in range(4)]
    engine = Engine(cfg, params, max_slots=16, max_len=48, buckets=(8, 16), decode_steps=3)
    got = _complete_all(engine, requests)
    assert (engine.stats.prefills, engine.stats.prefill_calls, engine.stats.prefill_rows) == (12, 1, 3)
    # 3 + 4 + 6 prompt tokens computed once; the other 3 samples of each prompt were served them
    assert (engine.stats.prefill_tokens, engine.stats.prefix_hit_tokens) == (13, 39)
    assert engine.stats.prefix_hit_rate == 39 / 52
    assert engine.steps.compile_counts()["prefill_many"] == 1   # [4 prompt rows, 16 slots, 8 tokens]
    alone = Engine(cfg, params, max_slots=16, max_len=48, buckets=(8, 16), decode_steps=3)
    want = [_complete_all(alone, [r])[0] for r in requests]
    assert (alone.stats.prefills, alone.stats.prefill_calls, alone.stats.prefill_rows) == (12, 12, 12)
    assert (alone.stats.prefill_tokens, alone.stats.prefix_hit_tokens, alone.stats.prefix_hit_rate) == (52, 0, 0.0)
    # share_prompts=False (the bench's baseline): one call still, every sample's prompt computed
    apart = Engine(cfg, params, max_slots=16, max_len=48, buckets=(8, 16), decode_steps=3, share_prompts=False)
    got_apart = _complete_all(apart, requests)
    assert (apart.stats.prefills, apart.stats.prefill_calls, apart.stats.prefill_rows) == (12, 1, 12)
    assert (apart.stats.prefill_tokens, apart.stats.prefix_hit_tokens) == (52, 0)
    with pytest.raises(ValueError, match="share_prompts"):
        Engine(cfg, params, max_slots=2, max_len=48, share_prompts="yes")
    engine.release_memory()
    alone.release_memory()
    apart.release_memory()
    for g, w in zip(got_apart, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-5)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-5)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    # the four samples of a prompt drew four different continuations
    assert len({tuple(g.tokens) for g in got[:4]}) > 1


def test_agent_loop_groups_reach_the_engine_as_one_prefill_of_their_distinct_prompts(tok_dir):
    """run_many over 3 tasks x 4 samples with the real engine: every sample's first request is
    admitted together, in one prefill call of 3 rows (the tasks' distinct prompts)."""
    cfg, mesh, params = _setup(256)
    tok = load_tokenizer(tok_dir)
    engine = Engine(cfg, params, max_slots=12, max_len=256, decode_steps=4)
    env = calculator_environment()
    tasks = [arithmetic_task(e, f"t{i}") for i, e in enumerate(["1 + 2", "30 - 4", "6 * 7"])]
    agent = AgentConfig(max_turns=1, max_new_tokens_per_turn=6, max_total_tokens=256, temperature=1.0,
                        tool_format="compact")
    trajs = asyncio.run(run_many(engine, env, tasks, tok, agent, samples_per_task=4))
    assert len(trajs) == 12 and all(t.error is None for t in trajs)
    assert (engine.stats.prefills, engine.stats.prefill_calls, engine.stats.prefill_rows) == (12, 1, 3)
    prompt_tokens = sum(len(t.tokens) - sum(t.loss_mask) for t in trajs[::4])   # one-turn: the prompt, then generated
    assert engine.stats.prefill_tokens == prompt_tokens and engine.stats.prefix_hit_tokens == 3 * prompt_tokens
    assert engine.occupancy == {"running": 0, "parked": 0, "free": 12, "queued": 0}
    engine.release_memory()
