"""Appends admitted together share one device call (issue #44.2): `append_many` runs the
observations of several parked slots at once, each against its own slot's cache, as
`append_prefill` runs one; the driver sends an admission's appends of one bucket through it."""
import asyncio
import functools

import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.engine import Engine, SlotRequest
from sfrrl_jax.engine.pages import PageTable, check_paging
from sfrrl_jax.engine.paged import engine_steps
from sfrrl_jax.generation_types import GenerationRequest

from model_fixtures import TINY, host, randomize

PROMPTS = [[5, 9, 1, 7, 3], [11, 4], [8, 8, 2, 6, 1, 9, 10], [3, 3, 4]]
APPENDS = {3: [12, 13, 2, 7, 9, 30, 1], 0: [4, 4], 2: [17, 1, 1, 5, 6]}   # slot -> observation, bucket 8


@functools.lru_cache(maxsize=None)
def _setup():
    cfg = TINY.replace(max_seq_len=64)
    mesh = S.make_mesh(data=2, expert=4)
    return cfg, mesh, randomize(S.init_params(cfg, mesh, seed=0), seed=6, scale=0.3)


def _parked(steps, params, state):
    """Four slots prefilled, two decode steps, as parked slots are before an append."""
    reqs = [SlotRequest.make(temperature=1.0, seed=s, max_new=2) for s in range(4)]
    state, _ = steps.prefill_many(params, state, [0, 1, 2, 3], np.concatenate([steps.pad(p) for p in PROMPTS]),
                                  [len(p) for p in PROMPTS], reqs)
    state, _ = steps.generate(params, state, 2, 16)
    return state


def _feed(state, slot, tokens):
    """An append feeds the slot's pending (last sampled) token, then the observation."""
    return [int(host(state.last_token)[slot])] + tokens


def test_append_many_equals_one_append_per_slot_and_its_padding_row_writes_nothing():
    cfg, mesh, params = _setup()
    steps = engine_steps(cfg, mesh, 4, 32, (8, 16), None, None, False, (16,))
    reqs = {s: SlotRequest.make(temperature=1.0, seed=20 + s, max_new=6) for s in APPENDS}
    base = _parked(steps, params, steps.init_decode_state())
    feeds = {s: _feed(base, s, t) for s, t in APPENDS.items()}
    before = {f: host(getattr(base, f)) for f in ("lengths", "last_token", "generated", "draws", "active")}
    k0, v0 = host(base.cache_k), host(base.cache_v)

    one = base
    want = {}
    for s, feed in feeds.items():
        one, f = steps.append_prefill(params, one, s, steps.pad(feed), len(feed), reqs[s])
        want[s] = {k: host(getattr(f, k)).item() for k in ("tokens", "logprobs", "raw_logprobs", "done")}
    many = _parked(steps, params, steps.init_decode_state())
    slots = list(feeds)
    many, first = steps.append_many(params, many, slots, np.concatenate([steps.pad(feeds[s]) for s in slots]),
                                    [len(feeds[s]) for s in slots], [reqs[s] for s in slots])
    assert host(first.valid).tolist() == [True, True, True, False]   # 3 rows padded to 4
    for i, s in enumerate(slots):
        assert host(first.tokens)[i] == want[s]["tokens"] and bool(host(first.done)[i]) == want[s]["done"]
        np.testing.assert_allclose(host(first.raw_logprobs)[i], want[s]["raw_logprobs"], atol=1e-5)
        np.testing.assert_allclose(host(first.logprobs)[i], want[s]["logprobs"], atol=1e-5)
    for got, ref in ((many.cache_k, one.cache_k), (many.cache_v, one.cache_v)):
        np.testing.assert_allclose(host(got), host(ref), atol=1e-5)
    for f in ("lengths", "last_token", "generated", "draws", "active"):
        assert host(getattr(many, f)).tolist() == host(getattr(one, f)).tolist(), f
    # slot 1 took no append: its cache and state are as they were (the padding row repeats
    # slot 3's reads but writes nothing)
    assert np.array_equal(host(many.cache_k)[:, 1], k0[:, 1]) and np.array_equal(host(many.cache_v)[:, 1], v0[:, 1])
    assert all(host(getattr(many, f))[1] == before[f][1] for f in before)
    assert host(many.lengths)[slots].tolist() == [before["lengths"][s] + len(feeds[s]) for s in slots]
    # the decode after it: the same tokens
    one, r1 = steps.generate(params, one, 3, 32)
    many, r2 = steps.generate(params, many, 3, 32)
    assert host(r1.tokens).tolist() == host(r2.tokens).tolist()
    with pytest.raises(ValueError, match="distinct slots"):
        steps.append_many(params, many, [0, 0], np.concatenate([steps.pad([1]), steps.pad([2])]), [1, 1],
                          [reqs[0], reqs[0]])


