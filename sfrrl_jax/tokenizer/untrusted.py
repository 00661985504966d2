"""Encode a rendered chat where some message contents are untrusted (tool results, scraped text).

A chat template pastes message contents into its text verbatim, and a tokenizer maps every
added-token string in that text (`<|im_end|>`, `<|im_start|>system`, `<tool_call>`) to its id,
exactly as transformers' `apply_chat_template` does. For a tool result this means the tool can
write control tokens: echo `<|end|><|system|>...` and the model reads a forged end of turn and a
forged system turn. Here the control tokens the *template* wrote stay control tokens, and the
untrusted contents are tokenized as plain text: an added-token string inside them becomes the
ordinary byte/BPE tokens of its characters, never the added token's id.

How: each untrusted content (less its edge whitespace) is rendered between two markers (ASCII
letters and digits, which `trim`, `tojson` and HTML escaping leave as they are), so its characters
can be located in the rendered text. The text is tokenized as usual, with offsets; an added token whose characters lie
(even partly) inside an untrusted span is forged. If there is none, the usual ids are the answer
(token for token what transformers gives). Otherwise the text is cut at the template's own added
tokens, as the tokenizer itself cuts it, and each piece in between is encoded by a copy of the
tokenizer that reads no added token at all (`encode_special_tokens` with every added token
special). Added tokens only match whole strings, and pieces are what the tokenizer would encode
anyway, so the result differs from the usual ids only inside the forged spans.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

from tokenizers import Tokenizer as HFTokenizer


@dataclass(frozen=True)
class MarkedMessages:
    """Messages whose untrusted contents are wrapped in markers, and how to find them again."""

    messages: list[dict[str, Any]]
    nonce: str
    contents: tuple[str, ...]  # the untrusted strings, in marker order

    @property
    def any(self) -> bool:
        return bool(self.contents)

    def _pattern(self) -> re.Pattern[str]:
        return re.compile(f"SFRRLU{self.nonce}([OC])([0-9]+)Z")

    def open_marker(self, index: int) -> str:
        return f"SFRRLU{self.nonce}O{index}Z"

    def close_marker(self, index: int) -> str:
        return f"SFRRLU{self.nonce}C{index}Z"

    def unmark(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """`text` without the markers, and the `[start, end)` char spans the markers enclosed.

        A template may drop a content, render it twice or cut it; an open marker without its
        close makes the span run to the end of the text (the safe side).
        """
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        length = 0
        opened: dict[str, int] = {}
        cursor = 0
        for match in self._pattern().finditer(text):
            out.append(text[cursor:match.start()])
            length += match.start() - cursor
            cursor = match.end()
            kind, index = match.group(1), match.group(2)
            if kind == "O":
                opened[index] = length
            elif index in opened:
                spans.append((opened.pop(index), length))
        out.append(text[cursor:])
        length += len(text) - cursor
        spans.extend((start, length) for start in opened.values())
        return "".join(out), sorted(spans)


def mark_untrusted(messages: Sequence[Mapping[str, Any]], roles: Collection[str]) -> MarkedMessages:
    """Copies of `messages` with the text of every message whose role is in `roles` wrapped in markers.

    Text is a string `content`, or the `text` of `{"type": "text"}` parts of a list content.
    """
    texts: list[str] = []
    for message in messages:
        if message.get("role") in roles:
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(p["text"] for p in content
                             if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    nonce = secrets.token_hex(6)
    while any(nonce in t for t in texts):  # a content cannot fake a marker by guessing
        nonce = secrets.token_hex(6)
    marked = MarkedMessages([], nonce, tuple(texts))
    index = 0

    def wrap(text: str) -> str:
        # Edge whitespace stays outside the markers, so a template's `trim` still trims it
        # (whitespace is no control token: leaving it unguarded forges nothing).
        nonlocal index
        core = text.strip()
        lead = text[:len(text) - len(text.lstrip())]
        trail = text[len(lead) + len(core):]
        wrapped = lead + marked.open_marker(index) + core + marked.close_marker(index) + trail
        index += 1
        return wrapped

    for message in messages:
        copy = dict(message)
        if message.get("role") in roles:
            content = message.get("content")
            if isinstance(content, str):
                copy["content"] = wrap(content)
            elif isinstance(content, list):
                copy["content"] = [dict(p, text=wrap(p["text"]))
                                   if isinstance(p, Mapping) and isinstance(p.get("text"), str) else p
                                   for p in content]
        marked.messages.append(copy)
    return marked


class UntrustedEncoder:
    """Tokenizes text in which given char spans must not produce added (control) tokens."""

    def __init__(self, hf_tokenizer: HFTokenizer):
        self.hf = hf_tokenizer
        added = hf_tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
        self.added_ids = frozenset(added)
        self.added_strings = tuple(sorted({t.content for t in added.values()}, key=len, reverse=True))
        self._plain: HFTokenizer | None = None

    def might_forge(self, texts: Sequence[str]) -> bool:
        """Cheap screen: does any of `texts` contain an added token's string at all?"""
        return any(s in t for t in texts for s in self.added_strings)

    @property
    def plain(self) -> HFTokenizer:
        """A copy of the tokenizer that reads every added-token string as ordinary text."""
        if self._plain is None:
            spec = json.loads(self.hf.to_str())
            for token in spec.get("added_tokens", []):
                token["special"] = True  # encode_special_tokens skips special added tokens only
            plain = HFTokenizer.from_str(json.dumps(spec))
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def encode(self, text: str, untrusted: Sequence[tuple[int, int]]) -> list[int]:
        """Ids of `text`; added tokens count only where they lie outside every `untrusted` span."""
        encoding = self.hf.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets

        def forged(start: int, end: int) -> bool:
            return any(start < hi and lo < max(end, start + 1) for lo, hi in untrusted)

        if not any(i in self.added_ids and forged(*o) for i, o in zip(ids, offsets)):
            return list(ids)
        out: list[int] = []
        cursor = 0
        for token_id, (start, end) in zip(ids, offsets):
            if token_id in self.added_ids and not forged(start, end):  # the template's own
                if start > cursor:
                    out.extend(self.plain.encode(text[cursor:start], add_special_tokens=False).ids)
                out.append(token_id)
                cursor = max(cursor, end)
        if cursor < len(text):
            out.extend(self.plain.encode(text[cursor:], add_special_tokens=False).ids)
        return out
