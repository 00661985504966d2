"""Tool calls in a section of delimited calls: DeepSeek's (V3, R1 and its Qwen / Llama distills,
V3.1) and Kimi K2's, which took DeepSeek's layout with tokens of its own.

DeepSeek: the calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each between
<｜tool▁call▁begin｜> and <｜tool▁call▁end｜>, in one of two layouts:

    V3 / R1:  function<｜tool▁sep｜>NAME\\n```json\\n{arguments}\\n```
    V3.1:     NAME<｜tool▁sep｜>{arguments}

Kimi K2 (Instruct, Thinking): between <|tool_calls_section_begin|> and
<|tool_calls_section_end|>, each call <|tool_call_begin|>ID<|tool_call_argument_begin|>{arguments}
<|tool_call_end|>, its ID `functions.NAME:INDEX` (the template writes the ID back and heads the
result "## Return of ID", so the call keeps it).

The text before the calls is the content, a <think> block the reasoning (R1, K2 Thinking).
"""
from __future__ import annotations

import re

from sfrrl_jax.agents.formats.call_text import (FormatBase, ParsedTurn, decode_object, make_call, split_reasoning,
                                                strip_suffixes)
from sfrrl_jax.agents.protocols import ToolCall, ToolCallError

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
END_OF_SENTENCE = "<｜end▁of▁sentence｜>"

# V3's body after the separator: the name, then the arguments in a ```json fence
_FENCED = re.compile(r"\A(?P<name>[^\n`]*)\n```(?:json)?\n(?P<args>.*)\n?```\s*\Z", re.DOTALL)


class SectionFormat(FormatBase):
    """Calls in one section, each between its own tags (the module). A call that does not read is
    an error in its place; a section left open (no end tag, nor its last call's) is an error for
    what is unread. Subclasses name the tags and read a call's body (`_call`)."""

    calls_begin = calls_end = call_begin = call_end = ""

    def parse(self, text: str) -> ParsedTurn:
        reasoning, rest = split_reasoning(text)
        body = strip_suffixes(rest, self.turn_ends)
        start = body.find(self.calls_begin)
        if start < 0:
            stray = body.find(self.call_begin)   # a call without the block's opening tag
            if stray < 0:
                return ParsedTurn(content=body.strip(), reasoning=reasoning)
            start, inner = stray, stray
        else:
            inner = start + len(self.calls_begin)
        end = body.find(self.calls_end, inner)
        block = body[inner:] if end < 0 else body[inner:end]
        calls = self._calls(block)
        after = "" if end < 0 else body[end + len(self.calls_end):].strip()
        if after:
            calls.append(ToolCallError(f"unexpected text after {self.calls_end}: {after[:30]!r}", raw=after))
        return ParsedTurn(content=body[:start].strip(), calls=tuple(calls), reasoning=reasoning)

    def _calls(self, block: str) -> list[ToolCall | ToolCallError]:
        calls: list[ToolCall | ToolCallError] = []
        pos = 0
        while True:
            begin = block.find(self.call_begin, pos)
            gap = block[pos:begin if begin >= 0 else len(block)].strip()
            if gap:
                calls.append(ToolCallError(f"text outside a {self.call_begin} ... {self.call_end} call: {gap[:30]!r}",
                                           raw=gap))
            if begin < 0:
                break
            inner = begin + len(self.call_begin)
            end = block.find(self.call_end, inner)
            if end < 0:
                calls.append(ToolCallError(f"unterminated tool call: missing {self.call_end}", raw=block[begin:]))
                break
            calls.append(self._call(block[inner:end], len(calls), block[begin:end + len(self.call_end)]))
            pos = end + len(self.call_end)
        if not calls:
            calls.append(ToolCallError(f"{self.calls_begin} without a call", raw=block))
        return calls

    def _call(self, body: str, index: int, raw: str) -> ToolCall | ToolCallError:
        raise NotImplementedError


class DeepSeekFormat(SectionFormat):
    """DeepSeek V3 / R1 / V3.1 tool calls (the module). Turns end with <｜end▁of▁sentence｜>."""

    name = "deepseek_v3"
    turn_ends = (END_OF_SENTENCE,)
    calls_begin, calls_end, call_begin, call_end = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END

    def _call(self, body: str, index: int, raw: str) -> ToolCall | ToolCallError:
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


KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"\A(?:functions\.)?(?P<name>.+?)(?::\d+)?\Z", re.DOTALL)


class KimiK2Format(SectionFormat):
    """Kimi K2 tool calls (the module): the call's ID `functions.NAME:INDEX` names the tool (a bare
    NAME is read too) and is kept as its call_id. Turns end with <|im_end|>."""

    name = "kimi_k2"
    turn_ends = ("<|im_end|>",)
    calls_begin, calls_end, call_begin, call_end = KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_CALL_END

    def _call(self, body: str, index: int, raw: str) -> ToolCall | ToolCallError:
        head, sep, tail = body.partition(KIMI_ARGUMENTS)
        call_id = head.strip()
        if not sep:
            return ToolCallError(f"a tool call without {KIMI_ARGUMENTS} between its id and arguments", raw=raw)
        name = _KIMI_ID.match(call_id).group("name") if call_id else ""
        decoded = decode_object(tail, f"the arguments of {name!r}")
        if isinstance(decoded, ToolCallError):
            return ToolCallError(decoded.message, raw=raw, name=name or None)
        return make_call(name, decoded, index, raw, call_id=call_id or None)
