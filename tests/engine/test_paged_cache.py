"""The paged KV cache (issue #18): the steps over a page pool equal the dense steps bit for bit,
and the driver admits, grows, returns and waits for pages without corrupting any slot."""
import functools

import numpy as np

import sfrrl_jax as S
from sfrrl_jax.engine import SlotRequest
from sfrrl_jax.engine.pages import PageTable
from sfrrl_jax.engine.steps import engine_steps

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
    dense = engine_steps(cfg, mesh, 4, 32, (8, 16))
    paged = engine_steps(cfg, mesh, 4, 32, (8, 16), paging=(4, 12))
    assert paged.cache_bytes() < dense.cache_bytes()
    pt = PageTable(4, 32, 4, 12)
    # slot 3 grabs pages first so the others' pages are neither contiguous nor in slot order
    assert pt.ensure(3, 8)
    req = SlotRequest.make(temperature=0.0, max_new=30)
    states = {"dense": dense.init_decode_state(), "paged": paged.init_decode_state()}
    got = {"dense": [], "paged": []}

    def sync(state):
        state.page_table = paged.upload_table(pt.snapshot()[1])
        return state

    def prefill(slot, prompt):
        assert pt.ensure(slot, len(prompt) + 3)
        for name, eng in (("dense", dense), ("paged", paged)):
            st = sync(states[name]) if name == "paged" else states[name]
            prefix, first = eng.prefill(params, eng.pad(prompt), len(prompt), req)
            states[name] = eng.insert(prefix, st, slot, req, first)
            got[name].append((int(first.tokens), float(first.raw_logprobs)))

    def decode(steps=3):
        lengths, active = host(states["paged"].lengths), host(states["paged"].active)
        assert pt.ensure_many({s: int(lengths[s]) + steps for s in np.nonzero(active)[0]})
        for name, eng in (("dense", dense), ("paged", paged)):
            st = sync(states[name]) if name == "paged" else states[name]
            states[name], res = eng.generate(params, st, steps)
            valid = host(res.valid)
            got[name].append((host(res.tokens)[valid].tolist(), host(res.raw_logprobs)[valid].tolist()))

    def append(slot, tokens):
        n = int(host(states["paged"].lengths)[slot]) + len(tokens)
        assert pt.ensure(slot, n + 3)
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
    # park slot 0 (as the driver does after a stop token) by appending a tool observation to it
    last = got["dense"][-1][0]
    append(0, [last[-2]] + prompt(4))
    decode()
    for name, eng in (("dense", dense), ("paged", paged)):
        states[name] = eng.free_resource(states[name], 2)
    pt.release(2)
    prefill(1, prompt(6))  # takes slot 2's freed pages: stale keys there must not leak in
    decode()
    decode()
    assert got["paged"] == got["dense"]  # tokens and raw logprobs, bit for bit
    assert sum(len(toks) for toks, _ in got["dense"][2:3]) == 6
    assert host(states["paged"].page_table)[2].tolist() == [12] * 8  # freed: all scratch
