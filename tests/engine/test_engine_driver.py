"""Continuous batching driver, its asyncio face, zero-copy phase swaps, memory release."""
import asyncio
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.protocols import GenerationRequest
from sfrrl_jax.engine import Engine, generate

from model_fixtures import TINY, host, randomize


@functools.lru_cache(maxsize=None)
def _params():
    cfg = TINY.replace(max_seq_len=128)
    return cfg, randomize(S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=0), seed=3, scale=0.3)


def _req(tokens, n, **kw):
    return GenerationRequest(tokens=list(tokens), max_new_tokens=n, temperature=kw.pop("temperature", 0.0), **kw)


def test_continuous_batching_completes_everything_in_length_order_without_leaking_slots():
    cfg, params = _params()
    engine = Engine(cfg, params, max_slots=4, max_len=96, buckets=(16,), decode_steps=2)
    lengths = [40, 3, 25, 9, 1, 17, 5, 33, 12, 2]  # more requests than slots: they queue
    done_order = []

    async def one(i, n):
        c = await engine.complete(_req([1 + i, 2, 3], n))
        done_order.append(i)
        await engine.release(c.slot_handle)
        return c

    async def main():
        # all submitted at once; 4 slots; the short ones finish first
        return await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))

    outs = asyncio.run(main())
    assert [len(c.tokens) for c in outs] == lengths
    assert all(c.finish_reason == "length" for c in outs)
    # completion order follows length within what was admitted together (first 4: 40, 3, 25, 9)
    first_wave = [i for i in done_order if i < 4]
    assert first_wave == sorted(range(4), key=lambda i: lengths[i])
    assert sorted(done_order) == list(range(len(lengths)))  # each exactly once
    assert engine.occupancy == {"running": 0, "parked": 0, "free": 4, "queued": 0}
    assert engine.stats.generated_tokens == sum(lengths)
    assert 0 < engine.stats.slot_occupancy <= 1
    engine.release_memory()
    # all admitted together (as many slots as requests): completion order is length order
    engine = Engine(cfg, params, max_slots=16, max_len=96, buckets=(16,), decode_steps=2)
    done_order.clear()
    asyncio.run(main())
    assert done_order == sorted(range(len(lengths)), key=lambda i: lengths[i])
    engine.release_memory()


def test_stop_tokens_parking_and_resume_by_append():
    cfg, params = _params()
    # find what greedy generates so one of its tokens can be the stop id
    probe = generate(cfg, params, [[5, 6, 7]], max_new_tokens=6)[0].tokens
    stop = probe[2]
    first_hit = probe.index(stop)
    engine = Engine(cfg, params, max_slots=2, max_len=64, buckets=(16,))

    async def main():
        c1 = await engine.complete(_req([5, 6, 7], 10, stop_token_ids=(stop,)))
        assert engine.occupancy["parked"] == 1
        c2 = await engine.complete(_req([9, 9], 4, slot_handle=c1.slot_handle))
        await engine.release(c2.slot_handle)
        with pytest.raises(ValueError, match="not parked"):
            await engine.complete(_req([1], 2, slot_handle=c2.slot_handle))
        return c1, c2

    c1, c2 = asyncio.run(main())
    assert c1.finish_reason == "stop" and c1.tokens == probe[:first_hit + 1]
    whole = [5, 6, 7] + c1.tokens + [9, 9]
    want = generate(cfg, params, [whole], max_new_tokens=4)[0]
    assert c2.tokens == want.tokens  # resumed on its own KV cache == prefilling the whole history
    np.testing.assert_allclose(c2.raw_logprobs, want.raw_logprobs, atol=1e-5)
    assert engine.occupancy["free"] == 2


def test_seeded_sampling_is_independent_of_batch_composition():
    cfg, params = _params()
    alone = generate(cfg, params, [[3, 4, 5]], 8, temperature=1.0, seed=7)[0]
    crowd = generate(cfg, params, [[9, 9], [3, 4, 5], [1]], 8, temperature=1.0, seed=6, max_slots=8)[1]
    assert alone.tokens == crowd.tokens  # request 1 of the crowd has seed 6 + 1 = 7
    assert alone.logprobs == pytest.approx(crowd.logprobs, abs=1e-5)
    other = generate(cfg, params, [[3, 4, 5]], 8, temperature=1.0, seed=8)[0]
    assert other.tokens != alone.tokens


