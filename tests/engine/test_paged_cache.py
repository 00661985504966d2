"""The paged KV cache (issue #18): the steps over page pools equal the dense steps bit for bit,
and the driver admits, grows, returns and waits for pages without corrupting any slot. The model
alternates a sliding-window layer (window 4, one page) and a full one, so sequences of up to 32
tokens run far past the window: the window layer's pool (12 pages) keeps only the window."""
import functools

import numpy as np

import sfrrl_jax as S
from sfrrl_jax.engine import SlotRequest
from sfrrl_jax.engine.pages import PageTable, check_paging
from sfrrl_jax.engine.paged import engine_steps

from model_fixtures import TINY_GPT_OSS, host, randomize


@functools.lru_cache(maxsize=None)
def _setup():
    # GPT-OSS-like: sinks and a sliding-window layer (window 4) next to a full one
    cfg = TINY_GPT_OSS.replace(max_seq_len=64)
    mesh = S.make_mesh(data=2, expert=4)
    params = randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)
    return cfg, mesh, params


def test_paged_steps_equal_dense_steps_exactly_through_prefill_decode_append_free_and_reuse():
    cfg, mesh, params = _setup()
    # the arguments exactly as the driver passes them (engine_steps is an lru_cache, keyed on the
    # call's form), so the engines of the tests below get these steps and their compilations
    dense = engine_steps(cfg, mesh, 4, 32, (8, 16), None, None)
    paging = check_paging(4, 24, 32, 4, cfg.layer_windows, 3)  # as the driver's below
    assert paging.windows == (0, 4) and paging.pool_pages == (24, 12)
    paged = engine_steps(cfg, mesh, 4, 32, (8, 16), None, paging)
    # pages of one layer (4 tokens): 24 + 12 and a scratch each vs 4 slots x 8 pages x 2 layers
    assert paged.cache_bytes() * 64 == dense.cache_bytes() * (25 + 13)
    pt = PageTable(4, 32, *paging)
    # slot 3 grabs pages first so the others' pages are neither contiguous nor in slot order
    assert pt.ensure(3, 8)
    window_held = []
    req = SlotRequest.make(temperature=0.0, max_new=30)
    states = {"dense": dense.init_decode_state(), "paged": paged.init_decode_state()}
    got = {"dense": [], "paged": []}

    def sync(state):
        state.page_table = paged.upload_table(pt.snapshot()[1])
        return state

    def prefill(slot, prompt):
        assert pt.ensure(slot, len(prompt) + 3, start=len(prompt))
        for name, eng in (("dense", dense), ("paged", paged)):
            st = sync(states[name]) if name == "paged" else states[name]
            prefix, first = eng.prefill(params, eng.pad(prompt), len(prompt), req)
            states[name] = eng.insert(prefix, st, slot, req, first)
            got[name].append((int(first.tokens), float(first.raw_logprobs)))

    def decode(steps=3):
        lengths, active = host(states["paged"].lengths), host(states["paged"].active)
        assert pt.ensure_many({s: (int(lengths[s]) + steps, int(lengths[s])) for s in np.nonzero(active)[0]})
        window_held.append(pt.owned[:, 1].tolist())
        for name, eng in (("dense", dense), ("paged", paged)):
            st = sync(states[name]) if name == "paged" else states[name]
            states[name], res = eng.generate(params, st, steps)
            valid = host(res.valid)
            got[name].append((host(res.tokens)[valid].tolist(), host(res.raw_logprobs)[valid].tolist()))

    def append(slot, tokens):
        start = int(host(states["paged"].lengths)[slot])
        assert pt.ensure(slot, start + len(tokens) + 3, start=start, cached=start + len(tokens))
        for name, eng in (("dense", dense), ("paged", paged)):
            st = sync(states[name]) if name == "paged" else states[name]
            states[name], first = eng.append_prefill(params, st, slot, eng.pad(tokens), len(tokens), req)
            got[name].append((int(first.tokens), float(first.raw_logprobs)))

    rng = np.random.RandomState(0)
    prompt = lambda n: rng.randint(0, cfg.vocab_size, n).tolist()
    prefill(0, prompt(5))
    prefill(2, prompt(9))
    decode()
    decode()
    decode()
    # park slot 0 (as the driver does after a stop token) by appending a tool observation to it,
    # longer than the window: the pages between its first queries' keys and its last window go
    last = got["dense"][-1][0]
    append(0, [last[-3]] + prompt(7))  # 8 tokens: the bucket of the shorter appends
    decode()
    for name, eng in (("dense", dense), ("paged", paged)):
        states[name] = eng.free_resource(states[name], 2)
    pt.release(2)
    prefill(1, prompt(6))  # takes slot 2's freed pages: stale keys there must not leak in
    decode()
    decode()
    decode()
    assert got["paged"] == got["dense"]  # tokens and raw logprobs, bit for bit
    assert sum(len(toks) for toks, _ in got["dense"][2:3]) == 6
    assert host(states["paged"].page_table)[2].tolist() == [[24] * 8, [12] * 8]  # freed: all scratch
    # slot 0 ran from 5 to 26 cached tokens, its window pages returned as it went: a decoding
    # slot holds the pages of [L - 3, L + 3), at most 3; the full layer's pool holds every page
    assert int(host(states["paged"].lengths)[0]) >= 26 and pt.owned[0].tolist() == [8, 2]
    assert max(max(h) for h in window_held) <= 3 and pt.owned[:, 0].max() == 8


