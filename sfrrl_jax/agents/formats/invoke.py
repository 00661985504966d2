"""Tool calls as XML invokes in one block: MiniMax-M2's and DeepSeek-V3.2's (DSML).

    MiniMax-M2:     <minimax:tool_call>
                    <invoke name="NAME">
                    <parameter name="KEY">VALUE</parameter>
                    </invoke>
                    </minimax:tool_call>
    DeepSeek-V3.2:  <｜DSML｜function_calls>
                    <｜DSML｜invoke name="NAME">
                    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
                    </｜DSML｜invoke>
                    </｜DSML｜function_calls>

A block holds any number of invokes. Values are text: DSML says which are strings
(`string="true"`, taken as written) and which are JSON (`"false"`); MiniMax's templates write
strings raw and the rest as JSON, so a value is read as the type its tool's schema declares
(`with_tools`), as Qwen3-Coder's. Text before the block is the content, a <think> block the
reasoning.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

from sfrrl_jax.agents.formats.call_text import (FormatBase, ParsedTurn, make_call, schema_properties, split_reasoning,
                                                tagged_calls, xml_value)
from sfrrl_jax.agents.protocols import ToolCall, ToolCallError


class InvokeFormat(FormatBase):
    """Invoke-block calls (the module). Subclasses name the block's tags, the invoke and
    parameter tags' prefix and the turn's end. A call that does not read is an error in its
    place; the others in its block stand."""

    block_open = block_close = prefix = ""

    def __init__(self, properties: Mapping[str, Mapping[str, Any]] | None = None):
        self._properties = dict(properties or {})
        self._param_head = re.compile(rf'\A<{re.escape(self.prefix)}parameter name="(?P<key>[^"]*)"'
                                      r'(?: string="(?P<string>true|false)")?\s*>\Z')

    def with_tools(self, tools) -> "InvokeFormat":
        return type(self)(schema_properties(tools))

    def parse(self, text: str) -> ParsedTurn:
        reasoning, rest = split_reasoning(text)
        turn = tagged_calls(rest, self.block_open, self.block_close, self._block, self.turn_ends)
        return dataclasses.replace(turn, reasoning=reasoning)

    def _block(self, body: str, index: int, raw: str) -> tuple[ToolCall | ToolCallError, ...]:
        opener, closer = f'<{self.prefix}invoke name="', f"</{self.prefix}invoke>"
        calls: list[ToolCall | ToolCallError] = []
        pos = 0
        while (start := body.find(opener, pos)) >= 0:
            if body[pos:start].strip():
                calls.append(ToolCallError(f"text outside an invoke: {body[pos:start].strip()[:30]!r}", raw=raw))
            head_end = body.find('">', start)
            end = body.find(closer, head_end) if head_end >= 0 else -1
            if end < 0:
                calls.append(ToolCallError(f"unterminated invoke: missing {closer}", raw=body[start:]))
                return tuple(calls)
            name = body[start + len(opener):head_end]
            calls.append(self._invoke(name, body[head_end + 2:end], index + len(calls), body[start:end + len(closer)]))
            pos = end + len(closer)
        if body[pos:].strip() or not calls:
            calls.append(ToolCallError(f"{self.block_open} holds no invoke" if not calls else
                                       f"text outside an invoke: {body[pos:].strip()[:30]!r}", raw=raw))
        return tuple(calls)

    def _invoke(self, name: str, body: str, index: int, raw: str) -> ToolCall | ToolCallError:
        opener, closer = f"<{self.prefix}parameter name=", f"</{self.prefix}parameter>"
        props = self._properties.get(name, {})
        arguments: dict = {}
        pos = 0
        while (start := body.find(opener, pos)) >= 0:
            if body[pos:start].strip():
                return ToolCallError(f"unexpected text in the call of {name!r}: {body[pos:start].strip()[:30]!r}",
                                     raw=raw, name=name or None)
            head_end = body.find(">", start)
            end = body.find(closer, head_end) if head_end >= 0 else -1
            head = self._param_head.match(body[start:head_end + 1]) if end >= 0 else None
            if head is None:
                return ToolCallError(f"unterminated or malformed parameter in the call of {name!r}", raw=raw,
                                     name=name or None)
            key, text = head.group("key"), body[head_end + 1:end]
            if key in arguments:
                return ToolCallError(f"parameter {key!r} given twice in the call of {name!r}", raw=raw,
                                     name=name or None)
            if head.group("string") == "true":
                arguments[key] = text
            elif head.group("string") == "false":
                value = _json_value(text, f"parameter {key!r} of {name!r}")
                if isinstance(value, ToolCallError):
                    return dataclasses.replace(value, raw=raw, name=name or None)
                arguments[key] = value
            else:
                arguments[key] = xml_value(text, props.get(key))
            pos = end + len(closer)
        if body[pos:].strip():
            return ToolCallError(f"unexpected text in the call of {name!r}: {body[pos:].strip()[:30]!r}", raw=raw,
                                 name=name or None)
        return make_call(name, arguments, index, raw)


def _json_value(text: str, what: str) -> object:
    """The one JSON value of `text` (whitespace around it allowed), or an error naming `what`."""
    stripped = text.strip()
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
    except json.JSONDecodeError as e:
        return ToolCallError(f"malformed JSON in {what}: {e.msg} at char {e.pos}")
    except (ValueError, RecursionError) as e:   # a huge integer literal, or nesting past the recursion limit
        return ToolCallError(f"unreadable JSON in {what}: {type(e).__name__}")
    if stripped[end:].strip():
        return ToolCallError(f"unexpected text after the JSON value of {what}: {stripped[end:end + 30]!r}")
    return value


class MiniMaxM2Format(InvokeFormat):
    """MiniMax-M2's calls (the module); turns end with [e~[."""

    name = "minimax_m2"
    turn_ends = ("[e~[",)
    block_open, block_close, prefix = "<minimax:tool_call>", "</minimax:tool_call>", ""


class DeepSeekDsmlFormat(InvokeFormat):
    """DeepSeek-V3.2's DSML calls (the module); turns end with <｜end▁of▁sentence｜>."""

    name = "deepseek_v32"
    turn_ends = ("<｜end▁of▁sentence｜>",)
    block_open, block_close, prefix = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", "｜DSML｜"
