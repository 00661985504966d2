"""A prompt's pages computed and held once (issue #47): a GRPO group's samples share their prompt's
full pages (reference-counted, each slot's partly filled last page its own), and with
`Engine(prefix_cache_pages=n)` a later request, or a restored trajectory, maps the cached pages of
its leading tokens and computes only the rest."""
import asyncio
import functools

import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.engine import Engine
from sfrrl_jax.engine.pages import PageAllocator, PageTable, PagesExhausted
from sfrrl_jax.engine.prefix_cache import PrefixCache, page_keys
from sfrrl_jax.generation_types import GenerationRequest
from sfrrl_jax.testing.faults import FlakyEngineSteps

from model_fixtures import TINY, TINY_DEEPSEEK, TINY_GPT_OSS, host, randomize, teacher_forced_logprobs
from test_shared_prefill import _complete_all as _complete

ENGINE = dict(max_slots=8, max_len=48, buckets=(8, 16, 32), decode_steps=3)


@functools.lru_cache(maxsize=None)
def _params(cfg):
    cfg = cfg.replace(max_seq_len=64)
    return cfg, randomize(S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=0), seed=5, scale=0.3)


def _req(tokens, n, seed=0, handle=None):
    return GenerationRequest(tokens=list(tokens), max_new_tokens=n, temperature=1.0, seed=seed, slot_handle=handle)


def _all_returned(engine):
    """Every slot free, every page unreferenced (free, or kept by the prefix cache)."""
    assert engine.occupancy["running"] == engine.occupancy["parked"] == engine.occupancy["queued"] == 0
    for a in engine._pt.allocators:
        assert a._refs.sum() == 0 and a.free_count == a.num_pages


# -- the bookkeeping --------------------------------------------------------------------------

def test_page_keys_name_whole_prefixes_and_only_full_pages():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and len(set(a)) == 2   # the trailing partial page has no key
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    b = page_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]      # page 1 holds the same tokens after another page 0
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 0], 4)[0] == a[0]
    assert page_keys(np.asarray([1, 2, 3, 4]), 4) == page_keys([1, 2, 3, 4], 4) == a[:1]
    assert page_keys([1, 2, 3], 4) == []


def test_allocator_frees_a_shared_page_with_its_last_holder_and_keeps_cached_ones_as_free():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.share([p[0]])
    a.free(p)
    assert a.refs(p[0]) == 1 and a.free_count == 3      # still held by its sharer
    with pytest.raises(ValueError, match=f"page {p[1]} freed twice"):
        a.free([p[1]])
    with pytest.raises(ValueError, match=f"page {p[0]} freed twice"):
        a.free([p[0], p[0]])                            # one holder, two frees: nothing freed
    assert a.refs(p[0]) == 1
    with pytest.raises(ValueError, match="nobody holds it"):
        a.share([3])
    a.free([p[0]])
    assert a.free_count == 4 and a.alloc(4) == [0, 1, 2, 3]

    c = PrefixCache(keep=2)
    a = PageAllocator(4, c)
    pages = a.alloc(3)
    for page, key in zip(pages, (b"a", b"b", b"c")):
        c.add(page, key)
    a.free(pages)                        # 3 unreferenced keyed pages, 2 kept: the oldest forgotten
    assert c.kept_count == 2 and c.lookup([b"a"]) == [] and a.free_count == 4 and a.used_count == 0
    assert c.lookup([b"b", b"c"]) == pages[1:]
    a.share([pages[2]])                  # a hit takes a kept page back
    assert c.kept_count == 1 and a.free_count == 3
    got = a.alloc(3)                     # the truly free pages first, then the kept one (forgotten)
    assert got[-1] == pages[1] and c.lookup([b"b"]) == []
    with pytest.raises(PagesExhausted):
        a.alloc(1)
    a.free(got + [pages[2]])
    a.forget_cached()
    assert len(c) == 0 and a.free_count == 4
    with pytest.raises(ValueError, match="PrefixCache keep must be >= 0, got -1"):
        PrefixCache(-1)