# -- the driver ------------------------------------------------------------------------------
import asyncio  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

from sfrrl_jax.agents.protocols import GenerationRequest  # noqa: E402
from sfrrl_jax.engine import Engine  # noqa: E402

# the steps test's shapes, so the engines reuse its compilations
ENGINE = dict(max_slots=4, max_len=32, buckets=(8, 16), decode_steps=3)


def _engine(paged=True, **kw):
    cfg, _, params = _setup()
    return Engine(cfg, params, **ENGINE, **(dict(page_size=4, num_pages=24) if paged else {}), **kw)


def _req(tokens, n, handle=None, stop=()):
    return GenerationRequest(tokens=list(tokens), max_new_tokens=n, temperature=0.0, slot_handle=handle,
                             stop_token_ids=tuple(stop))


def _trajectory_specs(n, seed):
    """Long-tail agentic work: 1-3 turns, log-normal turn lengths, a tool observation between."""
    rng = np.random.RandomState(seed)
    specs = []
    for _ in range(n):
        prompt = rng.randint(1, 60, rng.randint(2, 7)).tolist()
        turns, total = [], len(prompt)
        for t in range(rng.randint(1, 4)):
            obs = rng.randint(1, 60, rng.randint(1, 4)).tolist() if t else []
            new = int(np.clip(rng.lognormal(1.0, 0.8), 1, 12))
            if total + len(obs) + new + 1 > 32:
                break
            turns.append((obs, new))
            total += len(obs) + new
        specs.append((prompt, turns))
    return specs


async def _run_trajectory(engine, prompt, turns, hold=0.0):
    out, handle = [], None
    for obs, new in turns:
        c = await engine.complete(_req(prompt if handle is None else obs, new, handle))
        out.append((c.tokens, c.raw_logprobs))
        handle = c.slot_handle
        await asyncio.sleep(hold)  # the tool call: the slot stays parked meanwhile
    await engine.release(handle)
    return out


def test_paged_engine_equals_dense_engine_on_a_long_tail_agentic_batch():
    specs = _trajectory_specs(10, seed=1)  # 10 trajectories on 4 slots: they queue

    async def main(engine):
        return await asyncio.gather(*(_run_trajectory(engine, p, t, hold=0.003 * (i % 3))
                                      for i, (p, t) in enumerate(specs)))

    dense, paged = _engine(paged=False), _engine()
    want, got = asyncio.run(main(dense)), asyncio.run(main(paged))
    assert paged.stats.evictions == paged.stats.preemptions == 0  # a pool that holds the batch
    assert paged.stats.appends > 0 and paged.steps.cache_bytes() < dense.steps.cache_bytes()
    assert got == want  # tokens and raw logprobs, bit for bit
    assert paged.occupancy == {"running": 0, "parked": 0, "free": 4, "queued": 0, "pages_free": 24 + 12,
                               "evicted": 0}
    for e in (dense, paged):
        e.release_memory()


