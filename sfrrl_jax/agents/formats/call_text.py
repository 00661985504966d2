"""Reading tool calls out of generated text: the pieces every tool-call format shares.

`ParsedTurn` is what a format's `parse` returns; `FormatBase` the built-ins' base class. The
readers here never raise on model output: what cannot be used (bad JSON, an unterminated tag, a
call without a valid name, arguments that are not an object) becomes a `ToolCallError` at its
place in the call order.
"""
from __future__ import annotations

import dataclasses
import json
import re

from sfrrl_jax.agents.protocols import ToolCall, ToolCallError

class FormatBase:
    """The built-in formats' base: no extra stop tokens, and a repr without an address (the run's
    fingerprint holds the agent config); formats of one class are equal."""

    turn_ends: tuple[str, ...] = ()
    message_ends: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))


#: A tool name a call may carry (dotted and dashed names too: `functions.get_weather`).
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


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


def decode_object(payload: str, what: str) -> dict | ToolCallError:
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


def make_call(name: object, arguments: object, index: int, raw: str,
          call_id: str | None = None) -> ToolCall | ToolCallError:
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        return ToolCallError(f"tool call has no valid tool name (got {name!r})", raw=raw)
    if isinstance(arguments, str):  # some models emit arguments as a JSON string
        decoded = decode_object(arguments, "arguments")
        if isinstance(decoded, ToolCallError):
            return dataclasses.replace(decoded, name=name, raw=raw)
        arguments = decoded
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}",
                             raw=raw, name=name)
    return ToolCall(name=name, arguments=arguments, call_id=call_id or f"call_{index}", raw=raw)


def strip_suffixes(text: str, suffixes: tuple[str, ...]) -> str:
    changed = True
    while changed:
        changed = False
        for s in suffixes:
            if text.endswith(s):
                text, changed = text[: -len(s)], True
    return text


def tagged_calls(text: str, open_tag: str, close_tag: str, decode_body, stop_suffixes,
                 retries: int = 16) -> ParsedTurn:
    """Shared scanner for formats that wrap calls in open/close tags inside the turn's text:
    `decode_body(body, index, raw)` reads one block into a call or its error, or a tuple of them
    (a block that holds several calls, OLMo 3's). A block ends at the nearest close tag, unless
    that sits inside it (e.g. in a JSON string) and a later one closes a block that decodes: at
    most `retries` later close tags are tried in a turn, so a hostile turn of many bad blocks costs
    one decode each (collecting every later close tag for every block made n calls cost O(n^2):
    16,000 calls, 18 s on the event loop)."""
    content, calls, pos = [], [], 0
    while (start := text.find(open_tag, pos)) >= 0:
        content.append(text[pos:start])
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        if end < 0:
            calls.append(ToolCallError(f"unterminated tool call: missing {close_tag}", raw=text[start:]))
            pos = len(text)
            break

        def block(close: int) -> tuple:
            item = decode_body(text[body_start:close], len(calls), text[start:close + len(close_tag)])
            return item if isinstance(item, tuple) else (item,)

        items = block(end)
        later = text.find(close_tag, end + len(close_tag))
        while retries > 0 and later >= 0 and any(isinstance(c, ToolCallError) for c in items):
            retries -= 1
            wider = block(later)
            if not any(isinstance(c, ToolCallError) for c in wider):
                items, end = wider, later
                break
            later = text.find(close_tag, later + len(close_tag))
        calls += items
        pos = end + len(close_tag)
    content.append(text[pos:])
    return ParsedTurn(content=strip_suffixes("".join(content), stop_suffixes).strip(), calls=tuple(calls))


def json_objects(text: str, what: str) -> list[tuple[object | ToolCallError, str]]:
    """(value, its text) for the JSON values of `text` one after another, separated by ';' or
    whitespace (Llama 3 writes parallel calls so); what cannot be read becomes one error, and
    reading stops there."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos >= len(text):
            return values
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            error = f"malformed tool call JSON in {what}: {e.msg} at char {e.pos}"
        except ValueError as e:  # an integer literal past Python's int digit limit
            error = f"unparsable tool call JSON in {what}: {e}"
        except RecursionError:
            error = f"tool call JSON in {what} is nested too deeply"
        else:
            values.append((value, text[pos:end]))
            pos = end
            continue
        values.append((ToolCallError(error, raw=text[pos:]), text[pos:]))
        return values


def named_call(obj: object, index: int, raw: str, arguments_keys: tuple[str, ...],
                call_id: str | None = None) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return ToolCallError(f"a tool call must be a JSON object with a name, got {type(obj).__name__}", raw=raw)
    arguments = next((obj[k] for k in arguments_keys if k in obj), None)
    return make_call(obj.get("name"), arguments, index, raw, call_id)


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


def schema_properties(tools) -> dict[str, dict]:
    """{tool name: its parameters' JSON-schema properties} of OpenAI-style tool schemas."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") if isinstance(fn, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = props
    return out


def xml_value(text: str, schema: object) -> object:
    """A parameter's text as its schema's type (the template wrote strings raw, the rest as JSON
    or Python's str of it); text that does not read as that type stays text, for the tool's own
    argument check to refuse."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [k for k in (kinds if isinstance(kinds, list) else [kinds]) if k not in (None, "null")]
    kind = kinds[0] if kinds else None
    if kind == "string":
        return text
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if kind == "integer":
        return value if isinstance(value, int) and not isinstance(value, bool) else text
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else text
    if kind == "object":
        return value if isinstance(value, dict) else text
    if kind == "array":
        return value if isinstance(value, list) else text
    return value if not isinstance(value, str) else text   # no schema: what the JSON says


def xml_call(name: str, arguments: dict, tail: str, index: int, raw: str) -> ToolCall | ToolCallError:
    """The call, unless text follows its last argument (`tail`)."""
    if tail.strip():
        return ToolCallError(f"unexpected text in the call of {name!r}: {tail.strip()[:30]!r}", raw=raw,
                             name=name or None)
    return make_call(name, arguments, index, raw)
