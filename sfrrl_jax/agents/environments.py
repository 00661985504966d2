"""Tool-using environments for the tasks: stateless, so one instance serves every trajectory."""
from __future__ import annotations

from typing import Sequence

from sfrrl_jax.agents.protocols import Message, Task, Tool, ToolCall, ToolCallError, ToolResult
from sfrrl_jax.agents.rewards import task_reward
from sfrrl_jax.agents.sandbox import PythonSandbox
from sfrrl_jax.agents.tools import CalculatorTool, PythonTool, ToolRunner, ToolRunnerConfig

CALCULATOR_SYSTEM_PROMPT = ("You are a careful assistant that solves problems step by step with tools. "
                            "Call the calculator tool for every arithmetic step.")
COUNTDOWN_SYSTEM_PROMPT = ("You are a careful assistant that solves problems step by step with tools. "
                           "You may run Python code with the python tool.")
QA_SYSTEM_PROMPT = "You are a careful assistant. Answer the question."


class ToolEnvironment:
    """System prompt + tools + the task's verifier (`rewards.task_reward`)."""

    def __init__(self, tools: Sequence[Tool], system_prompt: str | None,
                 runner_cfg: ToolRunnerConfig = ToolRunnerConfig()):
        self.runner = ToolRunner(tools, runner_cfg)
        self.system_prompt = system_prompt

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

    def reward(self, task: Task, trajectory) -> float:
        return task_reward(task, trajectory.final_text)

    def close(self) -> None:
        self.runner.close()


def calculator_environment(runner_cfg: ToolRunnerConfig = ToolRunnerConfig()) -> ToolEnvironment:
    return ToolEnvironment([CalculatorTool()], CALCULATOR_SYSTEM_PROMPT, runner_cfg)


def countdown_environment(sandbox: PythonSandbox, runner_cfg: ToolRunnerConfig = ToolRunnerConfig()) -> ToolEnvironment:
    return ToolEnvironment([PythonTool(sandbox), CalculatorTool()], COUNTDOWN_SYSTEM_PROMPT, runner_cfg)


def qa_environment(runner_cfg: ToolRunnerConfig = ToolRunnerConfig()) -> ToolEnvironment:
    return ToolEnvironment([], QA_SYSTEM_PROMPT, runner_cfg)