def test_a_request_that_cannot_get_pages_waits_and_the_others_are_untouched():
    """Three parked trajectories hold every page; a fourth request waits (a slot is free, pages
    are not), then runs once one is released; the parked ones then resume on intact caches."""
    rng = np.random.RandomState(7)
    prompts = [rng.randint(1, 60, 12).tolist() for _ in range(4)]

    async def main(engine, check_wait):
        # 12 prompt + 17 new: its last chunk starts at 27 cached + 3 reserved: 8 pages each, 24 in all
        firsts = await asyncio.gather(*(engine.complete(_req(p, 17)) for p in prompts[:3]))
        late = asyncio.create_task(engine.complete(_req(prompts[3], 4)))
        if check_wait:
            await asyncio.sleep(0.3)
            assert engine._pt.free_counts[0] == 0 and engine.occupancy["queued"] == 1  # the full pool
            assert not late.done()
        await engine.release(firsts[0].slot_handle)
        fourth = await late
        await engine.release(fourth.slot_handle)
        resumed = [await engine.complete(_req([5, 6], 1, c.slot_handle)) for c in firsts[1:]]
        for c in resumed:
            await engine.release(c.slot_handle)
        return [(c.tokens, c.raw_logprobs) for c in firsts + [fourth] + resumed]

    dense, paged = _engine(paged=False), _engine()
    want, got = asyncio.run(main(dense, False)), asyncio.run(main(paged, True))
    assert paged.stats.evictions == paged.stats.preemptions == 0
    assert got == want
    assert paged.occupancy["pages_free"] == 24 + 12
    for e in (dense, paged):
        e.release_memory()


def test_no_page_leaks_after_1000_requests_with_cancellations_evictions_and_preemptions():
    engine = _engine()
    rng = random.Random(3)
    specs, n_requests = [], 0
    while n_requests < 1000:
        if len(specs) < 8 or len(specs) % 50 == 0:  # long: 4 running need 32 of the 24 pages
            specs.append(([rng.randrange(1, 60) for _ in range(10)], [([], 18), ([1, 2], 2)]))
        else:  # short: one prefill a turn, cheap
            prompt = [rng.randrange(1, 60) for _ in range(rng.randrange(2, 6))]
            specs.append((prompt, [([], 1)] + [([3], 1)] * rng.randrange(0, 2)))
        n_requests += len(specs[-1][1])

    async def one(i, prompt, turns):
        task = asyncio.create_task(_run_trajectory(engine, prompt, turns, hold=0.001 * (i % 4)))
        if i >= 8 and rng.random() < 0.25:  # cancel at a random point: queued, prefilling, decoding or parked
            await asyncio.sleep(rng.random() * 0.02)
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return False
        return True

    async def main():
        sem = asyncio.Semaphore(12)  # more live trajectories than slots, and than pages hold

        async def bounded(i, p, t):
            async with sem:
                return await one(i, p, t)
        return await asyncio.gather(*(bounded(i, p, t) for i, (p, t) in enumerate(specs)))

    finished = asyncio.run(main())
    assert 0 < sum(finished) < 1000
    # A cancelled trajectory's last handle is not released by _run_trajectory; nothing waits on
    # those any more except as parked/evicted slots, which release_memory refuses: release them.
    for slot, serial in list(engine._parked.items()):
        asyncio.run(engine.release(S.engine.SlotHandle(slot, serial)))
    for serial in list(engine._evicted):
        asyncio.run(engine.release(S.engine.SlotHandle(-1, serial)))
    occ = engine.occupancy
    assert occ == {"running": 0, "parked": 0, "free": 4, "queued": 0, "pages_free": 24 + 12, "evicted": 0}, occ
    assert engine._pt.free_counts == (24, 12) and (engine._pt.table == engine._pt.scratch[None, :, None]).all()
    assert engine.stats.evictions > 0 and engine.stats.preemptions > 0, engine.stats
    engine.release_memory()


def test_paging_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="num_pages=8 needs a page_size"):
        _engine(paged=False, num_pages=8)
    with pytest.raises(ValueError, match=r"num_pages=4 cannot hold one max_len=32"):
        _engine(paged=False, page_size=4, num_pages=4)