def test_page_table_shares_pages_all_or_nothing():
    pt = PageTable(3, 16, 4, 6)
    assert pt.ensure(0, 10)                          # 3 pages
    shared = pt.full_pages(0, 2)
    assert pt.ensure(1, 11, shared=shared)           # 2 shared + 1 own
    assert pt.table[1, 0, :2].tolist() == shared and pt.used_count == 4
    assert not pt.ensure(2, 16, shared=shared[:1])   # 1 shared + 3 own, 2 free: nothing taken
    assert pt.table[2, 0].tolist() == [6] * 4 and pt.allocator.refs(shared[0]) == 2   # undone
    pt.release(0)
    assert pt.allocator.refs(shared[0]) == 1 and pt.used_count == 3
    pt.release(1)
    assert pt.used_count == 0 and pt.peak_used == 4
    with pytest.raises(ValueError, match="does not hold 2 full-attention pages"):
        pt.full_pages(0, 2)


# -- a group's samples -----------------------------------------------------------------------

def _group_requests(prompts, g, n=8):
    return [_req(p, n, seed=100 * i + s) for i, p in enumerate(prompts) for s in range(g)]


@pytest.mark.parametrize("model", ["moe", "latent"])
def test_a_groups_samples_hold_their_prompt_pages_once_bit_for_bit(model):
    """4 samples of 3 prompts (2-4 full pages each): paged sharing holds each prompt's full pages
    once and decodes bit for bit what the dense cache does (the same prefill call either way); the
    unshared paged engine holds 4 copies."""
    cfg, params = _params(TINY if model == "moe" else TINY_DEEPSEEK)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(1, 60, n).tolist() for n in (9, 13, 17)]
    requests = _group_requests(prompts, 4)
    kw = dict(ENGINE, max_slots=12)   # every sample at once
    dense = Engine(cfg, params, **kw)
    shared = Engine(cfg, params, **kw, page_size=4, num_pages=96)
    apart = Engine(cfg, params, **kw, page_size=4, num_pages=96, share_prompts=False)
    want, got, got_apart = _complete(dense, requests), _complete(shared, requests), _complete(apart, requests)
    for g, w in zip(got, want):
        assert (g.tokens, g.raw_logprobs, g.logprobs) == (w.tokens, w.raw_logprobs, w.logprobs)
    for g, w in zip(got_apart, want):   # 12 prompt rows instead of 3: float rounding of the batch
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-5)
    # prompt pages: (9 + 13 + 17) // 4 = 9 full pages held once, not 4 times
    full = sum(len(p) // 4 for p in prompts)
    assert apart.stats.peak_pages - shared.stats.peak_pages == 3 * full
    assert shared.stats.prefix_hit_tokens == 3 * sum(map(len, prompts))
    for engine in (shared, apart):
        _all_returned(engine)
        engine.release_memory()
    dense.release_memory()


def test_a_groups_shared_prompt_keeps_its_routes():
    """record_routes (R3): every sample of a shared prompt gets the routes its prompt's one row
    computed, as in the dense engine."""
    cfg, params = _params(TINY)
    rng = np.random.RandomState(2)
    requests = _group_requests([rng.randint(1, 60, n).tolist() for n in (10, 7)], 3, n=5)
    kw = dict(ENGINE, max_consecutive_faults=0, record_routes=True)
    want = _complete(Engine(cfg, params, **kw), requests)
    engine = Engine(cfg, params, **kw, page_size=4, num_pages=64)
    got = _complete(engine, requests)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and np.array_equal(g.routes, w.routes)
    _all_returned(engine)


# -- the prefix cache across requests --------------------------------------------------------

def test_a_later_prompt_maps_the_cached_pages_of_its_head_and_new_weights_forget_them():
    cfg, params = _params(TINY)
    rng = np.random.RandomState(3)
    head = rng.randint(1, 60, 16).tolist()                  # a system prompt: 4 full pages
    first = [head + rng.randint(1, 60, 3).tolist() for _ in range(2)]
    later = [head + rng.randint(1, 60, 5).tolist(), first[0]]
    cached = Engine(cfg, params, **ENGINE, page_size=4, num_pages=64, prefix_cache_pages=32)
    plain = Engine(cfg, params, **ENGINE, page_size=4, num_pages=64)
    round1 = [_complete(engine, _group_requests(first, 2)) for engine in (cached, plain)]
    # admitted together: prompt 0 computed once for its 2 samples (19 tokens served to the second);
    # prompt 1 maps prompt 0's head (4 pages) as soon as it is named and computes its last 3
    # tokens once for both its samples
    assert (plain.stats.prefill_tokens, plain.stats.prefix_hit_tokens) == (38, 38)
    assert (cached.stats.prefill_tokens, cached.stats.prefix_hit_tokens) == (19 + 3, 19 + 16 + 19)
    for g, w in zip(*round1):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-5)
    before = (cached.stats.prefill_tokens, cached.stats.prefix_hit_tokens)
    got, want = _complete(cached, _group_requests(later, 2)), _complete(plain, _group_requests(later, 2))
    # the new prompt maps the head's 4 pages; the repeated one all 4 of its full pages (its 19th
    # token is computed: its logits give the first token); each computed once for its 2 samples
    computed = cached.stats.prefill_tokens - before[0]
    assert cached.stats.prefix_hit_tokens - before[1] == (16 + 21) + (16 + 19) and computed == 5 + 3
    assert cached.steps.compile_counts()["prefill_at"] >= 1
    # the rest of the prompt reads the head's keys from the cache: equal up to float rounding
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-5)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    _all_returned(cached)
    assert cached._pt.allocator.cache.kept_count > 0
    # new weights: nothing cached is valid any more
    cached.set_params(randomize(params, seed=6, scale=0.3))
    assert cached._pt.allocator.cache.kept_count == 0 and len(cached._pt.allocator.cache) == 0
    hits = cached.stats.prefix_hit_tokens
    _complete(cached, [_req(later[0], 3)])
    assert cached.stats.prefix_hit_tokens == hits
    cached.release_memory()
    assert len(cached._pt.allocator.cache) == 0   # the pages' contents went with the state


