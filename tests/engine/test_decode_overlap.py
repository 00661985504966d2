"""Overlapped decode chains (`Engine._decode_chain_overlapped`, the default on accelerators and on
one CPU device): chunk i+1 is dispatched before chunk i's tokens are fetched, so the host's work
per chunk runs while the device computes. The tokens and logprobs are those of the sequential
chain; a chain whose slots all reach max_new_tokens runs no extra chunk; multi-device CPU meshes
keep one program in flight (XLA:CPU aborts with two multi-device ones)."""
import asyncio
import functools

import jax

import sfrrl_jax as S
from sfrrl_jax.agents.protocols import GenerationRequest
from sfrrl_jax.engine import Engine

from model_fixtures import TINY, randomize


@functools.lru_cache(maxsize=None)
def _params():
    cfg = TINY.replace(max_seq_len=128)
    return cfg, randomize(S.init_params(cfg, S.make_mesh(devices=jax.devices()[:1]), seed=0), seed=11, scale=0.3)


class SequentialEngine(Engine):
    @property
    def _overlap_chunks(self) -> bool:
        return False


def _serve(engine_cls, stop_token=None):
    """Five requests of different lengths (two end mid-chunk, one on a stop token, one parks on it
    and resumes by append, one samples at temperature 1): every call's tokens and logprobs, the
    number of chunks run, and the most chunks ever in flight at once."""
    cfg, params = _params()
    engine = engine_cls(cfg, params, max_slots=4, max_len=96, buckets=(16,), decode_steps=4)
    in_flight, most = [0], [0]
    dispatch, fetch = engine._dispatch_decode, engine._fetch_decode

    def counted_dispatch(*a, **k):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        return dispatch(*a, **k)

    def counted_fetch(handle):
        in_flight[0] -= 1
        return fetch(handle)

    engine._dispatch_decode, engine._fetch_decode = counted_dispatch, counted_fetch

    async def call(tokens, n, **kw):
        c = await engine.complete(GenerationRequest(tokens=tokens, max_new_tokens=n,
                                                    temperature=kw.pop("temperature", 0.0), **kw))
        return c

    async def main():
        async def parked():
            first = await call([5, 6, 7], 30, stop_token_ids=[] if stop_token is None else [stop_token])
            more = await call([9, 10], 9, slot_handle=first.slot_handle)
            await engine.release(more.slot_handle)
            return [first, more]

        async def plain(tokens, n, **kw):
            c = await call(tokens, n, **kw)
            await engine.release(c.slot_handle)
            return [c]
        groups = await asyncio.gather(parked(), plain([1, 2], 23), plain([3, 4, 5], 10),
                                      plain([8, 8], 17, temperature=1.0, seed=3), plain([2, 9], 33))
        return [(c.tokens, c.logprobs, c.finish_reason) for g in groups for c in g]

    out = asyncio.run(main())
    return out, engine.stats.decode_steps // engine.decode_steps, most[0]


def test_overlapped_chains_give_the_sequential_tokens():
    reference, chunks_seq, most_seq = _serve(SequentialEngine)
    stop = reference[0][0][6]   # a token the parked request generates: it stops there next time
    reference, chunks_seq, most_seq = _serve(SequentialEngine, stop)
    out, chunks, most = _serve(Engine, stop)   # one CPU device: overlapped by default
    assert out == reference
    assert reference[0][2] == "stop" and len(reference[0][0]) <= 7
    assert most_seq == 1 and most == 2          # chunk i+1 dispatched before chunk i was fetched
    # at most one chunk more per chain that ends on a stop token; none for max_new_tokens
    assert chunks_seq <= chunks <= chunks_seq + 3, (chunks_seq, chunks)


def test_a_chain_that_ends_on_max_new_tokens_runs_no_extra_chunk():
    cfg, params = _params()
    counts = []
    for cls in (SequentialEngine, Engine):
        engine = cls(cfg, params, max_slots=2, max_len=96, buckets=(16,), decode_steps=2)

        async def main():
            c = await engine.complete(GenerationRequest(tokens=[1, 2, 3], max_new_tokens=41, temperature=0.0))
            await engine.release(c.slot_handle)
            return c.tokens
        counts.append((asyncio.run(main()), engine.stats.decode_steps))
    assert counts[0] == counts[1] and counts[0][1] == 40   # 1 token from the prefill, 40 in 20 chunks


def test_multi_device_cpu_meshes_keep_one_program_in_flight():
    cfg, params = _params()
    assert Engine(cfg, params, max_slots=2, max_len=64, buckets=(16,))._overlap_chunks
    params8 = S.init_params(cfg, S.make_mesh(data=2, expert=4), seed=0)
    assert not Engine(cfg, params8, max_slots=2, max_len=64, buckets=(16,))._overlap_chunks
