"""DeepSeek's tool-call format (V3, R1 and its Qwen / Llama distills, V3.1): the calls between
<｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each between <｜tool▁call▁begin｜> and
<｜tool▁call▁end｜>, in one of two layouts:

    V3 / R1:  function<｜tool▁sep｜>NAME\\n```json\\n{arguments}\\n```
    V3.1:     NAME<｜tool▁sep｜>{arguments}

The text before the calls is the content, a <think> block the reasoning (R1).
"""
from __future__ import annotations

import re

from sfrrl_jax.agents.call_text import (FormatBase, ParsedTurn, decode_object, make_call, split_reasoning,
                                        strip_suffixes)
from sfrrl_jax.agents.protocols import ToolCall, ToolCallError

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
END_OF_SENTENCE = "<｜end▁of▁sentence｜>"

# V3's body after the separator: the name, then the arguments in a ```json fence
_FENCED = re.compile(r"\A(?P<name>[^\n`]*)\n```(?:json)?\n(?P<args>.*)\n?```\s*\Z", re.DOTALL)


class DeepSeekFormat(FormatBase):
    """DeepSeek V3 / R1 / V3.1 tool calls (see the module). A call that does not read is an
    error in its place; a call block left open (no <｜tool▁calls▁end｜>, nor its last call's
    end) is an error for what is unread. Turns end with <｜end▁of▁sentence｜>."""

    name = "deepseek_v3"
    turn_ends = (END_OF_SENTENCE,)

    def parse(self, text: str) -> ParsedTurn:
        reasoning, rest = split_reasoning(text)
        body = strip_suffixes(rest, (END_OF_SENTENCE,))
        start = body.find(CALLS_BEGIN)
        if start < 0:
            stray = body.find(CALL_BEGIN)   # a call without the block's opening tag
            if stray < 0:
                return ParsedTurn(content=body.strip(), reasoning=reasoning)
            start, inner = stray, stray
        else:
            inner = start + len(CALLS_BEGIN)
        end = body.find(CALLS_END, inner)
        block = body[inner:] if end < 0 else body[inner:end]
        calls = self._calls(block)
        after = "" if end < 0 else body[end + len(CALLS_END):].strip()
        if after:
            calls.append(ToolCallError(f"unexpected text after {CALLS_END}: {after[:30]!r}", raw=after))
        return ParsedTurn(content=body[:start].strip(), calls=tuple(calls), reasoning=reasoning)

    def _calls(self, block: str) -> list[ToolCall | ToolCallError]:
        calls: list[ToolCall | ToolCallError] = []
        pos = 0
        while True:
            begin = block.find(CALL_BEGIN, pos)
            gap = block[pos:begin if begin >= 0 else len(block)].strip()
            if gap:
                calls.append(ToolCallError(f"text outside a {CALL_BEGIN} ... {CALL_END} call: {gap[:30]!r}", raw=gap))
            if begin < 0:
                break
            inner = begin + len(CALL_BEGIN)
            end = block.find(CALL_END, inner)
            if end < 0:
                calls.append(ToolCallError(f"unterminated tool call: missing {CALL_END}", raw=block[begin:]))
                break
            calls.append(self._call(block[inner:end], len(calls), block[begin:end + len(CALL_END)]))
            pos = end + len(CALL_END)
        if not calls:
            calls.append(ToolCallError(f"{CALLS_BEGIN} without a call", raw=block))
        return calls

    @staticmethod
    def _call(body: str, index: int, raw: str) -> ToolCall | ToolCallError:
        head, sep, tail = body.partition(SEP)
        if not sep:
            return ToolCallError(f"a tool call without {SEP} between its name and arguments", raw=raw)
        fenced = _FENCED.match(tail)
        if fenced:   # V3 / R1: the type before the separator (function), the name after it
            if head.strip() != "function":
                return ToolCallError(f"tool call type {head.strip()!r} is not 'function'", raw=raw)
            name, arguments = fenced.group("name").strip(), fenced.group("args")
        else:        # V3.1: the name before the separator, the JSON arguments after it
            name, arguments = head.strip(), tail
        decoded = decode_object(arguments, f"the arguments of {name!r}")
        if isinstance(decoded, ToolCallError):
            return ToolCallError(decoded.message, raw=raw, name=name or None)
        return make_call(name, decoded, index, raw)
