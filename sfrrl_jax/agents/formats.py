"""Parse tool calls out of generated assistant text: compact (ours), Qwen3, GPT-OSS harmony.

Parsing never raises on model output. Anything unusable (bad JSON, unterminated markup, a call
without a name, arguments that are not an object) becomes a `ToolCallError` at its place in the
call order; the loop turns it into an error observation the policy reads on its next turn.
Unknown tools and schema violations are checked later, by the tool runner, which knows the tools.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Protocol

from sfrrl_jax.agents.protocols import ToolCall, ToolCallError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn: visible text, and the calls in the order they were written."""

    content: str
    calls: tuple[ToolCall | ToolCallError, ...] = ()
    reasoning: str = ""

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if isinstance(c, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [c for c in self.calls if isinstance(c, ToolCallError)]


class ToolCallFormat(Protocol):
    name: str

    def parse(self, text: str) -> ParsedTurn: ...


def _decode_object(payload: str, what: str) -> dict | ToolCallError:
    """The single JSON object in `payload` (surrounding whitespace allowed), or an error."""
    text = payload.strip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as e:
        return ToolCallError(f"malformed tool call JSON in {what}: {e.msg} at char {e.pos}", raw=payload)
    except ValueError as e:  # an integer literal past Python's int digit limit (4300 by default)
        return ToolCallError(f"unparsable tool call JSON in {what}: {e}", raw=payload)
    except RecursionError:  # JSON nested deeper than the interpreter's recursion limit
        return ToolCallError(f"tool call JSON in {what} is nested too deeply", raw=payload)
    if text[end:].strip():
        return ToolCallError(f"unexpected text after the JSON object in {what}: {text[end:end + 30]!r}", raw=payload)
    if not isinstance(value, dict):
        return ToolCallError(f"{what} must be a JSON object, got {type(value).__name__}", raw=payload)
    return value


def _call(name: object, arguments: object, index: int, raw: str) -> ToolCall | ToolCallError:
    if not isinstance(name, str) or not _NAME.match(name):
        return ToolCallError(f"tool call has no valid tool name (got {name!r})", raw=raw)
    if isinstance(arguments, str):  # some models emit arguments as a JSON string
        decoded = _decode_object(arguments, "arguments")
        if isinstance(decoded, ToolCallError):
            return dataclasses.replace(decoded, name=name, raw=raw)
        arguments = decoded
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}",
                             raw=raw, name=name)
    return ToolCall(name=name, arguments=arguments, call_id=f"call_{index}", raw=raw)


def _strip_suffixes(text: str, suffixes: tuple[str, ...]) -> str:
    changed = True
    while changed:
        changed = False
        for s in suffixes:
            if text.endswith(s):
                text, changed = text[: -len(s)], True
    return text


def _tagged_calls(text: str, open_tag: str, close_tag: str, decode_body, stop_suffixes) -> ParsedTurn:
    """Shared scanner for formats that wrap each call in open/close tags inside the turn's text."""
    content, calls, pos = [], [], 0
    while (start := text.find(open_tag, pos)) >= 0:
        content.append(text[pos:start])
        body_start = start + len(open_tag)
        # At most 16 candidate close tags: collecting every later one made a turn of n calls
        # cost O(n^2) (16,000 calls: 18 s on the event loop).
        ends = []
        end = text.find(close_tag, body_start)
        while end >= 0 and len(ends) < 16:
            ends.append(end)
            end = text.find(close_tag, end + len(close_tag))
        if not ends:
            calls.append(ToolCallError(f"unterminated tool call: missing {close_tag}", raw=text[start:]))
            pos = len(text)
            break
        # The nearest close tag, unless it sits inside the JSON (e.g. in a string) and a later one
        # closes a body that decodes.
        first, chosen = None, None
        for e in ends:
            item = decode_body(text[body_start:e], len(calls), text[start:e + len(close_tag)])
            first = first or (item, e)
            if isinstance(item, ToolCall):
                chosen = (item, e)
                break
        item, end = chosen or first
        calls.append(item)
        pos = end + len(close_tag)
    content.append(text[pos:])
    return ParsedTurn(content=_strip_suffixes("".join(content), stop_suffixes).strip(), calls=tuple(calls))