def test_bad_requests_are_refused_clearly():
    cfg, params = _params()
    engine = Engine(cfg, params, max_slots=2, max_len=32, buckets=(16,))

    async def main():
        with pytest.raises(ValueError, match="40 tokens exceed the engine's max_len=32"):
            await engine.complete(_req(range(1, 41), 2))
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            await engine.complete(_req([1], 2, temperature=-1.0))
    asyncio.run(main())
    with pytest.raises(ValueError, match="tokens is empty"):
        _req([], 2)
    with pytest.raises(ValueError, match="tokens is empty"):
        GenerationRequest(tokens=np.zeros(0, np.int32), max_new_tokens=2)


@pytest.mark.parametrize("tokens, message", [
    ([1, 2.5], r"GenerationRequest.tokens\[1\] is float 2.5, not an integer token id"),
    ([True, 3], r"GenerationRequest.tokens\[0\] is bool True, not an integer token id"),
    (np.array([1.0, 2.0]), "GenerationRequest.tokens must hold integer token ids, got a float64 array"),
    ("hello", "GenerationRequest.tokens must be a sequence of token ids, got text 'hello'"),
    ([[1, 2], [3]], r"GenerationRequest.tokens\[0\] is list \[1, 2\], not an integer token id"),
    (np.ones((2, 2), np.int32), r"GenerationRequest.tokens must be a flat sequence of token ids, got shape \(2, 2\)"),
])
def test_token_ids_that_int_would_turn_into_other_tokens_are_refused(tokens, message):
    """A float, a bool or a character is not a token id: int() would silently make one of it."""
    with pytest.raises(ValueError, match=message):
        GenerationRequest(tokens=tokens, max_new_tokens=2)


def test_request_token_ids_keep_their_accepted_forms_and_stop_ids_are_checked():
    for tokens in ([1, 2], (1, 2), np.array([1, 2], np.int64), np.array([1, 2], np.uint16), [np.int32(1), 2]):
        GenerationRequest(tokens=tokens, max_new_tokens=2)
    GenerationRequest(tokens=[1], max_new_tokens=2, stop_token_ids={3, 4})   # a set of stop ids
    with pytest.raises(ValueError, match=r"GenerationRequest.stop_token_ids\[0\] is float 2.0, not an integer"):
        GenerationRequest(tokens=[1], max_new_tokens=2, stop_token_ids=(2.0,))
    with pytest.raises(ValueError, match="GenerationRequest.stop_token_ids must be a sequence of token ids, got int 7"):
        GenerationRequest(tokens=[1], max_new_tokens=2, stop_token_ids=7)


