"""A scripted engine for tests: replays given model turns through `EngineProtocol`, no model.

For testing what sits on top of an engine -- an environment, its tools and reward, a rollout
function, the agent loop's token bookkeeping -- exactly and fast:

    engine = ScriptedEngine({tuple(prompt): [call_tokens, answer_tokens]})     # per prompt
    engine = ScriptedEngine(['<|call|>calculator{"expression":"2+3"}<|/call|><|end|>',
                             "<answer>5</answer><|end|>"], tokenizer=tok)       # any prompt, as text
    traj = asyncio.run(run_agent(engine, env, task, tok, AgentConfig()))
    assert engine.requests[1].tokens == observation_delta and engine.released == [0]

It keeps the protocol's semantics (`sfrrl_jax.generation_types`) and checks the caller keeps them:
a request without a handle opens a slot for that prompt; a request with a handle appends its
tokens to that slot (never the history again) and continues the slot's script; `release` frees
a slot once. Everything is recorded for assertions: `requests` (in arrival order), `released`
(handles, in release order) and `slots` (handle -> `ScriptedSlot`, whose `tokens` hold the
slot's whole sequence: prompt, generated turns and appended deltas, as a real KV cache would).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from sfrrl_jax.generation_types import Completion, GenerationRequest

ScriptTurn = Sequence[int] | str   # token ids, or text that `tokenizer.encode` turns into them


@dataclasses.dataclass
class ScriptedSlot:
    """One opened slot: its prompt, the script it replays, the turns answered so far, and every
    token the slot holds (prompt + generated + appended deltas, in order)."""

    prompt: tuple[int, ...]
    script: tuple[tuple[int, ...], ...]
    turn: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)


class ScriptedEngine:
    """An `EngineProtocol` that answers each turn of each trajectory from a script.

    scripts: either a Mapping from a prompt's token ids (a tuple: exactly the first request's
      `tokens`) to that prompt's script, or one script that answers every prompt. A script is a
      sequence of turns, the i-th answering the i-th request of a slot; a turn is a list of token
      ids or a str (encoded with `tokenizer`, which is then required).
    tokenizer: anything with `encode(text) -> list[int]` (only needed for str turns).
    delay: seconds to wait before each answer, or a zero-argument callable drawing them (e.g. a
      seeded `lambda: rng.random() * 0.01`, so many trajectories interleave).
    hang_on_turn: a turn index at which `complete` never answers (until cancelled): for wall
      budgets and cancellation. May be set after construction.
    route_dims: (moe layers, top_k): record routes like an engine built with record_routes=True,
      `Completion.routes` holding `scripted_routes` of the slot's sequence for the tokens this
      call fed (the pending last token of a continued slot, the appended ones, the generated
      ones but the last).

    Each answer is the scripted turn cut to `request.max_new_tokens`; its finish reason is
    'stop' when it ends in one of `request.stop_token_ids`, else 'length' (also when cut). Its
    logprobs are -1e-3 * n for a running count n over the engine (-0.001, -0.002, ...): all
    distinct, so a logprob that lands in the wrong place in a trajectory is caught. Handles are
    0, 1, 2, ... in the order slots open.

    Errors (raised from `complete` / `release`, as a broken engine request would be): a prompt
    without a script is a KeyError; asking a slot for more turns than its script holds, an
    IndexError; continuing or releasing a handle that is unknown or already released, a
    ValueError.
    """

    def __init__(self, scripts: Mapping[tuple[int, ...], Sequence[ScriptTurn]] | Sequence[ScriptTurn],
                 tokenizer: Any = None, delay: float | Callable[[], float] | None = None,
                 hang_on_turn: int | None = None, route_dims: tuple[int, int] | None = None):
        self.tokenizer, self.delay, self.hang_on_turn = tokenizer, delay, hang_on_turn
        self.route_dims = route_dims
        if isinstance(scripts, Mapping):
            self.scripts: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] | None = {
                tuple(prompt): self._encode_script(script) for prompt, script in scripts.items()}
            self.default_script = None
        else:
            self.scripts, self.default_script = None, self._encode_script(scripts)
        self.requests: list[GenerationRequest] = []
        self.released: list[int] = []
        self.slots: dict[int, ScriptedSlot] = {}
        self._handles, self._logprob_count = itertools.count(), itertools.count(1)

    def _encode_script(self, script: Sequence[ScriptTurn]) -> tuple[tuple[int, ...], ...]:
        if isinstance(script, str):   # a str is a Sequence too: one turn's text, not a script
            raise TypeError("ScriptedEngine: a script is a list of turns, got one str")
        out = []
        for turn in script:
            if isinstance(turn, str):
                if self.tokenizer is None:
                    raise ValueError(f"ScriptedEngine: turn {turn!r} is text; pass tokenizer= to encode it")
                turn = self.tokenizer.encode(turn)
            out.append(tuple(int(t) for t in turn))
        return tuple(out)

    def _open(self, prompt: tuple[int, ...]) -> int:
        if self.scripts is None:
            script = self.default_script
        elif prompt in self.scripts:
            script = self.scripts[prompt]
        else:
            raise KeyError(f"ScriptedEngine: no script for this prompt ({len(prompt)} tokens, starting "
                           f"{list(prompt[:8])}); {len(self.scripts)} prompts are scripted")
        handle = next(self._handles)
        self.slots[handle] = ScriptedSlot(prompt, script)
        return handle

    def _live(self, handle: Any) -> ScriptedSlot:
        if handle not in self.slots:
            raise ValueError(f"ScriptedEngine: unknown slot handle {handle!r}")
        if handle in self.released:
            raise ValueError(f"ScriptedEngine: slot {handle!r} was already released")
        return self.slots[handle]

    async def complete(self, request: GenerationRequest) -> Completion:
        self.requests.append(request)
        handle = self._open(tuple(request.tokens)) if request.slot_handle is None else request.slot_handle
        slot = self._live(handle)
        first_fed = 0 if request.slot_handle is None else len(slot.tokens) - 1  # the pending token
        slot.tokens += request.tokens
        if self.hang_on_turn is not None and slot.turn == self.hang_on_turn:
            await asyncio.Event().wait()   # nothing sets it: only cancellation ends this
        if self.delay is not None:
            await asyncio.sleep(self.delay() if callable(self.delay) else self.delay)
        if slot.turn >= len(slot.script):
            raise IndexError(f"ScriptedEngine: slot {handle}'s script has {len(slot.script)} turns; "
                             f"request {slot.turn + 1} asks for one more")
        tokens = list(slot.script[slot.turn])
        slot.turn += 1
        finish = "stop" if tokens and tokens[-1] in request.stop_token_ids else "length"
        if len(tokens) > request.max_new_tokens:
            tokens, finish = tokens[:request.max_new_tokens], "length"
        slot.tokens += tokens
        logprobs = [-1e-3 * next(self._logprob_count) for _ in tokens]
        routes = None
        if self.route_dims is not None:
            routes = scripted_routes(slot.tokens, *self.route_dims)[first_fed:len(slot.tokens) - 1]
        return Completion(tokens, logprobs, finish, handle, routes=routes)

    async def release(self, slot_handle: Any) -> None:
        self._live(slot_handle)
        self.released.append(slot_handle)


def scripted_routes(tokens: Sequence[int], layers: int, top_k: int) -> np.ndarray:
    """The experts `ScriptedEngine(route_dims=(layers, top_k))` reports for a slot's sequence:
    [len(tokens), layers, top_k] int16, a function of each token and its position."""
    t = np.asarray(tokens, np.int64)[:, None, None]
    pos = np.arange(len(tokens))[:, None, None]
    return ((7 * t + pos + 3 * np.arange(layers)[:, None] + np.arange(top_k)) % 97).astype(np.int16)
