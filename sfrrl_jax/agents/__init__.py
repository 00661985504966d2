"""Agents: engine/tool/environment protocols, tool-call formats, the sandbox, tasks, the agent loop."""
from sfrrl_jax.agents.demos import calculator_demonstration, calculator_tool_schemas, render_sft_example
from sfrrl_jax.agents.environments import (ToolEnvironment, calculator_environment, countdown_environment,
                                           qa_environment)
from sfrrl_jax.agents.formats import CompactFormat, HarmonyFormat, ParsedTurn, Qwen3Format, get_format
from sfrrl_jax.agents.loop import AgentConfig, run_agent, run_many
from sfrrl_jax.agents.protocols import (Completion, EngineProtocol, Environment, GenerationRequest, Task, Tool,
                                        ToolCall, ToolCallError, ToolResult)
from sfrrl_jax.agents.rewards import task_reward
from sfrrl_jax.agents.sandbox import PythonSandbox, SandboxConfig, SandboxResult, probe_capabilities
from sfrrl_jax.agents.tasks import (DatasetError, generate_arithmetic_tasks, generate_countdown_tasks,
                                    load_tasks_jsonl, save_tasks_jsonl)
from sfrrl_jax.agents.tools import CalculatorTool, FunctionTool, PythonTool, ToolError, ToolRunner, ToolRunnerConfig
from sfrrl_jax.agents.trajectory import Trajectory, Turn

__all__ = [
    "AgentConfig", "CalculatorTool", "CompactFormat", "Completion", "DatasetError", "EngineProtocol", "Environment",
    "FunctionTool", "GenerationRequest", "HarmonyFormat", "ParsedTurn", "PythonSandbox", "PythonTool", "Qwen3Format",
    "SandboxConfig", "SandboxResult", "Task", "Tool", "ToolCall", "ToolCallError", "ToolEnvironment", "ToolError",
    "ToolResult", "ToolRunner", "ToolRunnerConfig", "Trajectory", "Turn", "calculator_demonstration",
    "calculator_environment", "calculator_tool_schemas", "countdown_environment", "generate_arithmetic_tasks",
    "generate_countdown_tasks", "get_format", "load_tasks_jsonl", "probe_capabilities", "qa_environment",
    "render_sft_example", "run_agent", "run_many", "save_tasks_jsonl", "task_reward",
]
