"""Load any HF tokenizer directory (ours or e.g. Qwen3's) with `tokenizers` + `jinja2` only.

`Tokenizer.apply_chat_template` renders the directory's own chat template and tokenizes it the
way transformers does (special-token strings in the text map to their ids; nothing is added).
`Tokenizer.render_delta` renders only what follows the last assistant turn (tool results and the
next generation prompt), for appending to a trajectory whose generated tokens stay as generated.
Tool results are untrusted: control-token text inside them is encoded as plain text
(`sfrrl_jax.tokenizer.untrusted`), so a tool cannot forge an end of turn or a system turn.
"""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from tokenizers import Tokenizer as HFTokenizer

from sfrrl_jax.tokenizer.chat_template import ChatTemplateError, compile_chat_template, template_variables
from sfrrl_jax.tokenizer.untrusted import UntrustedEncoder, mark_untrusted

# Tried in order when a directory does not name its end-of-turn token (`end_of_turn_token`).
_KNOWN_END_OF_TURN = ("<|end|>", "<|im_end|>", "<|eot_id|>", "<|return|>", "<end_of_turn>")


class TemplateDeltaError(ValueError):
    """The chat template is not append-only at this point, so a delta cannot be rendered."""


def _token_string(value: Any) -> str | None:
    if isinstance(value, Mapping):  # HF AddedToken serialisation
        return value.get("content")
    return value


