"""Decode speed without changing results (issue #23): new prompts of one bucket admitted by one
`prefill_many` call, decode chunks that read only the cache's live part (`decode_buckets`), an
all-greedy batch that skips the random draws, and an argmax from two plain reductions."""
import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.engine import Engine, SlotRequest
from sfrrl_jax.engine.pages import PageTable, check_paging
from sfrrl_jax.engine.paged import engine_steps
from sfrrl_jax.engine.sampling import SamplingParams, first_argmax, sample
from sfrrl_jax.generation_types import GenerationRequest

from model_fixtures import TINY, TINY_GPT_OSS, host, randomize


@functools.lru_cache(maxsize=None)
def _setup(kind="gpt_oss"):
    # GPT-OSS-like (sinks, a sliding-window layer next to a full one) or the Qwen3-like MoE
    cfg = (TINY_GPT_OSS if kind == "gpt_oss" else TINY).replace(max_seq_len=64)
    mesh = S.make_mesh(data=2, expert=4)
    return cfg, mesh, randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)


def _state_rows(state, slots, n):
    """cache rows [layers, slots, :n] of a dense state, on the host."""
    return host(state.cache_k)[:, slots, :n], host(state.cache_v)[:, slots, :n]


def test_prefill_many_equals_one_prefill_per_prompt_and_paged_equals_dense_exactly():
    cfg, mesh, params = _setup()
    dense = engine_steps(cfg, mesh, 4, 32, (8, 16), None, None, False, (16,))
    assert dense.decode_buckets == (16, 32)
    paging = check_paging(4, 24, 32, 4, cfg.layer_windows, 3)
    paged = engine_steps(cfg, mesh, 4, 32, (8, 16), None, paging, False, (16,))
    prompts = {2: [5, 9, 1, 7, 3], 0: [11, 4], 3: [8, 8, 2, 6, 1, 9, 10]}  # slot -> prompt, one bucket (8)
    reqs = [SlotRequest.make(temperature=0.0, max_new=20), SlotRequest.make(temperature=1.0, seed=4, max_new=20),
            SlotRequest.make(temperature=0.7, top_k=5, seed=9, max_new=20)]
    slots = list(prompts)
    assert dense.many_rows(3) == 4 and dense.many_rows(1) == 1
    with pytest.raises(ValueError, match="between 1 and max_slots=4"):
        dense.many_rows(5)

    # reference: one prefill + insert per prompt
    one = dense.init_decode_state()
    want = []
    for slot, req in zip(slots, reqs):
        prefix, first = dense.prefill(params, dense.pad(prompts[slot]), len(prompts[slot]), req)
        one = dense.insert(prefix, one, slot, req, first)
        want.append(first)
    many = dense.init_decode_state()
    tokens = np.concatenate([dense.pad(prompts[s]) for s in slots])
    many, first = dense.prefill_many(params, many, slots, tokens, [len(prompts[s]) for s in slots], reqs)
    assert host(first.tokens).shape == (4,)  # padded to 4 rows with copies of the first
    assert host(first.tokens)[:3].tolist() == [int(f.tokens) for f in want]
    np.testing.assert_allclose(host(first.raw_logprobs)[:3], [float(f.raw_logprobs) for f in want], atol=1e-5)
    np.testing.assert_allclose(host(first.logprobs)[:3], [float(f.logprobs) for f in want], atol=1e-5)
    for got, ref in zip(_state_rows(many, slots, 8), _state_rows(one, slots, 8)):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    for field in ("lengths", "last_token", "generated", "draws", "active"):
        assert host(getattr(many, field)).tolist() == host(getattr(one, field)).tolist(), field
    assert host(many.request.sampling.temperature).tolist() == pytest.approx([1.0, 0, 0, 0.7])
    assert not host(many.active)[1]  # the slot nobody was admitted to stays free

    # the paged steps: the same prefill_many and decode chunks, bit for bit
    pt = PageTable(4, 32, *paging)
    assert all(pt.ensure(s, len(prompts[s]) + 3, start=len(prompts[s])) for s in slots)
    pstate = paged.init_decode_state()
    pstate.page_table = paged.upload_table(pt.snapshot()[1])
    pstate, pfirst = paged.prefill_many(params, pstate, slots, tokens, [len(prompts[s]) for s in slots], reqs)
    assert host(pfirst.tokens).tolist() == host(first.tokens).tolist()
    assert host(pfirst.raw_logprobs).tolist() == host(first.raw_logprobs).tolist()
    for _ in range(5):
        lengths, active = host(pstate.lengths), host(pstate.active)
        k_len = dense.decode_k_len(int(lengths[active].max()) + 3)
        assert pt.ensure_many({s: (int(lengths[s]) + 3, int(lengths[s])) for s in np.nonzero(active)[0]})
        pstate.page_table = paged.upload_table(pt.snapshot()[1])
        many, res = dense.generate(params, many, 3, k_len)
        pstate, pres = paged.generate(params, pstate, 3, k_len)
        for field in ("tokens", "raw_logprobs", "logprobs", "valid", "done"):
            assert host(getattr(res, field)).tolist() == host(getattr(pres, field)).tolist(), field
    assert dense.compile_counts()["generate"] == 2  # both buckets ran: lengths went from 7 to 22
    with pytest.raises(ValueError, match=r"k_len=12 is not one of the engine's decode_buckets \(16, 32\)"):
        dense.generate(params, many, 1, 12)


