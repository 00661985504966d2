"""Longest-expected-first: the order in which a step launches its groups (DESIGN.md section 3.4).

A group is done when its slowest sample is, and a rollout is done when its last group is. With
more samples than decode slots, the queue keeps the slots full; starting the groups expected to
take longest first lets short ones fill the slots beside them, so that the step does not end on a
long group that started late and runs alone. The prediction comes from the same prompt's earlier
groups: a prompt's expected duration is a running average over its groups of their slowest
sample's duration, in seconds,

    duration(sample) = its tool seconds + its generated tokens x the engine's seconds per token.

Tool-bound work thus ranks by tool time, decode-bound work by tokens, mixed work by both, with no
weight to tune. The per-token pace is measured on turns after the first: a first turn's time
includes waiting for a free slot, which says nothing about the prompt.
Prompts never seen go first (unknown duration: starting them early is the safe choice), unless a
prior `expected_tokens(task)` is given, which is then priced at the current pace.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.trajectory import Trajectory


def trajectory_timing(traj: Trajectory) -> tuple[float, int, float, int]:
    """(tool seconds, generated tokens, generate seconds of turns after the first, their tokens)."""
    tools = sum(t.tools_s for t in traj.turns)
    tokens = sum(t.gen_end - t.gen_start for t in traj.turns)
    later = traj.turns[1:]
    return tools, tokens, sum(t.generate_s for t in later), sum(t.gen_end - t.gen_start for t in later)


class LongestFirst:
    """Predicted group durations per prompt, and the launch order they give.

    smoothing: weight of the newest group in a prompt's running average (1 = only the last).
    expected_tokens: optional prior `fn(task) -> tokens of its slowest sample` for unseen prompts.
    """

    def __init__(self, smoothing: float = 0.5, expected_tokens: Callable[[Task], float] | None = None):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"LongestFirst smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing, self.expected_tokens = smoothing, expected_tokens
        self.durations: dict[str, float] = {}  # prompt (group id) -> expected seconds of its group
        self.pace: float | None = None          # engine seconds per generated token (running average)

    def observe(self, group_id: str, trajectories: Sequence[Trajectory]) -> None:
        """Learns from a finished group of prompt `group_id`."""
        timings = [trajectory_timing(t) for t in trajectories]
        later_s, later_n = sum(x[2] for x in timings), sum(x[3] for x in timings)
        if later_n == 0 and self.pace is None:  # single-turn samples only: the first turns must do
            later_s = sum(t.turns[0].generate_s for t in trajectories if t.turns)
            later_n = sum(x[1] for x in timings)
        if later_n:
            pace = later_s / later_n
            self.pace = pace if self.pace is None else (1 - self.smoothing) * self.pace + self.smoothing * pace
        slowest = max((tools + tokens * (self.pace or 0.0) for tools, tokens, _, _ in timings), default=0.0)
        old = self.durations.get(group_id)
        self.durations[group_id] = slowest if old is None else (1 - self.smoothing) * old + self.smoothing * slowest

    def predict(self, task: Task) -> float:
        """Expected seconds of a group of `task`; inf when nothing is known (unseen goes first)."""
        if task.task_id in self.durations:
            return self.durations[task.task_id]
        if self.expected_tokens is not None:
            # before any pace is known every prompt is unseen, so ranking by tokens alone is right
            return float(self.expected_tokens(task)) * (self.pace if self.pace is not None else 1.0)
        return math.inf

    def order(self, tasks: Sequence[Task]) -> list[int]:
        """Indices into `tasks`, longest expected first; ties keep their given order."""
        return sorted(range(len(tasks)), key=lambda i: -self.predict(tasks[i]))

    def state_dict(self) -> dict:
        return {"durations": {str(k): float(v) for k, v in self.durations.items()},
                "pace": None if self.pace is None else float(self.pace)}

    def load_state_dict(self, state: dict) -> None:
        self.durations = {str(k): float(v) for k, v in state["durations"].items()}
        self.pace = None if state["pace"] is None else float(state["pace"])
