"""Synthetic demonstrations (correct multi-turn tool-using transcripts) and SFT rendering.

`calculator_demonstration(task)` solves an arithmetic task the way the policy should: one
calculator call per step, each step using earlier results, then `<answer>...</answer>`.
`render_sft_example` turns any such transcript into (tokens, loss_mask) laid out exactly like a
rollout trajectory: mask 1 on the assistant turns (their end-of-turn token included), 0 elsewhere.
"""
from __future__ import annotations

import os
from typing import Sequence

from sfrrl_jax.agents.environments import CALCULATOR_SYSTEM_PROMPT
from sfrrl_jax.agents.protocols import Message, Task
from sfrrl_jax.agents.tools import CalculatorTool, evaluate_arithmetic, format_number, tool_schema
from sfrrl_jax.tokenizer.tokenizer import TemplateDeltaError


def _operand(text: str) -> str:
    return f"({text})" if text.startswith("-") else text


def calculator_demonstration(task: Task, system_prompt: str | None = CALCULATOR_SYSTEM_PROMPT) -> list[Message]:
    """A correct transcript for an 'arithmetic' task, checked against the calculator as it is built."""
    if task.kind != "arithmetic":
        raise ValueError(f"task {task.task_id}: calculator demonstrations need kind 'arithmetic', got {task.kind!r}")
    messages: list[Message] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": task.prompt})
    for i, (left, op, right, value) in enumerate(task.metadata["steps"]):
        # Spelt as in the prompt ("19 - 6", tokens '1' '9' ' -' ' ' '6'), so a step's operands are a
        # verbatim copy of the prompt's tokens or of a tool result: an induction pattern a small
        # model learns in a few hundred steps, where a respaced copy ("19-6") takes thousands.
        expression = f"{_operand(left)} {op} {_operand(right)}"
        if format_number(evaluate_arithmetic(expression)) != value:
            raise AssertionError(f"task {task.task_id}: step {i} {expression} != {value}")
        call = {"id": "call_0", "type": "function", "function": {"name": "calculator",
                                                                  "arguments": {"expression": expression}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": value})
    messages.append({"role": "assistant", "content": f"<answer>{task.answer}</answer>"})
    return messages


def calculator_tool_schemas() -> list[dict]:
    return [tool_schema(CalculatorTool())]


def render_sft_example(tokenizer, messages: Sequence[Message], tools: Sequence[dict] | None = None
                       ) -> tuple[list[int], list[int]]:
    """(tokens, loss_mask) for a transcript; assistant turns are rendered as the policy would emit them."""
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError("render_sft_example: the transcript has no assistant message to learn from")
    first = roles.index("assistant")
    tokens = tokenizer.apply_chat_template(messages[:first], tools, add_generation_prompt=True)
    mask = [0] * len(tokens)
    eot = tokenizer.end_of_turn_token
    stops = [s for s in dict.fromkeys(tokenizer.decode([t]) for t in tokenizer.stop_token_ids) if s and s != eot]
    i = first
    while i < len(messages):
        history = list(messages[:i])
        prompt_text = tokenizer.render(history, tools, add_generation_prompt=True)
        with_turn = tokenizer.render(history + [messages[i]], tools, add_generation_prompt=False)
        cut, stop = _turn_end(with_turn, eot, stops)
        start = _turn_start(tokenizer, history, tools, prompt_text, with_turn, cut) if stop is not None else None
        if start is None:
            raise TemplateDeltaError(f"message {i}: the assistant turn does not extend its generation prompt")
        generated = tokenizer.encode(with_turn[start:cut])
        tokens += generated
        mask += [1] * len(generated)
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j < len(messages):
            delta = tokenizer.render_delta(messages[:i + 1], messages[i + 1:j], tools, stop_text=stop)
            tokens += delta
            mask += [0] * len(delta)
        i = j
    return tokens, mask


def _turn_start(tokenizer, history, tools, prompt_text: str, with_turn: str, cut: int) -> int | None:
    """Where the assistant turn starts in `with_turn` (the render with it last), or None: after
    the generation prompt where the prompt is a prefix of it. Templates that write the system
    prompt into the last message only when it is the user's (Mistral's v3) render the history
    otherwise once the turn follows: the turn then starts where the renders of two other
    assistant turns in its place, an answer and a call, part from it (so no character of the
    turn is lost to an answer that starts like it), after the generation prompt if the template
    has one; the example keeps the prompt as the rollout's is (the system prompt in it)."""
    if with_turn[:cut].startswith(prompt_text):
        return len(prompt_text)
    mark = "\u2063"   # no turn starts with an invisible separator
    stand_ins = ({"role": "assistant", "content": mark},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "a00000000", "type": "function", "function": {"name": mark, "arguments": {}}}]})
    renders = [with_turn]
    for stand_in in stand_ins:
        try:
            renders.append(tokenizer.render(list(history) + [stand_in], tools, add_generation_prompt=False))
        except Exception:   # a template that renders no call there: the answer alone
            continue
    if len(renders) == 1:
        return None
    start = len(os.path.commonprefix(renders))
    try:   # the generation prompt, where the template has one, belongs to the prompt's side
        closed = tokenizer.render(list(history), tools, add_generation_prompt=False)
    except Exception:
        closed = None
    generation_prompt = prompt_text[len(closed):] if closed is not None and prompt_text.startswith(closed) else ""
    if generation_prompt:
        at = with_turn.rfind(generation_prompt, 0, start)
        start = at + len(generation_prompt) if at >= 0 else start
    return start if 0 < start < cut else None


def _turn_end(text: str, eot: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """(end, stop) of the assistant turn that closes `text`: right after its last end-of-turn,
    unless another stop token comes later with more than whitespace between (gpt-oss ends the
    conversation's last answer with <|return|>, the token the model generates, and earlier turns
    with <|end|>); an eos a template appends after the closed turn is not part of it."""
    end, stop = (text.rfind(eot) + len(eot), eot) if eot and eot in text else (-1, None)
    for s in stops:
        at = text.rfind(s)
        if at >= 0 and at + len(s) > end and (stop is None or text[end:at].strip()):
            end, stop = at + len(s), s
    return end, stop
