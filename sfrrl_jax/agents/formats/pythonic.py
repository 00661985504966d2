"""The pythonic tool-call formats: Llama 3.2 / Llama 4 / Gemma 3 prompts' list, `[f(a=1), g(b="x")]`,
and OLMo 3's calls one per line inside <function_calls> ... </function_calls>.

Read with `ast`, never evaluated: literals only (strings, numbers, True/False/None and JSON's
true/false/null, lists, tuples, dicts with string keys). The list may be the whole turn, or end
it after text; a bad call is an error in its place, and a turn that starts a list and does not
parse is one error. Hostile texts are bounded (at most 16 list starts, each filtered by a bracket
scan before it is parsed).
"""
from __future__ import annotations

import ast
import dataclasses
import re
import warnings

from sfrrl_jax.agents.formats.call_text import (FormatBase, ParsedTurn, make_call, split_reasoning, strip_suffixes,
                                                tagged_calls)
from sfrrl_jax.agents.protocols import ToolCall, ToolCallError


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.]*\s*\(")
_PYTHONIC_NAMES = {"true": True, "false": False, "null": None}   # JSON spellings some models write


_BRACKETS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[\[\]()]')


def _closes_at_end(text: str, start: int) -> bool:
    """Whether the bracket opened at `start` closes at the end of `text` (string literals
    skipped): a cheap filter before parsing; the parse decides."""
    depth = 0
    for m in _BRACKETS.finditer(text, start):
        token = m.group()
        if token in "[(":
            depth += 1
        elif token in "])":
            depth -= 1
            if depth == 0:
                return m.end() == len(text)
    return False


class _NotLiteral(ValueError):
    pass


def _python_literal(node: ast.AST) -> object:
    """A call argument's value: Python literals (strings, numbers, True/False/None, lists,
    tuples as lists, dicts with string keys) and JSON's true/false/null; nothing is evaluated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.Name) and node.id in _PYTHONIC_NAMES:
        return _PYTHONIC_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_python_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NotLiteral("a dict key that is not a string")
            out[key.value] = _python_literal(value)
        return out
    raise _NotLiteral(f"{type(node).__name__.lower()} where a literal value belongs")


def _dotted_name(node: ast.AST) -> str | None:
    """`a.b.c` of a call's function, or None (a loop: a chain thousands deep is one hostile turn)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


class PythonicFormat(FormatBase):
    """Pythonic tool calls (Llama 3.2 / Llama 4 / Gemma 3 prompts): a Python list of calls with
    keyword arguments, `[get_weather(city="Paris"), add(a=1, b=2)]`, as the turn's text or at its
    end after some text (Llama 4's template writes the content, then the list), optionally inside
    <|python_start|> ... <|python_end|>. Arguments are literals, read with `ast` (never
    evaluated). A turn that starts with such a list and does not parse is one error observation;
    a list inside prose is prose. Turns end with <|eot_id|>/<|eom_id|> (Llama 3.2) or
    <|eot|>/<|eom|> (Llama 4)."""

    name = "pythonic"
    turn_ends = ("<|eot_id|>", "<|eom_id|>", "<|eot|>", "<|eom|>")
    _SUFFIXES = ("<|eot_id|>", "<|eom_id|>", "<|eot|>", "<|eom|>", "<|end_of_text|>", "<end_of_turn>",
                 "<|python_end|>")

    def parse(self, text: str) -> ParsedTurn:
        body = strip_suffixes(text, self._SUFFIXES).strip()
        for tag in ("<|python_start|>", "<|python_tag|>"):
            body = body.replace(tag, "", 1) if tag in body else body
        body = body.strip()
        starts = [m.start() for m in _PYTHONIC_START.finditer(body)]
        if not starts or not body.endswith("]"):
            return (ParsedTurn(content=body) if not (starts and starts[0] == 0)
                    else self._error(body, "a turn that starts a call list must end with its closing ]"))
        # the list is the whole turn, or ends it after some text: the first start whose rest parses.
        # At most 16 starts are looked at (each costs a scan), and one whose brackets close before
        # the end is not parsed at all.
        for start in starts[:16]:
            if start > 0 and not _closes_at_end(body, start):
                continue
            calls = self._calls(body[start:])
            if not isinstance(calls, ToolCallError):
                return ParsedTurn(content=body[:start].strip(), calls=calls)
            if start == 0:   # the turn starts a call list: what cannot be read is its error
                return ParsedTurn(content="", calls=(calls,))
        return ParsedTurn(content=body)

    @staticmethod
    def _error(raw: str, why: str) -> ParsedTurn:
        return ParsedTurn(content="", calls=(ToolCallError(f"malformed pythonic tool call list: {why}", raw=raw),))

    @staticmethod
    def _calls(source: str) -> tuple[ToolCall | ToolCallError, ...] | ToolCallError:
        """The calls of `source` (a whole Python list expression), each a call or its error; an
        error when `source` is not a list of calls at all."""
        tree = _parse(source, "eval")
        if isinstance(tree, ToolCallError):
            return tree
        tree = tree.body
        if not isinstance(tree, ast.List) or not tree.elts or not all(isinstance(e, ast.Call) for e in tree.elts):
            return ToolCallError("malformed pythonic tool call list: expected [name(key=value, ...), ...]",
                                 raw=source)
        return _read_calls(source, tree.elts, 0)


def _parse(source: str, mode: str) -> ast.AST | ToolCallError:
    """`ast.parse(source, mode)`, or the error a model's malformed text is."""
    try:
        with warnings.catch_warnings():  # "\d" in a string is a SyntaxWarning; the value stands
            warnings.simplefilter("ignore")
            return ast.parse(source, mode=mode)
    except (SyntaxError, ValueError) as e:
        return ToolCallError(f"malformed pythonic tool call list: {getattr(e, 'msg', None) or e}", raw=source)
    except (RecursionError, MemoryError) as e:  # CPython's parser gives up on deep nesting so
        why = f"nested too deeply ({type(e).__name__})"
        return ToolCallError(f"malformed pythonic tool call list: {why}", raw=source)


def _read_calls(source: str, nodes: list[ast.Call], first_index: int) -> tuple[ToolCall | ToolCallError, ...]:
    """Each call node of `source`'s tree as a call (ids from `first_index` on) or its error."""
    calls: list[ToolCall | ToolCallError] = []
    encoded = source.encode()   # ast's offsets count UTF-8 bytes (get_source_segment: O(n) a call)
    line_starts = [0] + [m.end() for m in re.finditer(rb"\n", encoded)]
    for index, node in enumerate(nodes, first_index):
        raw = encoded[line_starts[node.lineno - 1] + node.col_offset:
                      line_starts[node.end_lineno - 1] + node.end_col_offset].decode(errors="replace")
        name = _dotted_name(node.func)
        try:
            if node.args:
                raise _NotLiteral("positional arguments: pass every argument as key=value")
            if any(k.arg is None for k in node.keywords):
                raise _NotLiteral("**arguments: pass every argument as key=value")
            arguments = {k.arg: _python_literal(k.value) for k in node.keywords}
        except (_NotLiteral, RecursionError) as e:
            calls.append(ToolCallError(f"arguments of {name!r}: {e or 'nested too deeply'}", raw=raw, name=name))
            continue
        calls.append(make_call(name, arguments, index, raw))
    return tuple(calls)


class Olmo3Format(FormatBase):
    """OLMo 3 Instruct / Think: calls inside <function_calls> ... </function_calls>, one
    `name(key=value, ...)` a line, values as its template writes them (JSON: true/false/null,
    "strings") or Python literals; a Llama-style `[f(), g()]` list inside the tags is read too.
    The text outside the tags is the content, a <think> block the reasoning. A block that does
    not parse, holds anything but calls, or is not closed is one error. The template ends the
    conversation's last answer with <|endoftext|> and earlier ones with <|im_end|>: both end a
    turn."""

    name = "olmo3"
    turn_ends = ("<|im_end|>", "<|endoftext|>")
    _OPEN, _CLOSE = "<function_calls>", "</function_calls>"

    def parse(self, text: str) -> ParsedTurn:
        reasoning, rest = split_reasoning(text)
        turn = tagged_calls(strip_suffixes(rest, self.turn_ends), self._OPEN, self._CLOSE, self._block, ())
        return dataclasses.replace(turn, reasoning=reasoning)

    def _block(self, source: str, first_index: int, raw: str) -> tuple[ToolCall | ToolCallError, ...]:
        text = source.strip()
        tree = _parse(text, "exec") if text else ToolCallError(f"{self._OPEN} without a call", raw=raw)
        if isinstance(tree, ToolCallError):
            return (ToolCallError(tree.message, raw=raw),)
        values = [stmt.value if isinstance(stmt, ast.Expr) else None for stmt in tree.body]
        if len(values) == 1 and isinstance(values[0], ast.List) and values[0].elts:
            values = list(values[0].elts)    # [f(), g()] inside the tags
        if not values or not all(isinstance(v, ast.Call) for v in values):
            return (ToolCallError(f"malformed tool calls: {self._OPEN} holds one name(key=value, ...) a line",
                                  raw=raw),)
        return _read_calls(text, values, first_index)