def test_a_short_decode_bucket_gives_the_whole_cache_results():
    """Reading only positions < k_len drops only entries the mask gives weight exactly 0: the
    same tokens, log-probs equal up to the rounding of a shorter reduction."""
    cfg, mesh, params = _setup()
    steps = engine_steps(cfg, mesh, 4, 32, (8, 16), None, None, False, (16,))
    req = SlotRequest.make(temperature=1.0, seed=3, max_new=20)
    states = []
    for _ in range(2):
        state = steps.init_decode_state()
        for slot, prompt in enumerate(([3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2])):
            prefix, first = steps.prefill(params, steps.pad(prompt), len(prompt), req)
            state = steps.insert(prefix, state, slot, req, first)
        states.append(state)
    short, full = states
    for _ in range(3):  # lengths up to 6 + 9 = 15 < 16
        short, a = steps.generate(params, short, 3, 16)
        full, b = steps.generate(params, full, 3, 32)
        assert host(a.tokens).tolist() == host(b.tokens).tolist()
        np.testing.assert_allclose(host(a.raw_logprobs), host(b.raw_logprobs), atol=1e-5)
        np.testing.assert_allclose(host(a.logprobs), host(b.logprobs), atol=1e-5)
    np.testing.assert_allclose(host(short.cache_k), host(full.cache_k), atol=1e-5)


def test_decode_buckets_are_checked_by_name():
    cfg, mesh, _ = _setup()
    with pytest.raises(ValueError, match=r"decode_buckets\[1\] must be in \[1, 32\], got 40"):
        engine_steps(cfg, mesh, 4, 32, None, None, None, False, (16, 40))
    with pytest.raises(ValueError, match=r"decode_buckets\[0\] must be in \[1, 32\], got 0"):
        engine_steps(cfg, mesh, 4, 32, None, None, None, False, (0,))
    big = engine_steps(cfg.replace(max_seq_len=2048), mesh, 2, 2048)
    assert big.decode_buckets == (256, 512, 1024, 2048)  # max_len / 8 ... max_len
    assert big.decode_k_len(300) == 512 and big.decode_k_len(2048) == 2048 and big.decode_k_len(5) == 256
    assert engine_steps(cfg, mesh, 4, 64, None).decode_buckets == (64,)  # none below 128


def _run(engine, prompts, n, together=True, **kw):
    async def one(i, p):
        c = await engine.complete(GenerationRequest(tokens=p, max_new_tokens=n, seed=i, **kw))
        await engine.release(c.slot_handle)
        return c

    async def main():
        if together:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return [await one(i, p) for i, p in enumerate(prompts)]
    return asyncio.run(main())


def test_engine_admits_a_burst_in_one_prefill_call_and_decodes_in_buckets():
    """Six prompts arriving together: one prefill_many call for the five of one bucket, one of a
    single row for the longer one; decode crosses the 16-token bucket. The completions (and, for
    the MoE, the routes of every fed token) equal those of the same prompts sent one at a time."""
    cfg, mesh, params = _setup("qwen3")
    prompts = [[3, 4, 5], [9, 9], [1, 2, 3, 4, 5, 6], [7], [8, 6, 4, 2], list(range(1, 12))]
    engine = Engine(cfg, params, max_slots=8, max_len=48, buckets=(8, 16), decode_steps=3,
                    decode_buckets=(16, 24), record_routes=True, max_consecutive_faults=0)
    got = _run(engine, prompts, 12, temperature=1.0)
    counts = engine.steps.compile_counts()
    # [8 rows, 8 tokens] and [1 row, 16 tokens]; no per-prompt prefill + insert
    assert counts["prefill_many"] == 2 and counts["prefill"] == counts["insert"] == 0
    assert counts["generate"] == 2 and engine.stats.prefills == 6
    want = _run(engine, prompts, 12, together=False, temperature=1.0)
    assert engine.steps.compile_counts()["prefill_many"] == 3  # [1 row, 8 tokens] too; generate as before
    engine.release_memory()
    for g, w, p in zip(got, want, prompts):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-5)
        assert g.routes.shape == (len(p) + 11, 2, cfg.top_k)  # the prompt and 11 fed samples
        assert np.mean(g.routes == w.routes) > 0.98  # a float near-tie may flip a choice


def test_greedy_rows_and_argmax_whatever_the_neighbours_sample():
    logits = jax.random.normal(jax.random.key(1), (4, 64)) * 2.0
    logits = logits.at[0, 10].set(9.0).at[0, 20].set(9.0)  # a tie: the first index wins
    assert host(first_argmax(logits)).tolist() == host(jnp.argmax(logits, -1)).tolist()
    assert int(first_argmax(logits)[0]) == 10
    greedy = SamplingParams(temperature=jnp.zeros(4), top_k=jnp.zeros(4, jnp.int32), top_p=jnp.ones(4),
                            seed=jnp.arange(4, dtype=jnp.uint32))
    mixed = SamplingParams(jnp.array([0.0, 1.0, 0.0, 0.5]), greedy.top_k, greedy.top_p, greedy.seed)
    fn = jax.jit(sample)
    a, b = fn(logits, greedy, jnp.zeros(4, jnp.int32)), fn(logits, mixed, jnp.zeros(4, jnp.int32))
    assert host(a[0]).tolist() == host(jnp.argmax(logits, -1)).tolist()   # no draw made at all
    for x, y in zip(a, b):  # the greedy rows do not change when neighbours sample
        assert host(x)[[0, 2]].tolist() == host(y)[[0, 2]].tolist()