class CompactFormat:
    """Ours: `<|call|>NAME{json arguments}<|/call|>`, any number per turn; turn ends `<|end|>`."""

    name = "compact"

    def parse(self, text: str) -> ParsedTurn:
        def decode(body: str, index: int, raw: str):
            brace = body.find("{")
            if brace < 0:
                return ToolCallError("tool call has no JSON arguments object: expected NAME{...}", raw=raw)
            name = body[:brace].strip()
            arguments = _decode_object(body[brace:], f"arguments of {name!r}")
            if isinstance(arguments, ToolCallError):
                return dataclasses.replace(arguments, raw=raw, name=name or None)
            return _call(name, arguments, index, raw)

        return _tagged_calls(text, "<|call|>", "<|/call|>", decode, ("<|end|>", "<|eos|>"))


def split_reasoning(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> tuple[str, str]:
    """(reasoning, the rest) of a turn that may start with a thinking block.

    `<think>R</think>REST` -> (R, REST). A turn that holds only `R</think>REST` (the template put
    `<think>` into the prompt, as Qwen3's does with thinking on) is split the same way. An
    unterminated `<think>R` (the turn ran out of tokens while thinking) is all reasoning: nothing in
    it is an answer or a call. Text without the tags is all rest. Whitespace around parts is
    stripped."""
    close = text.find(close_tag)
    opened = text.find(open_tag)
    if close >= 0 and (opened < 0 or opened < close):
        start = opened + len(open_tag) if opened >= 0 else 0
        before = text[:opened] if opened >= 0 else ""
        return text[start:close].strip(), (before + text[close + len(close_tag):]).strip()
    if opened >= 0:
        return text[opened + len(open_tag):].strip(), text[:opened].strip()
    return "", text


class Qwen3Format:
    """Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, after an
    optional `<think>...</think>` block that goes to `reasoning` and is never parsed for calls
    (a thought may mention `<tool_call>` without making one)."""

    name = "qwen3"

    def parse(self, text: str) -> ParsedTurn:
        def decode(body: str, index: int, raw: str):
            obj = _decode_object(body, "<tool_call>")
            if isinstance(obj, ToolCallError):
                return dataclasses.replace(obj, raw=raw)
            return _call(obj.get("name"), obj.get("arguments", obj.get("parameters")), index, raw)

        reasoning, rest = split_reasoning(text)
        turn = _tagged_calls(rest, "<tool_call>", "</tool_call>", decode, ("<|im_end|>", "<|endoftext|>"))
        return dataclasses.replace(turn, reasoning=reasoning)


_HARMONY_TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyFormat:
    """GPT-OSS harmony: a turn is a run of messages
    `[<|start|>assistant]<|channel|>CH[ to=functions.NAME][ <|constrain|>json]<|message|>BODY TERM`
    where TERM is <|end|>, <|call|> (a tool call) or <|return|> (the final answer). The first
    message's `<|start|>assistant` is part of the prompt. Content = the `final` channel's text;
    reasoning = the `analysis` channel's text.
    """

    name = "harmony"

    def parse(self, text: str) -> ParsedTurn:
        final, other, reasoning, calls = [], [], [], []
        for chunk in text.split("<|start|>"):
            if not chunk.strip():
                continue
            head, sep, rest = chunk.partition("<|message|>")
            if not sep:
                calls.append(ToolCallError("harmony message without <|message|>", raw=chunk))
                continue
            term_at = min((i for i in (rest.find(t) for t in _HARMONY_TERMINATORS) if i >= 0), default=-1)
            body = rest if term_at < 0 else rest[:term_at]
            recipient = _RECIPIENT.search(head)
            channel_match = _CHANNEL.search(head)
            channel = channel_match.group(1) if channel_match else ""
            if recipient:
                name = recipient.group(1)
                name = name[len("functions."):] if name.startswith("functions.") else name
                if term_at < 0:
                    calls.append(ToolCallError("unterminated tool call: missing <|call|>", raw=chunk, name=name))
                    continue
                arguments = _decode_object(body, f"arguments of {name!r}")
                if isinstance(arguments, ToolCallError):
                    calls.append(dataclasses.replace(arguments, raw=chunk, name=name))
                else:
                    calls.append(_call(name, arguments, len(calls), chunk))
            elif channel == "analysis":
                reasoning.append(body)
            elif channel == "final":
                final.append(body)
            else:
                other.append(body)
        content = "".join(final) if final else "".join(other)
        return ParsedTurn(content=content.strip(), calls=tuple(calls), reasoning="".join(reasoning).strip())


FORMATS = {"compact": CompactFormat, "qwen3": Qwen3Format, "harmony": HarmonyFormat}


def get_format(name: str) -> ToolCallFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(FORMATS)}")
    return FORMATS[name]()
