"""`TokenizerProtocol`: what the library asks of a tokenizer, for users who bring their own.

`sfrrl_jax.tokenizer.Tokenizer` (any HF tokenizer directory) meets it; so does any class with
these members. Who calls what:

  agent loop (`agents.loop.run_agent`, so `AgentRollout` and `trainer.evaluate`):
      apply_chat_template (the prompt), decode (a generated turn, to parse its tool calls),
      render_delta (the tool results + the next generation prompt, appended to the parked slot),
      stop_token_ids (unless `AgentConfig.stop_token_ids` is set)
  SFT demonstrations (`agents.tasks.demos.render_sft_example`): apply_chat_template, render,
      render_delta, encode, decode, end_of_turn_token, stop_token_ids
  recipes and checks: vocab_size (must not exceed `ModelConfig.vocab_size`), encode / decode

Messages are OpenAI-style dicts (`role` in system/user/assistant/tool, `content`; an assistant
message may carry `tool_calls`, a tool message `name` / `tool_call_id`); `tools` is a list of
JSON-schema function descriptions, or None. Token ids are plain Python ints in
[0, vocab_size).

The invariant the agent loop rests on: `render_delta(history, new_messages)` is the tail of the
full render -- the ids of `render(history + new_messages, add_generation_prompt=True)` after the
point where `render(history)` closes its last assistant turn (right after `stop_text`). The loop
appends it to the turn's tokens as generated, so a trajectory is prompt + generated turns +
deltas, never re-tokenized history; it equals `apply_chat_template` of its messages whenever the
template renders an assistant turn as the model generated it (SFT demonstrations rely on that).
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

Message = Mapping[str, Any]


@runtime_checkable
class TokenizerProtocol(Protocol):
    """A tokenizer with a chat template (module doc: who calls which member).

    `isinstance(x, TokenizerProtocol)` checks only that every member exists; the semantics
    below are the contract.
    """

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included; every id is in [0, vocab_size)."""
        ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant turn (end-of-turn, then eos, then any the model's
        generation_config.json adds; no duplicates). The engine stops a turn on any of them and the
        stop token stays in the turn's generated tokens. The agent loop lets the tool-call format
        refine them (`agents.formats.registry.turn_stop_ids`)."""
        ...

    @property
    def end_of_turn_token(self) -> str | None:
        """The text of the token that closes an assistant turn in the chat template (e.g.
        '<|im_end|>'); its id is in `stop_token_ids`. (gpt-oss's template closes past turns with
        <|end|>, which inside a turn ends a message: the harmony format drops it from the stops.)"""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, nothing added (no bos/eos); special-token strings in `text` become their
        ids. len(result) is the number of tokens; never raises on any Python str."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included as their strings (so a generated turn's
        tool-call markup and stop token can be parsed from it)."""
        ...

    def render(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The chat template's text for `messages` (and `tools`), ending with the assistant's
        generation prompt when `add_generation_prompt`."""
        ...

    def apply_chat_template(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = False) -> list[int]:
        """Ids of `render(messages, tools, add_generation_prompt)`: the prompt the engine prefills.
        Tool-message contents should never yield control tokens (a tool cannot forge an end of
        turn by printing its text)."""
        ...

    def render_delta(self, history: Sequence[Message], new_messages: Sequence[Message],
                     tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                     stop_text: str | None = None) -> list[int]:
        """Ids to append after the assistant turn that ends `history` and stopped on `stop_text`
        (None: `end_of_turn_token`): `new_messages` (tool results) rendered, then the next
        generation prompt when `add_generation_prompt` -- the tail of the full render (module
        doc). Raises (e.g. `TemplateDeltaError`) when the template is not append-only there.
        Tool contents never yield control tokens."""
        ...
