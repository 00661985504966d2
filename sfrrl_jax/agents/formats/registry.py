"""Parse tool calls out of generated assistant text: compact (ours), Qwen3 / Hermes JSON,
Qwen3-Coder / Qwen3.5 XML, GPT-OSS harmony, Llama 3 / 4 JSON, Mistral, pythonic (Llama 3.2 / 4),
Granite 3.

A format is a value (`AgentConfig.tool_format` takes one, or a built-in's name): `parse(text)`
plus the tokens that end its turns (`turn_ends`, added to the tokenizer's stops) and those that
only end a message inside a turn (`message_ends`, removed from them): see `turn_stop_ids`. A
format that reads values by the tools' schemas also has `with_tools(tool_schemas)`, which the
agent loop calls once per trajectory.
`infer_format(chat_template)` names the built-in format a chat template writes.

Parsing never raises on model output. Anything unusable (bad JSON, unterminated markup, a call
without a name, arguments that are not an object) becomes a `ToolCallError` at its place in the
call order; the loop turns it into an error observation the policy reads on its next turn. The
readers the formats share are in `call_text`, the pythonic format in `pythonic`.
Unknown tools and schema violations are checked later, by the tool runner, which knows the tools.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Protocol

from sfrrl_jax.agents.formats.call_text import (FormatBase, ParsedTurn, decode_object, json_objects, make_call,
                                                named_call, schema_properties, split_reasoning, strip_suffixes,
                                                tagged_calls, xml_call, xml_value)
from sfrrl_jax.agents.formats.deepseek import DeepSeekFormat, KimiK2Format
from sfrrl_jax.agents.formats.invoke import DeepSeekDsmlFormat, MiniMaxM2Format
from sfrrl_jax.agents.protocols import ToolCall, ToolCallError
from sfrrl_jax.agents.formats.pythonic import Olmo3Format, PythonicFormat
from sfrrl_jax.tokenizer.chat_template import template_reads_key


class ToolCallFormat(Protocol):
    """`parse(text)`: one generated assistant turn (special tokens kept) -> ParsedTurn, never
    raising. Optional: `turn_ends` / `message_ends`, token strings (see `turn_stop_ids`)."""

    name: str

    def parse(self, text: str) -> ParsedTurn: ...


def turn_stop_ids(fmt: ToolCallFormat, tokenizer) -> tuple[int, ...]:
    """The ids a turn of `fmt` stops on: the tokenizer's `stop_token_ids` without the format's
    `message_ends`, plus its `turn_ends` (those the vocabulary has). gpt-oss's template closes
    past turns with <|end|>, but a live turn writes <|end|> between its messages (analysis, then
    final) and stops on <|return|> or <|call|>."""
    ids = list(tokenizer.stop_token_ids)
    to_id = getattr(tokenizer, "token_to_id", None)
    if to_id is None:  # a protocol tokenizer without token lookups: its stops as they are
        return tuple(ids)
    dropped = {to_id(t) for t in getattr(fmt, "message_ends", ())}
    added = [to_id(t) for t in getattr(fmt, "turn_ends", ())]
    stops = tuple(dict.fromkeys([i for i in ids if i not in dropped] + [i for i in added if i is not None]))
    if not stops:
        raise ValueError(f"tool-call format {getattr(fmt, 'name', fmt)!r} leaves the tokenizer no stop token "
                         f"(its stops {ids} minus the format's message ends): set AgentConfig.stop_token_ids")
    return stops


class CompactFormat(FormatBase):
    """Ours: `<|call|>NAME{json arguments}<|/call|>`, any number per turn; turn ends `<|end|>`."""

    name = "compact"

    def parse(self, text: str) -> ParsedTurn:
        def decode(body: str, index: int, raw: str):
            brace = body.find("{")
            if brace < 0:
                return ToolCallError("tool call has no JSON arguments object: expected NAME{...}", raw=raw)
            name = body[:brace].strip()
            arguments = decode_object(body[brace:], f"arguments of {name!r}")
            if isinstance(arguments, ToolCallError):
                return dataclasses.replace(arguments, raw=raw, name=name or None)
            return make_call(name, arguments, index, raw)

        return tagged_calls(text, "<|call|>", "<|/call|>", decode, ("<|end|>", "<|eos|>"))


class Qwen3Format(FormatBase):
    """Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, after an
    optional `<think>...</think>` block that goes to `reasoning` and is never parsed for calls
    (a thought may mention `<tool_call>` without making one)."""

    name = "qwen3"
    turn_ends = ("<|im_end|>",)

    def parse(self, text: str) -> ParsedTurn:
        def decode(body: str, index: int, raw: str):
            obj = decode_object(body, "<tool_call>")
            if isinstance(obj, ToolCallError):
                return dataclasses.replace(obj, raw=raw)
            return make_call(obj.get("name"), obj.get("arguments", obj.get("parameters")), index, raw)

        reasoning, rest = split_reasoning(text)
        turn = tagged_calls(rest, "<tool_call>", "</tool_call>", decode, ("<|im_end|>", "<|endoftext|>"))
        return dataclasses.replace(turn, reasoning=reasoning)


_HARMONY_TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyFormat(FormatBase):
    """GPT-OSS harmony: a turn is a run of messages
    `[<|start|>assistant]<|channel|>CH[ to=functions.NAME][ <|constrain|>json]<|message|>BODY TERM`
    where TERM is <|end|>, <|call|> (a tool call) or <|return|> (the final answer). The first
    message's `<|start|>assistant` is part of the prompt. Content = the `final` channel's text;
    reasoning = the `analysis` channel's text.
    """

    name = "harmony"
    # a turn stops on <|return|> (final answer) or <|call|> (a tool call); <|end|> ends one of its
    # messages (gpt-oss's generation_config.json stops on the same two)
    turn_ends = ("<|return|>", "<|call|>")
    message_ends = ("<|end|>",)

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
                arguments = decode_object(body, f"arguments of {name!r}")
                if isinstance(arguments, ToolCallError):
                    calls.append(dataclasses.replace(arguments, raw=chunk, name=name))
                else:
                    calls.append(make_call(name, arguments, len(calls), chunk))
            elif channel == "analysis":
                reasoning.append(body)
            elif channel == "final":
                final.append(body)
            else:
                other.append(body)
        content = "".join(final) if final else "".join(other)
        return ParsedTurn(content=content.strip(), calls=tuple(calls), reasoning="".join(reasoning).strip())


def _mistral_id(given: object, index: int) -> str:
    """Mistral's templates refuse any tool-call id but 9 letters or digits (and render it back):
    the model's own where it wrote one, else `call` and 5 digits."""
    if isinstance(given, str) and len(given) == 9 and given.isascii() and given.isalnum():
        return given
    return f"call{index:05d}"