def test_paged_append_many_equals_the_dense_one_bit_for_bit():
    cfg, mesh, params = _setup()
    dense = engine_steps(cfg, mesh, 4, 32, (8, 16), None, None, False, (16,))
    paging = check_paging(4, 24, 32, 4, cfg.layer_windows, 3)
    paged = engine_steps(cfg, mesh, 4, 32, (8, 16), None, paging, False, (16,))
    reqs = [SlotRequest.make(temperature=1.0, seed=20 + s, max_new=6) for s in APPENDS]
    d = _parked(dense, params, dense.init_decode_state())
    pt = PageTable(4, 32, *paging)
    assert all(pt.ensure(s, 24, start=len(p)) for s, p in enumerate(PROMPTS))
    p = paged.init_decode_state()
    p.page_table = paged.upload_table(pt.snapshot()[1])
    p = _parked(paged, params, p)
    slots = list(APPENDS)
    feeds = [_feed(d, s, APPENDS[s]) for s in slots]
    assert feeds == [_feed(p, s, APPENDS[s]) for s in slots]
    tokens = np.concatenate([dense.pad(f) for f in feeds])
    d, fd = dense.append_many(params, d, slots, tokens, [len(f) for f in feeds], reqs)
    p, fp = paged.append_many(params, p, slots, tokens, [len(f) for f in feeds], reqs)
    assert host(fd.tokens).tolist()[:3] == host(fp.tokens).tolist()[:3]
    assert host(fd.raw_logprobs).tolist()[:3] == host(fp.raw_logprobs).tolist()[:3]
    d, rd = dense.generate(params, d, 3, 32)
    p, rp = paged.generate(params, p, 3, 32)
    assert host(rd.tokens).tolist() == host(rp.tokens).tolist()
    assert host(rd.raw_logprobs).tolist() == host(rp.raw_logprobs).tolist()


def test_engine_sends_appends_admitted_together_through_one_call():
    """Four trajectories whose first turns end in the same decode chunk append their observations
    together: one append call for the three of one bucket, one for the longer one; every turn's
    completion equals that of the same trajectory run alone."""
    cfg, _, params = _setup()
    observations = [[7, 7, 1], [2, 9], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39], [4]]

    async def trajectory(engine, i):
        first = await engine.complete(GenerationRequest(tokens=PROMPTS[i], max_new_tokens=3, temperature=1.0,
                                                        seed=i))
        second = await engine.complete(GenerationRequest(tokens=observations[i], max_new_tokens=4,
                                                         temperature=1.0, seed=10 + i,
                                                         slot_handle=first.slot_handle))
        await engine.release(second.slot_handle)
        return first, second

    def run(indices):
        # a configuration of its own: the compile counts below are its steps' alone
        engine = Engine(cfg, params, max_slots=4, max_len=40, buckets=(8, 16), decode_steps=3)

        async def main():
            return await asyncio.gather(*(trajectory(engine, i) for i in indices))
        out = asyncio.run(main())
        engine.release_memory()
        return engine, out

    engine, together = run(range(4))
    assert (engine.stats.appends, engine.stats.append_calls) == (4, 2)
    # cache-filling tokens: every prompt (computed, or served from a sample sharing it) and every
    # append's feed (the slot's pending sampled token, then the observation)
    assert engine.stats.prefill_tokens + engine.stats.prefix_hit_tokens == (
        sum(len(PROMPTS[i]) for i in range(4)) + sum(len(o) + 1 for o in observations))
    assert engine.steps.compile_counts()["append_many"] == 1 and engine.steps.compile_counts()["append"] == 1
    for i in range(4):
        _, ((first, second),) = run([i])
        assert (together[i][0].tokens, together[i][1].tokens) == (first.tokens, second.tokens)
        np.testing.assert_allclose(together[i][1].raw_logprobs, second.raw_logprobs, atol=1e-5)