def test_a_slot_filled_before_new_weights_is_not_cached():
    """set_params while a trajectory is parked: its pages hold keys of the old weights, so its
    release names none of them; the same prompt afterwards is computed again."""
    cfg, params = _params(TINY)
    engine = Engine(cfg, params, **ENGINE, page_size=4, num_pages=64, prefix_cache_pages=32)
    prompt = list(range(1, 14))

    async def main():
        parked = await engine.complete(_req(prompt, 3))
        engine.set_params(params)
        await engine.release(parked.slot_handle)
        assert len(engine._pt.allocator.cache) == 0
        again = await engine.complete(_req(prompt, 3))
        await engine.release(again.slot_handle)
    asyncio.run(main())
    assert engine.stats.prefix_hit_tokens == 0 and engine.stats.prefill_tokens == 2 * 13
    assert len(engine._pt.allocator.cache) == 3   # the second one, filled with these weights, is named
    _all_returned(engine)


def test_an_evicted_trajectory_comes_back_through_its_cached_pages_and_every_page_returns():
    """A parked trajectory is evicted for another's pages; the other takes what it needs (the
    evicted sequence's tail first) and ends; the evicted one's append maps its cached head and
    recomputes only the rest. Completions equal an engine without the cache's."""
    cfg, params = _params(TINY)
    rng = np.random.RandomState(4)
    a_prompt, b_prompt = rng.randint(1, 60, 29).tolist(), rng.randint(1, 60, 29).tolist()

    async def main(engine):
        a = await engine.complete(_req(a_prompt, 2, seed=1))
        b = await engine.complete(_req(b_prompt, 12, seed=2))      # grows past the pool: A goes
        await engine.release(b.slot_handle)
        a2 = await engine.complete(_req([7, 8, 9], 6, seed=3, handle=a.slot_handle))
        await engine.release(a2.slot_handle)
        return [(c.tokens, c.raw_logprobs) for c in (a, b, a2)]
    kw = dict(max_slots=2, max_len=64, buckets=(8, 32, 64), decode_steps=2, page_size=4, num_pages=16)
    plain, cached = Engine(cfg, params, **kw), Engine(cfg, params, **kw, prefix_cache_pages=16)
    want, got = asyncio.run(main(plain)), asyncio.run(main(cached))
    assert plain.stats.evictions == cached.stats.evictions == 1
    assert plain.stats.restored_slots == cached.stats.restored_slots == 1
    # A held 31 tokens when evicted (7 full pages); B took 2 pages of them, its tail
    assert cached.stats.prefix_hit_tokens == 5 * 4
    assert plain.stats.prefill_tokens - cached.stats.prefill_tokens == 5 * 4
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        np.testing.assert_allclose(gl, wl, atol=1e-5)
    _all_returned(cached)