class Llama3JsonFormat(FormatBase):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calling: a turn that is a call is the JSON object
    `{"name": ..., "parameters": {...}}` ("arguments" too), optionally after <|python_tag|>. A turn
    whose text (after that tag) does not start with '{' is an answer. Turns end with <|eot_id|>,
    or <|eom_id|> after a call. One call per turn, as Llama's templates render (they refuse an
    assistant message with more): calls written after the first (';'-separated) are not run, each
    an error observation saying so."""

    name = "llama3_json"
    turn_ends = ("<|eot_id|>", "<|eom_id|>")
    _SUFFIXES = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    _TAG = "<|python_tag|>"
    _ONE_CALL = True

    def parse(self, text: str) -> ParsedTurn:
        body = strip_suffixes(text, self._SUFFIXES).strip()
        tagged = body.startswith(self._TAG)
        if tagged:
            body = body[len(self._TAG):].strip()
        if not body.startswith("{"):
            return ParsedTurn(content=body if not tagged else "",
                              calls=(ToolCallError(f"{self._TAG} without a JSON tool call", raw=text),)
                              if tagged else ())
        calls = [item if isinstance(item, ToolCallError)
                 else named_call(item, i, raw, ("parameters", "arguments"))
                 for i, (item, raw) in enumerate(json_objects(body, "the tool call"))]
        for i in range(1, len(calls) if self._ONE_CALL else 0):
            if isinstance(calls[i], ToolCall):
                calls[i] = ToolCallError("Llama 3 calls one tool per turn: this call, after the first, was not run; "
                                         "call it in the next turn", raw=calls[i].raw, name=calls[i].name)
        return ParsedTurn(content="", calls=tuple(calls))


class Llama4JsonFormat(Llama3JsonFormat):
    """Llama 4's JSON tool calling: Llama 3's call objects, any number per turn (its template
    writes them one after another), optionally inside <|python_start|> ... <|python_end|>; turns
    end with <|eot|> or <|eom|>."""

    name = "llama4_json"
    turn_ends = ("<|eot|>", "<|eom|>")
    _SUFFIXES = ("<|eot|>", "<|eom|>", "<|end_of_text|>", "<|python_end|>")
    _TAG = "<|python_start|>"
    _ONE_CALL = False


class GraniteFormat(FormatBase):
    """IBM Granite 3: calls after <|tool_call|>, as a JSON list `[{"name": ..., "arguments": {...}}]`
    (the models' own output) or one object after each <|tool_call|> (vLLM's template); the text
    before the first is the content. Turns end with <|end_of_text|>."""

    name = "granite"
    _TAG = "<|tool_call|>"

    def parse(self, text: str) -> ParsedTurn:
        body = strip_suffixes(text, ("<|end_of_text|>",))
        start = body.find(self._TAG)
        if start < 0:
            return ParsedTurn(content=body.strip())
        calls: list = []
        for segment in body[start + len(self._TAG):].split(self._TAG):
            if not segment.strip():
                calls.append(ToolCallError(f"{self._TAG} without a JSON tool call", raw=self._TAG + segment))
            for value, raw in json_objects(segment, "the tool call") if segment.strip() else ():
                if isinstance(value, list):
                    calls += [named_call(obj, len(calls) + i, raw, ("arguments", "parameters"))
                              for i, obj in enumerate(value)] or [ToolCallError("an empty list of tool calls", raw=raw)]
                else:
                    calls.append(value if isinstance(value, ToolCallError)
                                 else named_call(value, len(calls), raw, ("arguments", "parameters")))
        return ParsedTurn(content=body[:start].strip(), calls=tuple(calls))


class MistralFormat(FormatBase):
    """Mistral / Mixtral tool calling: text, then `[TOOL_CALLS]` and either a JSON list of
    `{"name": ..., "arguments": {...}}` (tokenizer v3: Mistral 7B v0.3, Mixtral 8x22B) or
    `NAME[ARGS]{...}` (v11 and later: Mistral Small 3.2, Devstral; `NAME[CALL_ID]ID[ARGS]{...}`
    too), one `[TOOL_CALLS]` per call. The text before the first `[TOOL_CALLS]` is the content.
    Call ids are the model's own (an "id" key, or [CALL_ID]) where they are 9 letters or digits,
    else `call00000`, `call00001`, ... (errors too: their observations carry them): Mistral's
    templates refuse any other id."""

    name = "mistral"
    _SUFFIXES = ("</s>",)

    def parse(self, text: str) -> ParsedTurn:
        content, *segments = strip_suffixes(text, self._SUFFIXES).split("[TOOL_CALLS]")
        calls: list[ToolCall | ToolCallError] = []
        for segment in segments:
            raw = "[TOOL_CALLS]" + segment
            head, has_args, arguments = segment.partition("[ARGS]")
            if has_args:
                name, _, given_id = (part.strip() for part in head.partition("[CALL_ID]"))
                decoded = decode_object(arguments, f"arguments of {name!r}")
                calls.append(dataclasses.replace(decoded, raw=raw, name=name or None)
                             if isinstance(decoded, ToolCallError)
                             else make_call(name, decoded, len(calls), raw, _mistral_id(given_id, len(calls))))
                continue
            items = json_objects(segment, "[TOOL_CALLS]")
            if not items:
                calls.append(ToolCallError("[TOOL_CALLS] without a call", raw=raw))
            for item, _ in items:
                for one in (item if isinstance(item, list) else [item]):
                    given_id = one.get("id") if isinstance(one, dict) else None
                    calls.append(one if isinstance(one, ToolCallError)
                                 else named_call(one, len(calls), raw, ("arguments", "parameters"),
                                                  _mistral_id(given_id, len(calls))))
        # an error's observation is a tool message too, and the template checks its id as well
        calls = [dataclasses.replace(c, call_id=_mistral_id(None, i)) if isinstance(c, ToolCallError) else c
                 for i, c in enumerate(calls)]
        return ParsedTurn(content=content.strip(), calls=tuple(calls))


class Qwen3XmlFormat(FormatBase):
    """Qwen3-Coder / Qwen3.5 XML tool calls, after an optional `<think>` block:
    `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`.
    Values are text: each is read as the type its tool's schema declares (`with_tools`, which the
    agent loop calls with the trajectory's tool schemas)."""

    name = "qwen3_xml"
    turn_ends = ("<|im_end|>",)
    _SUFFIXES = ("<|im_end|>", "<|endoftext|>")
    call_tags, think_tags = ("<tool_call>", "</tool_call>"), ("<think>", "</think>")

    def __init__(self, properties: Mapping[str, Mapping[str, Any]] | None = None):
        self._properties = dict(properties or {})

    def with_tools(self, tools) -> "Qwen3XmlFormat":
        return type(self)(schema_properties(tools))

    def _decode(self, body: str, index: int, raw: str) -> ToolCall | ToolCallError:
        body = body.strip()
        if not body.startswith("<function="):
            return ToolCallError("a tool call must start with <function=NAME>", raw=raw)
        close = body.find(">")
        if close < 0:
            return ToolCallError("unterminated <function=NAME> tag", raw=raw)
        name = body[len("<function="):close].strip()
        rest = body[close + 1:].strip()
        if rest.endswith("</function>"):
            rest = rest[:-len("</function>")]
        props = self._properties.get(name, {})
        arguments, pos = {}, 0
        while (start := rest.find("<parameter=", pos)) >= 0:
            if rest[pos:start].strip():
                return ToolCallError(f"unexpected text in the call of {name!r}: {rest[pos:start].strip()[:30]!r}",
                                     raw=raw, name=name or None)
            head_end = rest.find(">", start)
            end = rest.find("</parameter>", head_end + 1) if head_end >= 0 else -1
            if end < 0:
                return ToolCallError(f"unterminated <parameter=...> in the call of {name!r}", raw=raw,
                                     name=name or None)
            key = rest[start + len("<parameter="):head_end].strip()
            value = rest[head_end + 1:end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            if key in arguments:
                return ToolCallError(f"parameter {key!r} given twice in the call of {name!r}", raw=raw,
                                     name=name or None)
            arguments[key] = xml_value(value, props.get(key))
            pos = end + len("</parameter>")
        return xml_call(name, arguments, rest[pos:], index, raw)

    def parse(self, text: str) -> ParsedTurn:
        reasoning, rest = split_reasoning(text, *self.think_tags)
        turn = tagged_calls(rest, *self.call_tags, self._decode, self._SUFFIXES)
        return dataclasses.replace(turn, reasoning=reasoning)


class SeedOssFormat(Qwen3XmlFormat):
    """ByteDance Seed-OSS tool calls: Qwen3-Coder's XML calls inside
    `<seed:tool_call>...</seed:tool_call>`, after an optional `<seed:think>` block (its template
    writes non-string values as Python's str of them, which `xml_value` reads by the schema).
    Turns end with <seed:eos>."""

    name = "seed_oss"
    turn_ends = _SUFFIXES = ("<seed:eos>",)
    call_tags, think_tags = ("<seed:tool_call>", "</seed:tool_call>"), ("<seed:think>", "</seed:think>")


class Glm45Format(Qwen3XmlFormat):
    """GLM-4.5 / 4.6 tool calls, after an optional `<think>` block: `<tool_call>NAME` then
    `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs (newlines between them) and
    `</tool_call>`; the template writes string values raw and the rest as JSON, so each value is
    read as its tool's schema declares (`with_tools`). A turn ends with the token that opens the
    next message, <|observation|> (tool results follow) or <|user|>, or with <|endoftext|>."""

    name = "glm45"
    turn_ends = _SUFFIXES = ("<|observation|>", "<|user|>", "<|endoftext|>")

    def with_tools(self, tools) -> "Glm45Format":
        return Glm45Format(schema_properties(tools))

    def _decode(self, body: str, index: int, raw: str) -> ToolCall | ToolCallError:
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        rest = "" if first < 0 else body[first:]
        props = self._properties.get(name, {})
        arguments, pos = {}, 0
        while (start := rest.find("<arg_key>", pos)) >= 0:
            if rest[pos:start].strip():
                return ToolCallError(f"unexpected text in the call of {name!r}: {rest[pos:start].strip()[:30]!r}",
                                     raw=raw, name=name or None)
            key_end = rest.find("</arg_key>", start)
            value_start = rest.find("<arg_value>", key_end) if key_end >= 0 else -1
            value_end = rest.find("</arg_value>", value_start) if value_start >= 0 else -1
            if value_end < 0 or rest[key_end + len("</arg_key>"):value_start].strip():
                return ToolCallError(f"an <arg_key> without its <arg_value> in the call of {name!r}", raw=raw,
                                     name=name or None)
            key = rest[start + len("<arg_key>"):key_end].strip()
            if key in arguments:
                return ToolCallError(f"argument {key!r} given twice in the call of {name!r}", raw=raw,
                                     name=name or None)
            arguments[key] = xml_value(rest[value_start + len("<arg_value>"):value_end], props.get(key))
            pos = value_end + len("</arg_value>")
        return xml_call(name, arguments, rest[pos:], index, raw)


FORMATS = {"compact": CompactFormat, "qwen3": Qwen3Format, "qwen3_xml": Qwen3XmlFormat, "harmony": HarmonyFormat,
           "llama3_json": Llama3JsonFormat, "llama4_json": Llama4JsonFormat, "mistral": MistralFormat,
           "pythonic": PythonicFormat, "granite": GraniteFormat, "olmo3": Olmo3Format,
           "deepseek_v3": DeepSeekFormat, "deepseek_v32": DeepSeekDsmlFormat, "kimi_k2": KimiK2Format,
           "minimax_m2": MiniMaxM2Format, "seed_oss": SeedOssFormat, "glm45": Glm45Format}

# What each built-in format's chat templates write, most specific first (harmony's templates
# also write <|call|>, the compact format's call tag; Qwen3-Coder's write <tool_call> around XML;
# the pythonic ones (Llama 3.2 / 4) keep Llama's ipython role, and show the list's shape; Llama
# 4's headers are <|header_start|>, Llama 3's <|start_header_id|>; OLMo 3's wrap its calls in
# <function_calls>; DeepSeek's write <｜tool▁calls▁begin｜> (V3.2's its DSML token ｜DSML｜, which its
# template keeps in a variable), Kimi K2's <|tool_calls_section_begin|>, MiniMax-M2's <minimax:tool_call>,
# Seed-OSS's <seed:tool_call> (around Qwen3-Coder's <function=...>, so before qwen3_xml);
# GLM-4.5's <tool_call> holds <arg_key>s).
_TEMPLATE_MARKERS = (("harmony", ("<|channel|>",)), ("deepseek_v32", ("｜DSML｜",)),
                     ("minimax_m2", ("<minimax:tool_call>",)), ("seed_oss", ("<seed:tool_call>",)),
                     ("olmo3", ("<function_calls>",)),
                     ("deepseek_v3", ("<｜tool▁calls▁begin｜>",)), ("kimi_k2", ("<|tool_calls_section_begin|>",)),
                     ("glm45", ("<arg_key>",)),
                     ("qwen3_xml", ("<function=",)),
                     ("qwen3", ("<tool_call>",)), ("mistral", ("[TOOL_CALLS]",)), ("pythonic", ("[func_name1(",)),
                     ("llama4_json", ("<|header_start|>",)), ("llama3_json", ("<|python_tag|>", "ipython")),
                     ("granite", ("<|tool_call|>",)), ("compact", ("<|call|>",)))


def renders_tool_calls(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads an assistant message's `tool_calls` (assumed so
    where the tokenizer does not show its template). SmolLM3's shows the content alone."""
    source = getattr(tokenizer, "chat_template_source", None)
    return not isinstance(source, str) or template_reads_key(source, "tool_calls")


def infer_format(chat_template: str | None) -> str | None:
    """The built-in format whose markup `chat_template` writes (None: none recognised).

    Markers are tried most specific first (see `_TEMPLATE_MARKERS`); the first format with a
    marker found in the template wins.

    Args:
      chat_template: the chat template's Jinja source; None or empty recognises nothing.
    Returns:
      The name of a built-in format (a key of `FORMATS`), or None when no marker is found.
    """
    if not chat_template:
        return None
    for name, markers in _TEMPLATE_MARKERS:
        if any(m in chat_template for m in markers):
            return name
    return None


def get_format(fmt: "str | ToolCallFormat") -> ToolCallFormat:
    """A built-in format by name, or `fmt` itself when it is a format value (has `parse`).

    Args:
      fmt: a built-in format's name (a key of `FORMATS`, e.g. 'qwen3'), or a format value with a
        callable `parse(text) -> ParsedTurn`.
    Returns:
      A new instance of the named built-in format, or `fmt` itself when it is a format value.
    Raises:
      TypeError: `fmt` is neither a string nor a value with a callable `parse`.
      ValueError: `fmt` is a string that names no built-in format.
    """
    if not isinstance(fmt, str):
        if callable(getattr(fmt, "parse", None)):
            return fmt
        raise TypeError(f"a tool-call format is a built-in's name {sorted(FORMATS)} or a value with "
                        f"parse(text) -> ParsedTurn, got {fmt!r}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {sorted(FORMATS)}")
    return FORMATS[fmt]()


def trajectory_format(tool_format: "str | ToolCallFormat | None", tokenizer, tools) -> ToolCallFormat:
    """The format a trajectory's turns are read with: `format_for`, bound to `tools` (None: no
    tools) where the format reads values by their schemas (`with_tools`)."""
    fmt = format_for(tool_format, tokenizer, tools is not None)
    bind = getattr(fmt, "with_tools", None)
    return bind(tools or []) if bind is not None else fmt


def format_for(tool_format: "str | ToolCallFormat | None", tokenizer, has_tools: bool) -> ToolCallFormat:
    """The format a trajectory is parsed with: `tool_format` when given, else the one the
    tokenizer's chat template writes (`infer_format` of its `chat_template_source`). A tokenizer
    of the user's own that shows no template source (`TokenizerProtocol` does not ask for one)
    gets the compact format, the library's own. Where a template writes none this library
    reads, a rollout with tools is refused (its calls would be read as answers); one without
    tools has no calls to read."""
    if tool_format is not None:
        return get_format(tool_format)
    template = getattr(tokenizer, "chat_template_source", None)
    name = infer_format(template)
    if name is not None:
        return get_format(name)
    if template is None or not has_tools:
        return CompactFormat()
    raise ValueError(f"AgentConfig.tool_format is None (the chat template's) but the tokenizer's chat template "
                     f"writes no tool-call markup this library reads: set AgentConfig.tool_format to a built-in "
                     f"({sorted(FORMATS)}) or a format value")
