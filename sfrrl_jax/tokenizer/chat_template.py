"""The compact chat format of our tiny tokenizer, and the jinja2 environment chat templates run in.

Compact format (every boundary is a special token, so a split between any two rendered pieces
is also a token boundary: no merge can straddle a message or a tool call):

    <|bos|><|system|>{system}<|tools|>{schema JSON}\\n{schema JSON}\\n<|end|>
    <|user|>{text}<|end|>
    <|assistant|>{text}<|call|>{name}{arguments JSON}<|/call|><|call|>...<|/call|><|end|>
    <|tool|>{result of call 1}<|end|><|tool|>{result of call 2}<|end|>
    <|assistant|>                                   <- generation prompt

JSON is written without spaces (separators ',' and ':'). The assistant ends its turn with
`<|end|>` (the end-of-turn / stop token); tool results come back one `<|tool|>` block per call,
in call order. A final answer is plain assistant text (tasks ask for `<answer>...</answer>`).
"""
from __future__ import annotations

import datetime
import json

import jinja2
import jinja2.meta
import jinja2.nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, TOOL, END = "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"
TOOLS, CALL, CALL_END = "<|tools|>", "<|call|>", "<|/call|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, TOOL, END, TOOLS, CALL, CALL_END)

# Tools may be given OpenAI style ({"type": "function", "function": {...}}) or bare ({"name": ...}).
COMPACT_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(start=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}{%- set ns.start = 1 -%}{%- endif -%}"
    "{%- if ns.start == 1 or tools -%}"
    "<|system|>{%- if ns.start == 1 -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- if tools -%}<|tools|>"
    "{%- for tool in tools -%}"
    "{{- (tool.function if tool.function is defined else tool) | tojson(separators=(',', ':')) -}}{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- endif -%}<|end|>"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- if message.role == 'user' -%}<|user|>{{- message.content -}}<|end|>"
    "{%- elif message.role == 'assistant' -%}<|assistant|>"
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "<|call|>{{- fn.name -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- fn.arguments | tojson(separators=(',', ':')) -}}{%- endif -%}"
    "<|/call|>"
    "{%- endfor -%}<|end|>"
    "{%- elif message.role == 'tool' -%}<|tool|>{{- message.content -}}<|end|>"
    "{%- elif message.role == 'system' -%}<|system|>{{- message.content -}}<|end|>"
    "{%- else -%}{{- raise_exception('unknown message role: ' ~ message.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


class ChatTemplateError(ValueError):
    """A template raised (raise_exception) or failed to render."""


def _raise_exception(message):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Same signature and defaults as the filter Hugging Face templates are written against.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment HF templates expect (trim/lstrip blocks, tojson, ...)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: line {e.lineno}: {e.message}") from e


def template_reads_key(source: str, key: str) -> bool:
    """Whether a chat template reads `key` of some object (`message.tool_calls`,
    `message['tool_calls']`, `'tool_calls' in message`): an attribute or a string constant of
    that name in its code, not in its text or comments."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: line {e.lineno}: {e.message}") from e
    return any(n.attr == key for n in tree.find_all(jinja2.nodes.Getattr)) or any(
        n.value == key for n in tree.find_all(jinja2.nodes.Const))


def template_variables(source: str) -> set[str]:
    """The variables a chat template reads from its caller (`messages`, `tools`, SmolLM3's
    `xml_tools`, ...), not counting the ones it sets itself."""
    try:
        return set(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: line {e.lineno}: {e.message}") from e