class Tokenizer:
    """A tokenizer plus its chat template. Ids are plain Python ints."""

    def __init__(self, hf_tokenizer: HFTokenizer, config: Mapping[str, Any], chat_template: str | None,
                 name: str = "<memory>", generation_eos_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        # generation_config.json's eos_token_id (what HF `generate` stops on): Llama 3.1's list
        # holds <|eom_id|>, gpt-oss's <|call|>, neither of which the tokenizer config names
        self.generation_eos_ids = tuple(generation_eos_ids)
        self.config = dict(config)
        self.name = name
        self.chat_template_source = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        # SmolLM3's template reads the tools from `xml_tools` and ignores HF's `tools`
        self._xml_tools = bool(chat_template) and "xml_tools" in template_variables(chat_template)
        self.bos_token = _token_string(config.get("bos_token"))
        self.eos_token = _token_string(config.get("eos_token"))
        self.pad_token = _token_string(config.get("pad_token"))
        eot = _token_string(config.get("end_of_turn_token"))
        if eot is None:  # a known end-of-turn token that the chat template actually writes, else eos
            eot = next((t for t in _KNOWN_END_OF_TURN
                        if hf_tokenizer.token_to_id(t) is not None and t in (chat_template or "")), self.eos_token)
        self.end_of_turn_token = eot
        self.template_kwargs: dict[str, Any] = {}   # `with_template_kwargs`
        self._untrusted = UntrustedEncoder(hf_tokenizer)
        for field in ("bos_token", "eos_token", "pad_token", "end_of_turn_token"):
            token = getattr(self, field)
            if token is not None and hf_tokenizer.token_to_id(token) is None:
                raise ValueError(f"{name}: {field} {token!r} is not in the vocabulary")

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def end_of_turn_id(self) -> int | None:
        return self._id(self.end_of_turn_token)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn: end-of-turn, eos, then generation_config.json's eos
        ids (deduplicated). A tool-call format may refine them (`agents.formats.registry.turn_stop_ids`:
        gpt-oss's <|end|> closes a message inside a turn)."""
        ids = [i for i in (self.end_of_turn_id, self.eos_id) if i is not None]
        return tuple(dict.fromkeys(ids + list(self.generation_eos_ids)))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings become their ids; no bos/eos is added.

        A Python str may hold lone surrogates (e.g. a tool echoing '\\ud800' decoded from JSON),
        which are not UTF-8 and which the Rust tokenizer refuses with a TypeError; they become
        U+FFFD, as any UTF-8 decoder would show them.
        """
        return self.hf.encode(_without_surrogates(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def with_template_kwargs(self, **template_kwargs: Any) -> "Tokenizer":
        """This tokenizer, its chat template rendered with these variables too in every call
        (the prompt, the deltas, SFT examples): Qwen3's `enable_thinking=False`, gpt-oss's
        `reasoning_effort='high'`. A call's own keyword arguments still win."""
        twin = copy.copy(self)
        twin.template_kwargs = {**self.template_kwargs, **template_kwargs}
        return twin

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False, **template_kwargs: Any) -> str:
        """The chat template's text for `messages` (HF semantics, incl. the `tools` variable; a
        template that reads its tools from `xml_tools` instead, SmolLM3's, gets them there too
        unless the call or `with_template_kwargs` gives that variable)."""
        if self._template is None:
            raise ChatTemplateError(f"{self.name}: the tokenizer directory has no chat_template")
        tools = list(tools) if tools else None
        extra = {"xml_tools": tools} if self._xml_tools else {}
        return self._template.render(
            messages=list(messages), tools=tools,
            add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", pad_token=self.pad_token or "",
            **{**extra, **self.template_kwargs, **template_kwargs})

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = False, untrusted_roles: Collection[str] = (),
                            **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered chat. Contents of messages whose role is in `untrusted_roles`
        never yield added (control) tokens: their `<|end|>` text is the plain tokens of '<|end|>'."""
        marked = mark_untrusted(messages, untrusted_roles) if untrusted_roles else None
        if marked is None or not self._untrusted.might_forge(marked.contents):
            return self.encode(self.render(messages, tools, add_generation_prompt, **template_kwargs))
        text, spans = marked.unmark(self.render(marked.messages, tools, add_generation_prompt, **template_kwargs))
        return self._untrusted.encode(_without_surrogates(text), spans)

    def render_delta(self, history: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                     stop_text: str | None = None, untrusted_roles: Collection[str] = ("tool",),
                     **template_kwargs: Any) -> list[int]:
        """Tokens to append after the assistant's last turn, which ended with `stop_text`.

        `history` ends with that assistant message. The delta is the full render of
        `history + new_messages` minus the render of `history` cut right after its last
        `stop_text` (the end-of-turn token by default): prefix tokens + generated tokens + delta
        then equal the full render, token for token, whenever the cut is a token boundary (it is
        for special-token stops). Raises TemplateDeltaError if the template is not append-only.

        Contents of new messages whose role is in `untrusted_roles` (tool results by default) never
        yield added tokens: a tool echoing '<|end|><|system|>' is read as that text, not as a
        forged end of turn (`sfrrl_jax.tokenizer.untrusted`). Where no such content holds any
        added-token string, the ids are exactly the tokenization of the rendered text.
        """
        stop_text = stop_text or self.end_of_turn_token
        before = self.render(history, tools, add_generation_prompt=False, **template_kwargs)
        turn_at, floor = self._turn_start(history, before, tools, template_kwargs)
        after = self.render(list(history) + list(new_messages), tools, add_generation_prompt, **template_kwargs)
        if self._closes_nothing(before, after, stop_text, floor):
            # GLM-4.5's template closes no turn: the stop the model generated (<|observation|>,
            # <|user|>) is the opener of the next message, and the delta starts after it; after
            # another stop (or none: the turn ran out of tokens) the delta starts with the opener
            opener = after.startswith(before + stop_text)
            cut, prefix = len(before), before + stop_text if opener else before
        else:
            cut, stop_text = self._turn_close(before, stop_text, floor)
            prefix = before[:cut + len(stop_text)]
        start = self._delta_start(prefix, before[:cut], after, turn_at, stop_text, new_messages)
        if start is None:
            at = next((i for i, (a, b) in enumerate(zip(prefix, after)) if a != b), min(len(prefix), len(after)))
            raise TemplateDeltaError(
                f"{self.name}: chat template re-renders history differently once new messages follow "
                f"(first difference at char {at}: {prefix[at:at + 40]!r} vs {after[at:at + 40]!r})")
        marked = mark_untrusted(new_messages, untrusted_roles) if untrusted_roles else None
        if marked is None or not self._untrusted.might_forge(marked.contents):
            return self.encode(after[start:])
        # Rendered again with the untrusted contents between markers, to know where they lie.
        after = self.render(list(history) + marked.messages, tools, add_generation_prompt, **template_kwargs)
        start = self._delta_start(prefix, before[:cut], after, turn_at, stop_text, new_messages)
        if start is None:
            raise TemplateDeltaError(f"{self.name}: chat template renders history differently once "
                                     "untrusted contents are marked")
        text, spans = marked.unmark(after[start:])
        return self._untrusted.encode(_without_surrogates(text), spans)

    def _turn_start(self, history, before: str, tools, template_kwargs) -> tuple[int, int]:
        """(where the assistant turn that ends `history` starts in `before`, its render: the end
        of the history before it; the same with the generation prompt). (0, 0) where there is no
        such turn or the shorter history cannot be rendered."""
        if not history or history[-1].get("role") != "assistant":
            return 0, 0
        try:
            closed = self.render(history[:-1], tools, add_generation_prompt=False, **template_kwargs)
            opened = self.render(history[:-1], tools, add_generation_prompt=True, **template_kwargs)
        except Exception:  # a template that cannot render the shorter history: no floor
            return 0, 0
        return (len(os.path.commonprefix([closed, before])), len(os.path.commonprefix([opened, before])))

    def _closes_nothing(self, before: str, after: str, stop_text: str, floor: int) -> bool:
        """Whether the template writes no close of the turn that ends `before` (none of the stops
        after where the turn starts, `floor` > 0) and renders the history alike once new messages
        follow: the next message's opener is then what ends the turn."""
        if floor <= 0 or not after.startswith(before):
            return False
        return all(before.rfind(close) < floor for close in {stop_text, *self._closes()} if close)

    def _turn_close(self, before: str, stop_text: str, floor: int) -> tuple[int, str]:
        """(where the close of the assistant turn that ends `before` starts, its text).

        The turn's own stop where the template renders it there; else the last close the template
        writes for that turn (its end-of-turn, eos, a generation_config stop): a turn that stopped
        on EOS where the template writes end-of-turn, or gpt-oss's turn whose call did not parse
        (the template renders the message as an answer, closed by <|return|>). Never a close
        before the turn starts (`floor`, `_turn_start`): cutting there would append the turn a
        second time."""
        at = before.rfind(stop_text)
        if at >= floor:
            return at, stop_text
        closes = self._closes()
        found = [(before.rfind(t), t) for t in closes if before.rfind(t) >= floor]
        if not found:
            raise TemplateDeltaError(f"{self.name}: the rendered history has no {stop_text!r} (nor another close "
                                     f"of the turn, {closes}) after the last assistant turn starts")
        return max(found, key=lambda pair: pair[0] + len(pair[1]))

    def _closes(self) -> list[str]:
        """The texts of the tokens that may close a turn (`stop_token_ids`)."""
        return [self.hf.id_to_token(i) for i in self.stop_token_ids]

    def _delta_start(self, prefix: str, body: str, after: str, turn_at: int, stop_text: str,
                     new_messages: Sequence[Mapping[str, Any]]) -> int | None:
        """Where the delta starts in `after` (the render with the new messages), or None.

        Right after `prefix` (the history up to and with the turn's stop) when `after` repeats
        it. Else right after the template's own end-of-turn where it closes the turn with that
        once the turn is not the last (gpt-oss ends the conversation's last answer with
        <|return|>, the stop the model generated, and an earlier one with <|end|>). Else the
        template renders the history otherwise once more follows: the turn itself (Qwen3 writes
        an empty <think></think> into the last assistant turn only, and with enable_thinking off
        into its generation prompt), or what comes before it (Mistral writes the tools, and v3
        the system prompt, before the last user message only). Then the turn ends at the same
        count of its close as before, and the delta starts after it; it must hold the new
        messages' contents. The trajectory keeps the tokens the model generated in every case;
        in the last case the delta repeats what the template moved after the turn (the tools
        block before a new user message, as a fresh render shows it)."""
        if after.startswith(prefix):
            return len(prefix)
        eot = self.end_of_turn_token
        if eot and after.startswith(body + eot):
            return len(body) + len(eot)
        contents = [m.get("content") for m in new_messages]
        # the same prefix up to the turn: count its closes from there; else all of them
        start_at = turn_at if 0 < turn_at <= len(body) and after[:turn_at] == prefix[:turn_at] else 0
        for close in dict.fromkeys([stop_text, *([eot] if eot else []), *self._closes()]):
            at = start_at
            for _ in range(body.count(close, start_at) + 1):
                at = after.find(close, at)
                if at < 0:
                    break
                at += len(close)
            else:
                delta = after[at:]
                if all(_rendered_in(c, delta) for c in contents if isinstance(c, str) and c.strip()):
                    return at
        return None


def _rendered_in(content: str, text: str) -> bool:
    """Whether a message's `content` appears in `text` as templates write it: as it is, trimmed,
    or as a JSON string's inside (`| tojson`, gpt-oss's and Llama 4's tool results)."""
    core = content.strip()
    return any(form in text for form in (core, json.dumps(core)[1:-1], json.dumps(core, ensure_ascii=False)[1:-1]))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(text: str) -> str:
    """Lone surrogates (not UTF-8; the Rust tokenizer refuses them) become U+FFFD, one char each."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja` if present) from `path`.

    The chat template is the config's `chat_template` (of a list of named templates, the one named "default"),
    else `chat_template.jinja`; a `generation_config.json`'s `eos_token_id` (an id or a list) becomes
    `Tokenizer.generation_eos_ids`.

    Args:
      path: the tokenizer (or HF model) directory; `tokenizer_config.json` is optional.
    Returns:
      The `Tokenizer`, named after the directory.
    Raises:
      FileNotFoundError: when the directory has no `tokenizer.json`.
      ValueError: when `generation_config.json` is not valid JSON, not an object, or its `eos_token_id` is not a
        token id (or list of them) in the vocabulary, or a special token the config names (bos, eos, pad,
        end-of-turn) is not in the vocabulary.
    """
    directory = Path(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # HF allows a list of named templates
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = directory / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    hf = HFTokenizer.from_file(str(tokenizer_file))
    return Tokenizer(hf, config, template, name=str(directory),
                     generation_eos_ids=_generation_eos_ids(directory / "generation_config.json",
                                                            hf.get_vocab_size(with_added_tokens=True)))


def _generation_eos_ids(path: Path, vocab_size: int) -> tuple[int, ...]:
    """`eos_token_id` of a generation_config.json (an id or a list of ids; absent or null: none)."""
    if not path.is_file():
        return ()
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    value = config.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ValueError(f"{path}: eos_token_id {value!r} must be a token id or a list of them, each in "
                             f"[0, {vocab_size}) (the tokenizer's vocabulary)")
    return tuple(ids)