def test_an_id_past_int32_is_refused_at_admission_not_wrapped_into_the_vocabulary():
    """2**32 + 5 cast to int32 is token 5: the range is checked on the ids as given (a Python int
    past int64 too)."""
    cfg, params = _params()
    engine = Engine(cfg, params, max_slots=1, max_len=32, buckets=(16,))
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {cfg.vocab_size}\); got 1..4294967301"):
        asyncio.run(engine.complete(_req(np.array([1, 2**32 + 5], np.int64), 2)))
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {cfg.vocab_size}\); got 1..{2**70}"):
        asyncio.run(engine.complete(_req([1, 2**70], 2)))
    with pytest.raises(ValueError, match=r"prompts\[1\] is text \('2 \+ 2'\), not token ids: tokenize it first"):
        generate(cfg, params, [[1, 2], "2 + 2"], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts must be a list of token-id sequences, got text"):
        generate(cfg, params, "2 + 2", max_new_tokens=2)
    with pytest.raises(ValueError, match="engine max_len=256 > ModelConfig.max_seq_len=128"):
        Engine(cfg, params, max_len=256)


def test_cancelled_request_frees_its_slot():
    cfg, params = _params()
    engine = Engine(cfg, params, max_slots=1, max_len=96, buckets=(16,))

    async def main():
        task = asyncio.create_task(engine.complete(_req([1, 2], 80)))
        while engine.stats.decode_steps < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        c = await engine.complete(_req([1, 2], 3))  # the only slot is usable again
        await engine.release(c.slot_handle)
        return c
    assert len(asyncio.run(main()).tokens) == 3
    assert engine.occupancy["free"] == 1


def test_decode_chunks_chain_on_the_worker_until_the_loop_has_something_to_do():
    """Chunks run back to back without a round trip through the event loop while no slot finishes
    and nothing arrives; a request that arrives mid-chain is admitted after the chunk in flight.
    The tokens are those of a lone greedy generation either way."""
    cfg, params = _params()
    engine = Engine(cfg, params, max_slots=2, max_len=96, buckets=(16,), decode_steps=2)
    chains, admitted_at = [], []
    chain, admit = engine._decode_chain, engine._admit_on_device
    engine._decode_chain = lambda *a: chains.append(chain(*a)) or chains[-1]
    engine._admit_on_device = lambda jobs: admitted_at.append(engine.stats.decode_steps) or admit(jobs)

    async def one(tokens, n):
        c = await engine.complete(_req(tokens, n))
        await engine.release(c.slot_handle)
        return c

    async def late(after):
        while engine.stats.decode_steps < after:
            await asyncio.sleep(0.002)
        submitted = engine.stats.decode_steps
        return submitted, await one([7, 8], 5)

    async def main():
        alone = await one([1, 2, 3], 41)   # 1 token from the prefill, 40 in 20 chunks of 2
        first_chains = [len(c) for c in chains]
        both = await asyncio.gather(one([1, 2, 3], 61), late(40 + 10))
        return alone, first_chains, both

    alone, first_chains, (long, (submitted, short)) = asyncio.run(main())
    assert first_chains == [20]            # one chain: no round trip between its chunks
    # the late request waited for the chunk in flight when it came (two if it came as the chain
    # was checking), not for the rest of the chain
    assert admitted_at[:2] == [0, 40] and submitted <= admitted_at[2] <= submitted + 4
    reference = generate(cfg, params, [[1, 2, 3], [7, 8]], 61, temperature=0.0)
    assert alone.tokens == reference[0].tokens[:41] and long.tokens == reference[0].tokens
    assert short.tokens == reference[1].tokens[:5]
    engine.release_memory()


def test_zero_copy_phase_swaps_and_memory_comes_back():
    cfg, params = _params()
    mesh = S.models.mesh_of(params)
    pointers = {str(p): [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
                for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}

    @jax.jit
    def train_like(params, tokens):  # reads every param, like a train step's forward
        logits, _ = S.models.transformer.forward_with_aux(cfg, params, tokens)
        return jnp.mean(logits)

    engine = Engine(cfg, params, max_slots=8, max_len=32, buckets=(16,))
    tokens = np.ones((8, 16), np.int32)
    jax.block_until_ready(params)
    gc.collect()  # arrays other tests left for the collector must not move the count below
    baseline = len(jax.live_arrays())
    for i in range(5):
        with jax.set_mesh(mesh):
            jax.block_until_ready(train_like(params, tokens))
        engine.allocate()
        state, res = engine.steps.generate(params, engine.state)
        engine.state = state
        jax.block_until_ready(res.tokens)
        del res
        assert len(jax.live_arrays()) > baseline  # the KV cache is alive during rollout
        engine.release_memory()
        gc.collect()
        assert len(jax.live_arrays()) == baseline  # ... and gone after
        if i == 0:
            compiled_after_first = engine.steps.compile_counts()
    now = {str(p): [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
           for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert now == pointers  # no param was copied, moved or resharded
    assert train_like._cache_size() == 1
    assert engine.steps.compile_counts() == compiled_after_first  # nothing recompiled after round 1
    assert engine.steps.cache_bytes() == 2 * 2 * 8 * 32 * 2 * 16 * 4


def test_engine_serves_successive_event_loops_with_queueing():
    """A trainer calls asyncio.run once per step: the same engine must queue in each loop."""
    cfg, params = _params()
    engine = Engine(cfg, params, max_slots=1, max_len=32, buckets=(16,))

    async def main():
        async def one(i):
            c = await engine.complete(_req([1 + i], 2))
            await asyncio.sleep(0)
            await engine.release(c.slot_handle)
            return c
        return await asyncio.gather(*(one(i) for i in range(3)))  # 3 requests, 1 slot

    for _ in range(2):
        assert [len(c.tokens) for c in asyncio.run(main())] == [2, 2, 2]
    engine.release_memory()
