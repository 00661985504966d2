"""Agents: the multi-turn loop and its protocols (engine, tool, environment), tools, and three rooms:
`formats/` (tool-call formats), `sandbox/` (jailed Python), `tasks/` (tasks, the task-kind registry,
verifiers and reward functions, environments, task sets)."""
from sfrrl_jax.agents.formats import (CompactFormat, DeepSeekDsmlFormat, DeepSeekFormat, GraniteFormat, HarmonyFormat,
                                      KimiK2Format, Llama3JsonFormat, Llama4JsonFormat, MiniMaxM2Format, MistralFormat,
                                      Olmo3Format, ParsedTurn, PythonicFormat, Qwen3Format, Qwen3XmlFormat,
                                      SeedOssFormat, ToolCallFormat, get_format, infer_format)
from sfrrl_jax.agents.loop import AgentConfig, run_agent, run_many
from sfrrl_jax.agents.protocols import (Completion, EngineProtocol, Environment, GenerationRequest, RewardFn, Task,
                                        Tool, ToolCall, ToolCallError, ToolResult)
from sfrrl_jax.agents.sandbox import PythonSandbox, SandboxConfig, SandboxResult, probe_capabilities
from sfrrl_jax.agents.tasks import (BFCL_CATEGORIES, BfclMultiTurnEnvironment, CodeTestsVerifier, DatasetError,
                                    FunctionCallingEnvironment, RewardError, RewardSum, TaskKind, ToolEnvironment,
                                    UnknownTaskKindError, answer_correct, answer_format, bfcl_multi_turn_tasks,
                                    bfcl_tasks, calculator_demonstration, calculator_environment,
                                    calculator_tool_schemas, code_tests_reward, countdown_environment,
                                    function_call_match, generate_arithmetic_tasks, generate_countdown_tasks,
                                    get_task_kind, humaneval_tasks, in_thread, load_tasks, load_tasks_jsonl,
                                    math_environment, math_equal, multi_turn_match, multi_turn_progress, named,
                                    qa_environment, reasoning_gym_tasks, register_task_kind, registered_task_kinds,
                                    render_sft_example, reward_component_means, save_tasks_jsonl, task_reward,
                                    tool_error_penalty, unregister_task_kind, verify_math, verify_reasoning_gym)
from sfrrl_jax.agents.mcp_tools import McpTool, mcp_tools
from sfrrl_jax.agents.ray_tools import RayToolRunner
from sfrrl_jax.agents.tools import CalculatorTool, FunctionTool, PythonTool, ToolError, ToolRunner, ToolRunnerConfig
from sfrrl_jax.agents.trajectory import Trajectory, Turn

__all__ = [
    "AgentConfig", "CalculatorTool", "CompactFormat", "Completion", "DatasetError", "EngineProtocol", "Environment",
    "DeepSeekDsmlFormat", "DeepSeekFormat", "FunctionTool", "GenerationRequest", "GraniteFormat", "HarmonyFormat",
    "KimiK2Format", "Llama3JsonFormat", "MiniMaxM2Format",
    "Llama4JsonFormat", "McpTool", "mcp_tools", "RayToolRunner", "MistralFormat", "Olmo3Format", "ParsedTurn", "PythonicFormat",
    "PythonSandbox", "PythonTool", "Qwen3Format", "Qwen3XmlFormat", "SeedOssFormat", "RewardError", "RewardFn",
    "RewardSum",
    "SandboxConfig", "SandboxResult", "Task", "TaskKind",
    "Tool", "ToolCall", "ToolCallError", "ToolCallFormat", "ToolEnvironment", "ToolError", "ToolResult", "ToolRunner",
    "ToolRunnerConfig", "Trajectory", "Turn", "UnknownTaskKindError", "answer_correct", "answer_format",
    "calculator_demonstration", "calculator_environment", "calculator_tool_schemas", "countdown_environment",
    "generate_arithmetic_tasks", "generate_countdown_tasks", "get_format", "get_task_kind", "in_thread", "infer_format",
    "load_tasks_jsonl", "named", "probe_capabilities", "qa_environment", "register_task_kind", "registered_task_kinds",
    "render_sft_example", "reward_component_means", "run_agent", "run_many", "save_tasks_jsonl", "task_reward",
    "tool_error_penalty", "unregister_task_kind",
]

# Task sets as data, rewards as verifiers (issue #22 pt 2): importing `tasks` registers the kinds 'math',
# 'reasoning_gym', 'code', 'function_call' and 'bfcl_multi_turn'; their optional packages load only when used.
__all__ += ["BFCL_CATEGORIES", "BfclMultiTurnEnvironment", "bfcl_multi_turn_tasks", "multi_turn_match",
            "multi_turn_progress", "CodeTestsVerifier", "FunctionCallingEnvironment", "bfcl_tasks", "code_tests_reward",
            "function_call_match", "humaneval_tasks", "load_tasks", "math_environment", "math_equal",
            "reasoning_gym_tasks", "verify_math", "verify_reasoning_gym"]
