"""Tool-using environments for the tasks: stateless, so one instance serves every trajectory.

The reward is the weighted sum of reward functions (`reward_fns.py`; default: `answer_correct`,
the verifier of `task.kind`), each component recorded in `trajectory.metadata["rewards"]`.
"""
from __future__ import annotations

import dataclasses
from typing import Awaitable, Sequence

from sfrrl_jax.agents.ray_tools import tool_runner
from sfrrl_jax.agents.protocols import Message, RewardFn, Task, Tool, ToolCall, ToolCallError, ToolResult
from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox
from sfrrl_jax.agents.tasks.reward_fns import RewardSum, answer_correct
from sfrrl_jax.agents.tools import CalculatorTool, PythonTool, ToolRunner, ToolRunnerConfig
from sfrrl_jax.agents.trajectory import Trajectory

CALCULATOR_SYSTEM_PROMPT = ("You are a careful assistant that solves problems step by step with tools. "
                            "Call the calculator tool for every arithmetic step.")
COUNTDOWN_SYSTEM_PROMPT = ("You are a careful assistant that solves problems step by step with tools. "
                           "You may run Python code with the python tool.")
QA_SYSTEM_PROMPT = "You are a careful assistant. Answer the question."


class ToolEnvironment:
    """System prompt + tools + reward functions.

    `reward(task, trajectory)` is `sum(w * fn(task, trajectory))` over `reward_fns` and
    `reward_weights` (default: `[answer_correct]`, weight 1 each), checked here (see
    `reward_fns.RewardSum`); each fn's unweighted value goes to `trajectory.metadata["rewards"]`.
    With an async reward function among them, `reward` returns an awaitable (the loop awaits it).
    """

    def __init__(self, tools: Sequence[Tool], system_prompt: str | None,
                 runner_cfg: ToolRunnerConfig = ToolRunnerConfig(), reward_fns: Sequence[RewardFn] | None = None,
                 reward_weights: Sequence[float] | None = None):
        self.rewards = RewardSum([answer_correct] if reward_fns is None else reward_fns, reward_weights)
        self.system_prompt = system_prompt
        # backend 'ray': the actors rebuild this environment (pickled, with a local runner)
        self.runner = tool_runner(tools, runner_cfg, env=self)

    def __getstate__(self) -> dict:
        """Pickles as its fields, the runner as its tools and config with the local backend (a
        Ray actor's copy runs its calls itself; thread pools and actor handles do not travel)."""
        state = dict(self.__dict__)
        runner = state.pop("runner")
        state["_runner_spec"] = (list(runner.tools.values()), dataclasses.replace(runner.cfg, backend="local"))
        return state

    def __setstate__(self, state: dict) -> None:
        tools, cfg = state.pop("_runner_spec")
        self.__dict__.update(state)
        self.runner = ToolRunner(tools, cfg)

    def tool_schemas(self) -> list[dict]:
        return self.runner.schemas()

    def reset(self, task: Task) -> list[Message]:
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": task.prompt})
        return messages

    async def step(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        return await self.runner.run(calls)

    def reward(self, task: Task, trajectory: Trajectory) -> float | Awaitable[float]:
        return self.rewards(task, trajectory)

    def close(self) -> None:
        self.runner.close()


def calculator_environment(runner_cfg: ToolRunnerConfig = ToolRunnerConfig(),
                           reward_fns: Sequence[RewardFn] | None = None,
                           reward_weights: Sequence[float] | None = None) -> ToolEnvironment:
    """The environment of 'arithmetic' tasks: the `calculator` tool and `CALCULATOR_SYSTEM_PROMPT`.

    Args:
      runner_cfg: how the tool calls run (`ToolRunnerConfig`: timeout, concurrency, output cap,
        remote workers).
      reward_fns: the reward functions summed into the reward; None: `[answer_correct]`.
      reward_weights: one weight per reward function; None: 1 each.
    Returns:
      A `ToolEnvironment` with `[CalculatorTool()]`.
    Raises:
      ValueError, TypeError: bad `reward_fns` / `reward_weights` (see `reward_fns.RewardSum`).
    """
    return ToolEnvironment([CalculatorTool()], CALCULATOR_SYSTEM_PROMPT, runner_cfg, reward_fns, reward_weights)


def countdown_environment(sandbox: PythonSandbox, runner_cfg: ToolRunnerConfig = ToolRunnerConfig(),
                          reward_fns: Sequence[RewardFn] | None = None,
                          reward_weights: Sequence[float] | None = None) -> ToolEnvironment:
    """The environment of 'countdown' tasks: the `python` and `calculator` tools and `COUNTDOWN_SYSTEM_PROMPT`.

    Args:
      sandbox: the sandbox the `python` tool runs the model's code in.
      runner_cfg: how the tool calls run (`ToolRunnerConfig`: timeout, concurrency, output cap,
        remote workers).
      reward_fns: the reward functions summed into the reward; None: `[answer_correct]`.
      reward_weights: one weight per reward function; None: 1 each.
    Returns:
      A `ToolEnvironment` with `[PythonTool(sandbox), CalculatorTool()]`.
    Raises:
      ValueError, TypeError: bad `reward_fns` / `reward_weights` (see `reward_fns.RewardSum`).
    """
    return ToolEnvironment([PythonTool(sandbox), CalculatorTool()], COUNTDOWN_SYSTEM_PROMPT, runner_cfg,
                           reward_fns, reward_weights)


def countdown_tool_environment(runner_cfg: ToolRunnerConfig = ToolRunnerConfig()) -> ToolEnvironment:
    """`countdown_environment` over a fresh jailed sandbox: the 'countdown' kind's default environment.

    Args:
      runner_cfg: how the tool calls run (`ToolRunnerConfig`; backend 'ray' runs them, and the
        sandbox, on a Ray cluster's actors).
    Returns:
      A `ToolEnvironment` with `[PythonTool(PythonSandbox()), CalculatorTool()]`, rewarded by
      `answer_correct`.
    Raises:
      RuntimeError: the sandbox's jail cannot be built on this machine (see `PythonSandbox`).
    """
    return countdown_environment(PythonSandbox(), runner_cfg)


def qa_environment(runner_cfg: ToolRunnerConfig = ToolRunnerConfig(), reward_fns: Sequence[RewardFn] | None = None,
                   reward_weights: Sequence[float] | None = None,
                   system_prompt: str | None = QA_SYSTEM_PROMPT) -> ToolEnvironment:
    """The environment of 'qa' tasks. No tools: the model answers from what it knows.

    Args:
      runner_cfg: how the tool calls run (`ToolRunnerConfig`: timeout, concurrency, output cap,
        remote workers).
      reward_fns: the reward functions summed into the reward; None: `[answer_correct]`.
      reward_weights: one weight per reward function; None: 1 each.
      system_prompt: the system message; None sends no system message (a chat template may then put
        in its own default one, as SmolLM2's does).
    Returns:
      A `ToolEnvironment` without tools.
    Raises:
      ValueError, TypeError: bad `reward_fns` / `reward_weights` (see `reward_fns.RewardSum`).
    """
    return ToolEnvironment([], system_prompt, runner_cfg, reward_fns, reward_weights)
