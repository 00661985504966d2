"""ScriptedEngine on its own: replay, finish reasons, logprobs, delays, and the protocol misuse it
refuses (the agent loop against it: tests/agents/test_agent_loop.py)."""
import asyncio
import time

import pytest

from sfrrl_jax.generation_types import EngineProtocol, GenerationRequest
from sfrrl_jax.testing import ScriptedEngine

STOP = 9


def _req(tokens, handle=None, max_new=16):
    return GenerationRequest(tokens=list(tokens), max_new_tokens=max_new, stop_token_ids=(STOP,), slot_handle=handle)


class WordTokenizer:
    """Just `encode`: one id per space-separated word (ScriptedEngine needs nothing else)."""

    def encode(self, text):
        return [int(w) for w in text.split()]


def test_replays_each_prompts_script_on_its_slot():
    engine = ScriptedEngine({(1, 2): [[5, 6, STOP], [7, 8, 8]], (3,): [[4, STOP]]})
    assert isinstance(engine, EngineProtocol)

    async def run():
        a = await engine.complete(_req([1, 2]))
        b = await engine.complete(_req([3]))
        a2 = await engine.complete(_req([20, 21], handle=a.slot_handle))
        await engine.release(a.slot_handle)
        await engine.release(b.slot_handle)
        return a, b, a2

    a, b, a2 = asyncio.run(run())
    assert (a.tokens, a.finish_reason, a.slot_handle) == ([5, 6, STOP], "stop", 0)
    assert (b.tokens, b.finish_reason, b.slot_handle) == ([4, STOP], "stop", 1)
    assert (a2.tokens, a2.finish_reason) == ([7, 8, 8], "length")   # no stop token at its end
    # distinct running logprobs, in answer order
    assert a.logprobs + b.logprobs + a2.logprobs == pytest.approx([-1e-3 * i for i in range(1, 9)])
    assert engine.slots[0].tokens == [1, 2, 5, 6, STOP, 20, 21, 7, 8, 8] and engine.slots[0].turn == 2
    assert engine.released == [0, 1] and [r.slot_handle for r in engine.requests] == [None, None, 0]


def test_one_script_for_every_prompt_as_text_and_cut_to_max_new_tokens():
    engine = ScriptedEngine(["5 6 7 9", "8 9"], tokenizer=WordTokenizer())
    first = asyncio.run(engine.complete(_req([1], max_new=2)))
    assert (first.tokens, first.finish_reason) == ([5, 6], "length")
    other = asyncio.run(engine.complete(_req([2, 3])))            # another prompt, same script
    assert (other.tokens, other.finish_reason) == ([5, 6, 7, 9], "stop")
    assert asyncio.run(engine.complete(_req([4], handle=other.slot_handle))).tokens == [8, 9]


def test_refuses_missing_scripts_and_misused_handles():
    with pytest.raises(ValueError, match="pass tokenizer= to encode it"):
        ScriptedEngine(["<answer>1</answer>"])
    with pytest.raises(TypeError, match="a script is a list of turns, got one str"):
        ScriptedEngine("5 6", tokenizer=WordTokenizer())
    engine = ScriptedEngine({(1,): [[5, STOP]]})
    with pytest.raises(KeyError, match=r"no script for this prompt \(2 tokens, starting \[7, 8\]\); 1 prompts"):
        asyncio.run(engine.complete(_req([7, 8])))
    handle = asyncio.run(engine.complete(_req([1]))).slot_handle
    with pytest.raises(IndexError, match="slot 0's script has 1 turns; request 2 asks for one more"):
        asyncio.run(engine.complete(_req([2], handle=handle)))
    with pytest.raises(ValueError, match="unknown slot handle 42"):
        asyncio.run(engine.complete(_req([2], handle=42)))
    asyncio.run(engine.release(handle))
    with pytest.raises(ValueError, match="slot 0 was already released"):
        asyncio.run(engine.release(handle))
    with pytest.raises(ValueError, match="slot 0 was already released"):
        asyncio.run(engine.complete(_req([2], handle=handle)))


def test_delay_and_hang_on_turn():
    engine = ScriptedEngine([[5, STOP], [6, STOP]], delay=lambda: 0.05)
    t0 = time.perf_counter()
    asyncio.run(engine.complete(_req([1])))
    assert time.perf_counter() - t0 >= 0.05
    engine = ScriptedEngine([[5, STOP], [6, STOP]], delay=0.0, hang_on_turn=1)

    async def second_turn_times_out():
        first = await engine.complete(_req([1]))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await engine.complete(_req([2], handle=first.slot_handle))
        await engine.release(first.slot_handle)

    asyncio.run(second_turn_times_out())
    assert engine.released == [0] and engine.slots[0].turn == 1
