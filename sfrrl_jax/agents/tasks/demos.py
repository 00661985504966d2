"""Synthetic demonstrations (correct multi-turn tool-using transcripts) and SFT rendering.

`calculator_demonstration(task)` solves an arithmetic task the way the policy should: one
calculator call per step, each step using earlier results, then `<answer>...</answer>`.
`render_sft_example` turns any such transcript into (tokens, loss_mask) laid out exactly like a
rollout trajectory: mask 1 on the assistant turns (their end-of-turn token included), 0 elsewhere.
Each learned turn is read back with the tool-call format the rollout reads it with, and must give
the message's own calls: a template that writes calls the format cannot read (vLLM's Llama 3.2
pythonic template leaves string arguments unquoted; its Mistral template writes `[TOOL_CALLS]`
without the calls) would teach the model text that every rollout reads as an error.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

from sfrrl_jax.agents.formats.registry import ToolCallFormat, infer_format, renders_tool_calls, trajectory_format
from sfrrl_jax.agents.protocols import Message, Task
from sfrrl_jax.agents.tasks.environments import CALCULATOR_SYSTEM_PROMPT
from sfrrl_jax.agents.tools import CalculatorTool, evaluate_arithmetic, format_number, tool_schema
from sfrrl_jax.tokenizer.protocol import TokenizerProtocol
from sfrrl_jax.tokenizer.tokenizer import TemplateDeltaError


def _operand(text: str) -> str:
    return f"({text})" if text.startswith("-") else text


def calculator_demonstration(task: Task, system_prompt: str | None = CALCULATOR_SYSTEM_PROMPT,
                             call_id: str = "call_0") -> list[Message]:
    """A correct transcript for an 'arithmetic' task, checked against the calculator as it is built.

    One assistant turn per step of `task.metadata["steps"]`, each a single `calculator` call whose
    operands are spelt as in the prompt (or copied from an earlier result), followed by its tool
    message; then a final assistant turn `<answer>{task.answer}</answer>`.

    Args:
      task: an 'arithmetic' task (as made by `builtin_kinds.arithmetic_task`), with `metadata["steps"]`
        (`[left, op, right, value]` per step).
      system_prompt: the system message; None or empty: the transcript has none.
      call_id: each call's id (and its tool message's `tool_call_id`), which templates that write
        ids teach the model (Kimi K2's are 'functions.calculator:0').
    Returns:
      The transcript as OpenAI-style messages: [system], user, then (assistant call, tool result)
      per step, then the assistant's answer.
    Raises:
      ValueError: `task.kind` is not 'arithmetic'.
      AssertionError: a step's expression does not evaluate to its recorded value.
    """
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
        call = {"id": call_id, "type": "function", "function": {"name": "calculator",
                                                                 "arguments": {"expression": expression}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "name": "calculator", "tool_call_id": call_id, "content": value})
    messages.append({"role": "assistant", "content": f"<answer>{task.answer}</answer>"})
    return messages


def calculator_tool_schemas() -> list[dict]:
    """The tool schemas of the calculator environment, to render demonstrations with.

    Returns:
      `[tool_schema(CalculatorTool())]`: the OpenAI function-calling schema of the `calculator` tool.
    """
    return [tool_schema(CalculatorTool())]


def render_sft_example(tokenizer: TokenizerProtocol, messages: Sequence[Message], tools: Sequence[dict] | None = None,
                       tool_format: "str | ToolCallFormat | None" = None) -> tuple[list[int], list[int]]:
    """(tokens, loss_mask) for a transcript; assistant turns are rendered as the policy would emit them.

    Laid out like a rollout trajectory: the prompt up to the first assistant message (with the
    generation prompt), then each assistant turn as generated (its end-of-turn token included),
    then the following non-assistant messages plus the next generation prompt (`render_delta`);
    messages after the last assistant message are left out.
    Each learned turn must read back, with `tool_format`, to exactly the message's calls (names
    and arguments, in order; an answer to none). A template whose call markup no built-in format
    reads is not checked unless `tool_format` is given.

    Args:
      tokenizer: the tokenizer with the chat template (`TokenizerProtocol`; its
        `chat_template_source`, where it has one, picks the default format).
      messages: the transcript, OpenAI-style messages with at least one assistant message; tool
        calls' arguments may be dicts or JSON strings.
      tools: the tool schemas the template renders (e.g. `calculator_tool_schemas()`); None: none.
      tool_format: the format the rollout reads calls with (`AgentConfig.tool_format`: a built-in's
        name or a format value); None: the chat template's, as in the rollout.
    Returns:
      `(tokens, loss_mask)`, two lists of equal length: the token ids, and 1 on the assistant turns'
      tokens (the learned ones), 0 elsewhere.
    Raises:
      ValueError: the transcript has no assistant message; a learned turn does not read back to the
        message's calls (the message names the message and what was read); a tool call has no
        function name or arguments that are not JSON; or `tool_format` names no built-in format.
      TypeError: `tool_format` is neither a string nor a value with `parse`.
      TemplateDeltaError: (a ValueError) an assistant turn does not extend its generation prompt,
        or the template is not append-only after it (from `render_delta`).
    """
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError("render_sft_example: the transcript has no assistant message to learn from")
    fmt = _reading_format(tokenizer, tools, tool_format)
    first = roles.index("assistant")
    tokens = tokenizer.apply_chat_template(messages[:first], tools, add_generation_prompt=True)
    mask = [0] * len(tokens)
    eot = tokenizer.end_of_turn_token
    stops = [s for s in dict.fromkeys(tokenizer.decode([t]) for t in tokenizer.stop_token_ids) if s and s != eot]
    closes = [eot, *stops]
    i = first
    while i < len(messages):
        history = list(messages[:i])
        prompt_text = tokenizer.render(history, tools, add_generation_prompt=True)
        with_turn = tokenizer.render(history + [messages[i]], tools, add_generation_prompt=False)
        cut, stop = _turn_end(with_turn, eot, stops)
        if stop is None or (with_turn.startswith(prompt_text) and cut <= len(prompt_text)):
            # the template closes no turn (GLM-4.5): the turn ends with the next message's opener
            following = messages[i + 1:i + 2] or [{"role": "user", "content": "\u2063"}]
            opener = _close_written_after(tokenizer, history, [messages[i], *following], tools, with_turn, closes)
            cut, stop = (len(with_turn) + len(opener), opener) if opener else (cut, stop)
        start = _turn_start(tokenizer, history, tools, prompt_text, with_turn, cut) if stop is not None else None
        if start is None:
            raise TemplateDeltaError(f"message {i}: the assistant turn does not extend its generation prompt")
        body_end = cut - len(stop)
        if messages[i].get("tool_calls") and i + 1 < len(messages):
            # a call is learned closed as the template closes a past turn (OLMo 3: <|im_end|>,
            # where the conversation's last answer gets eos), which a model trained on whole
            # conversations writes; the example is then the template's render of the transcript
            stop = _close_written_after(tokenizer, history, messages[i:i + 2], tools, with_turn[:body_end],
                                        closes) or stop
        generated = tokenizer.encode(with_turn[start:body_end] + stop)
        if fmt is not None:
            _check_reads_back(fmt, tokenizer.decode(generated), messages[i], i, tokenizer)
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


def _close_written_after(tokenizer, history, turn_and_next, tools, body: str, closes) -> str | None:
    """The stop token (one of `closes`) the template writes right after `body` (the render with
    the turn last, up to its end) once the next message follows it (`turn_and_next`: the turn and
    that message); None where it renders the turn otherwise, writes none there, or cannot render
    the pair."""
    try:
        followed = tokenizer.render(list(history) + list(turn_and_next), tools, add_generation_prompt=False)
    except Exception:   # a template that refuses the pair
        return None
    if not followed.startswith(body):
        return None
    return next((close for close in closes if close and followed.startswith(close, len(body))), None)


def _reading_format(tokenizer, tools, tool_format) -> ToolCallFormat | None:
    """The format the rollout would read the turns with, bound to the tools as the rollout binds
    it; None where the chat template writes no call markup this library reads and none is
    given: the rollout refuses such a template with tools, SFT alone has nothing to check with."""
    template = getattr(tokenizer, "chat_template_source", None)
    if tool_format is None and template is not None and infer_format(template) is None:
        return None
    return trajectory_format(tool_format, tokenizer, list(tools) if tools else None)


def _message_calls(message: Message, index: int) -> list[tuple[str, Any]]:
    """(name, arguments) of the message's calls; arguments given as a JSON string are decoded."""
    calls = []
    for entry in message.get("tool_calls") or ():
        function = entry.get("function", entry) if isinstance(entry, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"message {index}: a tool call without a function name: {entry!r}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"message {index}: tool call {name!r} has arguments that are not JSON: {e}") from None
        calls.append((name, arguments))
    return calls


def _check_reads_back(fmt, text: str, message: Message, index: int, tokenizer) -> None:
    """Raises unless `fmt` reads the learned `text` as exactly the message's calls."""
    want = _message_calls(message, index)
    parsed = fmt.parse(text)
    got = [(c.name, c.arguments) for c in parsed.tool_calls]
    if parsed.errors or got != want:
        def shown(calls):
            return [f"{n}({json.dumps(a, sort_keys=True, default=repr)})" for n, a in calls]
        read = [f"error: {e.message}" for e in parsed.errors] + shown(got)
        ids = {e.get("id") for e in message.get("tool_calls") or () if isinstance(e, dict)}
        if not renders_tool_calls(tokenizer):
            hint = ("This template renders an assistant message's content only, not its tool_calls (as SmolLM3's): "
                    "write the calls into the content as the model writes them")
        elif any(name in ids for name, _ in got):
            hint = ("The template writes each call's id where the model names the tool: give the calls the ids the "
                    "model writes (Kimi K2's: 'functions.NAME:INDEX')")
        else:
            hint = "Set tool_format to the format the template writes, or fix the template"
        raise ValueError(
            f"message {index}: the chat template renders the assistant turn as {text[:300]!r}, which the "
            f"{fmt!r} tool-call format reads as {read or 'an answer without calls'}, not the message's calls "
            f"{shown(want) or '(none)'}: a model trained on it would write turns the rollout misreads. {hint}")


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