def test_a_preempted_request_resumes_through_its_cached_pages():
    """Two requests outgrow the pool while decoding: the younger is preempted (its pages named,
    then released) and resumes once the other ends, mapping its cached head."""
    cfg, params = _params(TINY)
    rng = np.random.RandomState(6)
    requests = [_req(rng.randint(1, 60, 29).tolist(), 20, seed=s) for s in (1, 2)]
    kw = dict(max_slots=2, max_len=64, buckets=(8, 32, 64), decode_steps=2, page_size=4, num_pages=16)
    plain, cached = Engine(cfg, params, **kw), Engine(cfg, params, **kw, prefix_cache_pages=16)
    want, got = _complete(plain, requests), _complete(cached, requests)
    assert plain.stats.preemptions == cached.stats.preemptions >= 1
    assert cached.stats.prefix_hit_tokens > 0
    assert plain.stats.prefill_tokens - cached.stats.prefill_tokens == cached.stats.prefix_hit_tokens
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-5)
    _all_returned(cached)


def test_device_faults_with_shared_and_cached_pages_keep_every_token_on_policy():
    cfg, params = _params(TINY)
    engine = Engine(cfg, params, max_slots=6, max_len=48, buckets=(16, 32), decode_steps=2, page_size=4,
                    num_pages=48, prefix_cache_pages=16, max_consecutive_faults=8)
    flaky = FlakyEngineSteps(engine.steps, p=0.08, seed=1)
    engine.steps = flaky
    head = list(range(1, 10))

    async def trajectory(i):
        seq, handle, out = head + [20 + i % 3], None, []
        pending = list(seq)
        try:
            for turn in range(3):
                c = await engine.complete(_req(pending, 4, seed=10 * i + turn, handle=handle))
                handle = c.slot_handle
                out.append((len(seq), c.raw_logprobs))
                seq += c.tokens
                pending = [30 + turn, 31]
                if turn < 2:
                    seq += pending
        finally:
            await engine.release(handle)
        return seq, out

    async def main():
        return await asyncio.gather(*(trajectory(i) for i in range(9)))
    results = asyncio.run(main())
    # a rebuild refills a page several slots share once (the others map it)
    assert engine.stats.faults > 0 and engine.stats.restored_slots > 0 and engine.stats.prefix_hit_tokens > 0
    want = teacher_forced_logprobs(cfg, params, [s for s, _ in results])
    for (seq, out), lp in zip(results, want):
        for start, raw in out:
            np.testing.assert_allclose(raw, lp[start - 1:start - 1 + len(raw)], atol=2e-4)
    engine.steps = flaky.inner
    _all_returned(engine)


