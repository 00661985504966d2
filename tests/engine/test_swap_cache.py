"""Engine(swap_cache=True): while idle work (a training micro-step) runs, the KV cache waits in
pinned host memory, the job has the devices' memory, and the cache comes back unchanged: the
same tokens as an engine that never swaps, dense or paged, with parked slots resumed after."""
import asyncio
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.protocols import GenerationRequest
from sfrrl_jax.engine import Engine

from model_fixtures import TINY, randomize


@functools.lru_cache(maxsize=None)
def _params():
    cfg = TINY.replace(max_seq_len=128)
    return cfg, randomize(S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=0), seed=5, scale=0.3)


def _run(swap: bool, jobs: int, paged: bool, failing: bool = False):
    gc.collect()   # another engine's cache left for the collector is not this one's
    """Three requests (one parks on a stop token and resumes by append); idle work runs before
    every decode chunk (underfull_slots = max_slots) `jobs` times. Returns (tokens, what each job
    saw, engine)."""
    cfg, params = _params()
    mesh = S.models.mesh_of(params)
    paging = dict(page_size=8, num_pages=24, prefix_cache_pages=8) if paged else {}
    engine = Engine(cfg, params, max_slots=4, max_len=64, buckets=(16,), decode_steps=2, swap_cache=swap,
                    underfull_slots=4, **paging)
    seen = []

    @jax.jit
    def train_like(params, tokens):
        logits, _ = S.models.transformer.forward_with_aux(cfg, params, tokens)
        return jnp.mean(logits)

    def job():
        state = engine.state
        cache_shape = state.cache_k.shape
        on_device = [x for x in jax.live_arrays() if x.shape == cache_shape and not x.is_deleted()
                     and x.sharding.memory_kind != "pinned_host"]
        seen.append((state.cache_k.sharding.memory_kind, state.cache_v.sharding.memory_kind, len(on_device)))
        with jax.set_mesh(mesh):
            jax.block_until_ready(train_like(params, jnp.ones((8, 16), jnp.int32)))
        if failing:
            raise RuntimeError("the micro-step failed")

    left = [jobs]

    def idle_work():
        if left[0] == 0:
            return None
        left[0] -= 1
        return job

    engine.set_idle_work(idle_work, underfull_slots=4)

    async def main():
        async def one(i):
            # requests 1 and 2 share their prompt (paged: its full page held once)
            first = await engine.complete(GenerationRequest(tokens=[3 + min(i, 1), 7, 1] + [2] * 8, max_new_tokens=12,
                                                            temperature=0.0, stop_token_ids=[5] if i == 0 else []))
            if i != 0:
                return first.tokens
            more = await engine.complete(GenerationRequest(tokens=[9, 9], max_new_tokens=10, temperature=0.0,
                                                           slot_handle=first.slot_handle))
            return first.tokens + more.tokens
        return await asyncio.gather(*(one(i) for i in range(3)))

    if not failing:
        return asyncio.run(main()), seen, engine
    with pytest.raises(RuntimeError, match="the micro-step failed"):
        asyncio.run(main())
    return None, seen, engine


@pytest.mark.parametrize("paged", [False, True])
def test_idle_work_runs_with_the_cache_in_host_memory_and_decoding_is_unchanged(paged):
    reference, seen_ref = _run(swap=False, jobs=5, paged=paged)[:2]   # its engine dropped: gc
    assert reference[1] == reference[2]
    tokens, seen, engine = _run(swap=True, jobs=5, paged=paged)
    assert tokens == reference
    assert len(seen) == len(seen_ref) == 5
    # during each job: both caches in host memory, no cache-shaped array left on the devices
    assert seen == [("pinned_host", "pinned_host", 0)] * 5, seen
    assert all(kind != "pinned_host" for kind, _, _ in seen_ref)
    assert engine.stats.cache_swaps == 5 and engine.stats.swap_seconds > 0
    assert engine.stats.prefix_hit_tokens == 11
    # back on the devices, in the sharding the steps were compiled for
    assert engine.state.cache_k.sharding.memory_kind == "device"
    assert paged or engine.state.cache_k.sharding.is_equivalent_to(engine.steps.cache_sharding, 5)


def test_a_failing_job_still_brings_the_cache_back():
    _, seen, engine = _run(swap=True, jobs=1, paged=False, failing=True)
    assert seen == [("pinned_host", "pinned_host", 0)]
    assert engine.state.cache_k.sharding.memory_kind == "device"
    assert engine.state.cache_v.sharding.memory_kind == "device"
    assert engine.stats.cache_swaps == 1


def test_the_switch_is_checked():
    cfg, params = _params()
    with pytest.raises(ValueError, match=r"swap_cache.*True or False"):
        Engine(cfg, params, max_slots=2, max_len=32, buckets=(16,), swap_cache="yes")
