"""Contracts between the agent loop and its neighbours: tools, environments, tasks, reward functions.

The engine's request/response types live in `sfrrl_jax.generation_types` (re-exported here).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Mapping, Protocol, Sequence, runtime_checkable

from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.generation_types import Completion, EngineError, EngineProtocol, GenerationRequest  # noqa: F401

Message = dict  # {"role": "system"|"user"|"assistant"|"tool", "content": str, "tool_calls"?: [...]}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed call: `arguments` is the decoded JSON object; `call_id` is unique within a turn."""

    name: str
    arguments: dict
    call_id: str = ""
    raw: str = ""

    def as_message_entry(self) -> dict:
        """OpenAI-style entry for an assistant message's `tool_calls` list."""
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call that could not be parsed (bad JSON, unterminated markup): becomes an error observation.
    `call_id`: the id its observation carries (a format whose template checks ids gives one)."""

    message: str
    raw: str = ""
    name: str | None = None
    call_id: str = ""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The observation for one call (or one unparseable call), in call order. `elapsed_s`: the
    call's own run time; `queue_s`: what it waited for a free worker before (Ray backend)."""

    name: str
    content: str
    is_error: bool = False
    call_id: str = ""
    elapsed_s: float = 0.0
    queue_s: float = 0.0

    def as_message(self) -> Message:
        return {"role": "tool", "name": self.name, "tool_call_id": self.call_id, "content": self.content}


@runtime_checkable
class Tool(Protocol):
    """An OpenAI-function-calling style tool. `parameters` is a JSON schema for the arguments object."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, **arguments: Any) -> Awaitable[str]: ...


@dataclasses.dataclass(frozen=True)
class Task:
    """A prompt and what its verifier needs. `kind` names the verifier in the task-kind registry
    (`tasks.kinds.register_task_kind`; built-in: 'arithmetic', 'countdown', 'qa', see `tasks/builtin_kinds.py`)."""

    task_id: str
    kind: str
    prompt: str
    answer: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    """Stateless per trajectory (one instance serves thousands of concurrent trajectories).

    `reset(task)` gives the initial messages; `step(calls)` runs the parsed calls and returns one
    result per item, in order (unparseable items included, as errors); `reward(task, trajectory)`
    is a pure function of the task and the finished trajectory: a finite float, or an awaitable of
    one (an `async def reward`, awaited by the loop, which serves the other trajectories meanwhile);
    anything else, or an exception, makes that sample an error. It may record its components (unweighted, by name)
    in `trajectory.metadata["rewards"]`, as `ToolEnvironment` does: see `reward_fns.RewardSum`
    (`RLTrainer` logs each component's mean over a step as `reward/<name>`).
    An environment whose tools differ per task may also define `task_tool_schemas(task)`: the
    agent loop then renders those with the chat template instead of `tool_schemas()`.
    One whose tools keep state per trajectory, or whose user speaks more than once, defines
    `open_episode(task) -> Episode`: the loop then resets and steps that episode instead.
    """

    def tool_schemas(self) -> list[dict]: ...

    def reset(self, task: Task) -> list[Message]: ...

    async def step(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]: ...

    def reward(self, task: Task, trajectory: Trajectory) -> float: ...


@runtime_checkable
class RewardFn(Protocol):
    """A reward function is a plain callable value: `fn(task, trajectory) -> float` (finite), or an
    `async def` one (awaited). Defined here only; `reward_fns` (with the built-ins, and `in_thread`
    for a blocking one) and `sfrrl_jax.agents` re-export it.

    Its log name (`reward/<name>`) is its `__name__`; give a lambda, a `functools.partial` or a
    callable object one with `reward_fns.named(fn, name)`. Environments take a list of them and
    their weights (`ToolEnvironment(..., reward_fns=[...], reward_weights=[...])`), as TRL's
    `reward_funcs` / `reward_weights`.
    """

    def __call__(self, task: Task, trajectory: Trajectory) -> float: ...


class Episode(Protocol):
    """One trajectory's own view of an environment (`Environment.open_episode(task)`): the state
    its tools keep (a file system, a booking) lives here, not in the shared environment.

    `reset()` gives the initial messages; `step(calls)` as `Environment.step`, on this episode's
    state; `next_user_turn()` is asked when the model answers without tool calls: the next user
    messages (the trajectory goes on with them), or None (it ends, finish reason 'answer');
    `reset()` and `next_user_turn()` may return awaitables of those (an episode held elsewhere, e.g.
    on a Ray actor: `ray_tools.RayEpisode`), which the loop awaits.
    `close()` is called once when the trajectory ends, also on errors and cancellation. The
    reward stays `Environment.reward(task, trajectory)`, a function of the finished trajectory.
    """

    def reset(self) -> list[Message]: ...

    async def step(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]: ...

    def next_user_turn(self) -> list[Message] | None: ...

    def close(self) -> None: ...
