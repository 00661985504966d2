"""An append (or a restore) reads its slot's cache rows by a gather where the slot axis is whole on
every device, by a select and sum over the slots where it is split (issue #44.2: the select read
every slot's cache, and a 25-token append into 64 slots of SmolLM2-135M cost 3x a decode step).
Both give the same values bit for bit."""
import functools

import jax
import numpy as np

import sfrrl_jax as S
from sfrrl_jax.engine.slot_state import SlotRequest
from sfrrl_jax.engine.steps import EngineSteps

from model_fixtures import TINY, TINY_DENSE, host, randomize


@functools.lru_cache(maxsize=None)
def _setup(cfg, devices):
    mesh = S.make_mesh(devices=jax.devices()[:1]) if devices == 1 else S.make_mesh(data=2, expert=4)
    return mesh, randomize(S.init_params(cfg, mesh, seed=0), seed=4, scale=0.3)


def _append_both_ways(cfg, devices):
    """(gather path's results, select path's results) of prefills into 4 slots then an append
    into slot 2, each on a fresh EngineSteps of the mesh."""
    mesh, params = _setup(cfg, devices)
    out = []
    for gather in (True, False):
        steps = EngineSteps(cfg, mesh, 4, 32, (8, 16))
        steps.gather_slots = gather
        req = SlotRequest.make(temperature=1.0, seed=3, max_new=8)
        state = steps.init_decode_state()
        prompts = [[5, 9, 1, 7, 3], [11, 4], [8, 8, 2, 6, 1, 9, 10], [3]]
        state, _ = steps.prefill_many(params, state, [0, 1, 2, 3], np.concatenate([steps.pad(p) for p in prompts]),
                                      [len(p) for p in prompts], [req] * 4)
        state, _ = steps.generate(params, state, 2)
        append = [12, 13, 2, 7, 9, 30, 1]
        state, first = steps.append_prefill(params, state, 2, steps.pad(append), len(append), req)
        state, chunk = steps.generate(params, state, 3)
        out.append((host(state.cache_k), host(state.cache_v), {k: host(getattr(first, k)) for k in
                    ("tokens", "logprobs", "raw_logprobs")}, host(chunk.tokens), host(chunk.raw_logprobs)))
    return out


def test_one_device_gathers_and_a_split_slot_axis_selects():
    mesh1, _ = _setup(TINY_DENSE, 1)
    mesh8, _ = _setup(TINY_DENSE, 8)
    assert EngineSteps(TINY_DENSE, mesh1, 4, 32, (8, 16)).gather_slots
    assert not EngineSteps(TINY_DENSE, mesh8, 4, 32, (8, 16)).gather_slots   # slots split over data x expert


def test_gathered_and_selected_reads_give_the_same_append_bit_for_bit():
    for cfg, devices in ((TINY_DENSE.replace(max_seq_len=64), 1), (TINY.replace(max_seq_len=64), 8)):
        (k1, v1, f1, t1, r1), (k2, v2, f2, t2, r2) = _append_both_ways(cfg, devices)
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)
        for name in f1:
            assert np.array_equal(f1[name], f2[name]), name
        assert np.array_equal(t1, t2) and np.array_equal(r1, r2)
