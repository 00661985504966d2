"""Token-in-token-out trajectories.

Layout of `tokens` (length T): prompt | gen_0 | obs_0 | gen_1 | obs_1 | ... | gen_last.
`loss_mask[t]` is 1 exactly on policy-generated tokens (the gen_i spans, stop tokens included);
`rollout_logprobs[t]` is the engine's log-prob there and 0.0 where the mask is 0. Generated tokens
are stored as the engine returned them, never re-tokenized; observations are the chat template's
delta, tokenized once and appended.

Routing replay (an engine recording routes, MoE models): `routes` [n, moe layers, top_k] holds
the experts the engine used for tokens[0:n], in order: prompt and observation tokens get the
engine's prefill choices, generated tokens their decode choices. After every turn n = T - 1 (the
last token was sampled, never fed); a trajectory cut while an observation was pending has fewer.
Routes set by other means may cover all T tokens (the last one's never reach the loss).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Turn:
    """One generate(+tools) round. Spans are [start, end) offsets into `Trajectory.tokens`."""

    index: int
    gen_start: int
    gen_end: int
    obs_end: int  # == gen_end when nothing was appended after this turn
    engine_finish_reason: str
    generate_s: float
    tools_s: float
    num_tool_calls: int
    num_tool_errors: int


@dataclasses.dataclass
class Trajectory:
    """A finished (or in-progress) trajectory. All per-token lists have the same length T."""

    task_id: str
    group_id: str
    sample_index: int
    prompt_len: int
    tokens: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    turns: list[Turn] = dataclasses.field(default_factory=list)
    finish_reason: str = ""  # answer | max_turns | max_tokens | length | wall_budget | error
    reward: float | None = None
    final_text: str = ""
    messages: list[dict] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Why the rollout failed ("TypeError: ..."), or None. A failed trajectory keeps its tokens for
    # inspection, has reward 0 and trains no token: its loss mask is all zeros.
    error: str | None = None
    # The engine's experts for tokens[:len(routes)] (see the module doc), or None (not recorded).
    routes: np.ndarray | None = None

    def mark_failed(self, error: str) -> None:
        """Turns this trajectory into a failed one (see `error`): mask and log-probs zeroed."""
        self.error = error
        self.finish_reason = "error"
        self.reward = 0.0
        self.loss_mask = [0] * len(self.tokens)
        self.rollout_logprobs = [0.0] * len(self.tokens)

    @property
    def num_tool_calls(self) -> int:
        return sum(t.num_tool_calls for t in self.turns)

    @property
    def num_tool_errors(self) -> int:
        return sum(t.num_tool_errors for t in self.turns)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def check(self) -> None:
        """Raise ValueError if the per-token lists or turn spans are inconsistent."""
        n = len(self.tokens)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(f"trajectory {self.task_id}/{self.sample_index}: tokens={n}, "
                             f"loss_mask={len(self.loss_mask)}, rollout_logprobs={len(self.rollout_logprobs)}")
        if self.routes is not None and (self.routes.ndim != 3 or len(self.routes) > n):
            raise ValueError(f"trajectory {self.task_id}/{self.sample_index}: routes {self.routes.shape} must be "
                             f"[at most {n} tokens, moe layers, top_k]")
        pos = self.prompt_len
        for turn in self.turns:
            if not pos == turn.gen_start <= turn.gen_end <= turn.obs_end <= n:
                raise ValueError(f"trajectory {self.task_id}/{self.sample_index}: turn {turn.index} spans "
                                 f"[{turn.gen_start}, {turn.gen_end}, {turn.obs_end}) do not tile from {pos}")
            pos = turn.obs_end
        expected = [0] * n
        for turn in ([] if self.error is not None else self.turns):
            expected[turn.gen_start:turn.gen_end] = [1] * (turn.gen_end - turn.gen_start)
        if expected != list(self.loss_mask):
            raise ValueError(f"trajectory {self.task_id}/{self.sample_index}: loss_mask is not 1 exactly on turns"
                             + (" (0 everywhere: it failed)" if self.error is not None else ""))


class TrajectoryBuilder:
    """Appends generated spans (mask 1) and observation spans (mask 0) to a prompt."""

    def __init__(self, task_id: str, group_id: str, sample_index: int, prompt_tokens: list[int]):
        self.trajectory = Trajectory(
            task_id=task_id, group_id=group_id, sample_index=sample_index, prompt_len=len(prompt_tokens),
            tokens=list(prompt_tokens), loss_mask=[0] * len(prompt_tokens),
            rollout_logprobs=[0.0] * len(prompt_tokens))

    def __len__(self) -> int:
        return len(self.trajectory.tokens)

    def append_generated(self, tokens: list[int], logprobs: list[float]) -> tuple[int, int]:
        t = self.trajectory
        start = len(t.tokens)
        t.tokens += tokens
        t.loss_mask += [1] * len(tokens)
        t.rollout_logprobs += [float(x) for x in logprobs]
        return start, len(t.tokens)

    def append_completion(self, completion) -> tuple[int, int]:
        """Appends what one engine call generated (an `generation_types.Completion`): its tokens and
        log-probs (mask 1), and its routes when the engine recorded them. Returns the span."""
        span = self.append_generated(completion.tokens, completion.logprobs)
        if completion.routes is not None:
            self.append_routes(completion.routes)
        return span

    def append_routes(self, routes: np.ndarray) -> None:
        """Appends the experts of the tokens one engine call fed (`Completion.routes`); they must
        continue the trajectory's routes up to its last token but one."""
        t = self.trajectory
        routes = np.asarray(routes)
        kept = t.routes if t.routes is not None else routes[:0]
        if routes.ndim != 3 or routes.shape[1:] != kept.shape[1:]:
            raise ValueError(f"the engine's routes {routes.shape} do not continue the trajectory's {kept.shape}")
        merged = np.concatenate([kept, routes.astype(np.int16)], axis=0)
        if len(merged) != len(t.tokens) - 1:
            raise ValueError(f"the engine's routes cover {len(merged)} tokens of a trajectory of {len(t.tokens)}: "
                             "every token but the last must have been fed exactly once")
        t.routes = merged

    def append_observation(self, tokens: list[int]) -> int:
        t = self.trajectory
        t.tokens += tokens
        t.loss_mask += [0] * len(tokens)
        t.rollout_logprobs += [0.0] * len(tokens)
        return len(t.tokens)