def test_the_prefix_cache_refuses_what_it_cannot_serve():
    cfg, params = _params(TINY)
    with pytest.raises(ValueError, match="prefix_cache_pages=4\\) keeps pages of a paged cache"):
        Engine(cfg, params, **ENGINE, prefix_cache_pages=4)
    with pytest.raises(ValueError, match=r"Engine\(prefix_cache_pages\) must be >= 0, got -1"):
        Engine(cfg, params, **ENGINE, page_size=4, prefix_cache_pages=-1)
    with pytest.raises(ValueError, match=r"Engine\(prefix_cache_pages\) must be an int >= 0, got True"):
        Engine(cfg, params, **ENGINE, page_size=4, prefix_cache_pages=True)
    with pytest.raises(ValueError, match="record_routes=True: a cached prefix keeps no routes"):
        Engine(cfg, params, **ENGINE, page_size=4, prefix_cache_pages=4, max_consecutive_faults=0,
               record_routes=True)
    gcfg, gparams = _params(TINY_GPT_OSS)
    with pytest.raises(ValueError, match="sliding-window layers"):
        Engine(gcfg, gparams, **ENGINE, page_size=4, prefix_cache_pages=4)


def test_the_benchs_workload_prompts_share_their_head():
    from sfrrl_jax.testing.workload import WorkloadConfig, make_tasks

    def prompts(**kw):
        return [t.metadata["prompt_tokens"] for t in make_tasks(WorkloadConfig(num_prompts=3, prompt_len=10, **kw))]
    shared, own = prompts(shared_prefix_len=6), prompts()
    assert all(len(p) == 10 and p[:6] == shared[0][:6] for p in shared)
    assert len({tuple(p[6:]) for p in shared}) == 3 and len({tuple(p[:6]) for p in own}) == 3
    assert prompts(shared_prefix_len=0) == own
    with pytest.raises(ValueError, match="shared_prefix_len=11 > prompt_len=10"):
        WorkloadConfig(prompt_len=10, shared_prefix_len=11)


def test_prefill_at_computes_the_rest_of_a_prompt_once_for_the_slots_that_share_it():
    """The step under a cache hit, on the dense cache: slot 0 holds a prompt's first 8 tokens;
    `prefill_at_many` computes the rest once into slot 0 and copies it to slot 3 (its twin);
    both then hold what a whole prefill gives (to float rounding) and sample their own first
    token."""
    from sfrrl_jax.engine import SlotRequest
    from sfrrl_jax.engine.paged import engine_steps

    cfg, params = _params(TINY)
    steps = engine_steps(cfg, S.models.mesh_of(params), 4, 32, (8, 16), None, None, False, None)
    prompt = np.random.RandomState(5).randint(1, 60, 13).tolist()
    reqs = [SlotRequest.make(temperature=1.0, seed=s, max_new=5) for s in (1, 2)]
    whole, want = steps.prefill_many(params, steps.init_decode_state(), [0, 3], steps.pad(prompt), [13], reqs,
                                     sources=[0, 0])
    state, _ = steps.prefill_many(params, steps.init_decode_state(), [0], steps.pad(prompt[:8]), [8], reqs[:1])
    state, got = steps.prefill_at_many(params, state, [0, 3], steps.pad(prompt[8:]), [8], [5], reqs, sources=[0, 0])
    assert host(got.tokens)[:2].tolist() == host(want.tokens)[:2].tolist()
    np.testing.assert_allclose(host(got.raw_logprobs)[:2], host(want.raw_logprobs)[:2], atol=1e-5)
    k, k_whole = host(state.cache_k), host(whole.cache_k)
    assert np.array_equal(k[:, 3, :13], k[:, 0, :13])                 # the twin's rows: a copy
    np.testing.assert_allclose(k[:, 0, :13], k_whole[:, 0, :13], atol=1e-5)
    assert host(state.lengths)[[0, 3]].tolist() == [13, 13] and host(state.draws)[[0, 3]].tolist() == [1, 1]
    with pytest.raises(ValueError, match="sources must name each of the 2 rows"):
        steps.prefill_at_many(params, state, [1, 2], np.concatenate([steps.pad([1]), steps.pad([2])]), [0, 0],
                              [1, 1], reqs, sources=[0, 0])
