"""sfrrl_jax: pipelined-synchronous RL for agentic Mixture-of-Experts LLMs in JAX.

One import gives the whole public API (`import sfrrl_jax as S`); the sub-packages hold the rest.

    mesh = S.make_mesh(data=2, expert=4)
    cfg = S.ModelConfig.preset("tiny-moe")
    params = S.init_params(cfg, mesh, seed=0)        # the one sharded param pytree
    logits = S.forward(cfg, params, tokens)          # [batch, seq, vocab]; composes with jit/grad/vmap
    adapter = S.init_adapter(cfg, S.LoraConfig(rank=8), mesh)   # LoRA: S.forward(..., adapter=adapter);
    lora_params = S.AdaptedParams(params, adapter)   # train / generate it where params go (base frozen)
    outs = S.generate(cfg, params, prompts, 16)      # the rollout engine, same arrays

    env = S.ToolEnvironment([tool], system_prompt, reward_fns=[S.answer_correct, my_reward])
    trainer = S.RLTrainer(cfg, params, S.TrainerConfig(...), S.LossConfig(), S.OptimizerConfig(),
                          S.AgentRollout(env, tokenizer, S.AgentConfig(...)), S.TaskStream(tasks))
    metrics = trainer.step()                         # one on-policy RL step; 'reward/<name>' per reward fn

Rooms, lowest first (an import only goes downwards; `tests/test_architecture.py` checks it):
`mesh`, `config` -> `models`, `tokenizer` -> `engine`, `rl` -> `agents`, `learner` -> `trainer` ->
`checkpoints`, `testing` -> `launch` (CLI, gin bindings, experiment runner).
"""
import importlib
from typing import TYPE_CHECKING

# The names below are imported on first use (PEP 562), not with the package: a process that needs
# one room (a Ray actor running tools, a sandbox launcher, the planner's CLI) imports that room,
# not JAX and every model. This block is their one list: static readers (IDEs, type checkers, the
# API reference) read it as imports, and `_exports()` reads it, once, as the table of where each
# name lives.
if TYPE_CHECKING:
    from sfrrl_jax import agents, checkpoints, engine, learner, rl, tokenizer, trainer  # noqa: F401
    from sfrrl_jax.agents import (AgentConfig, CalculatorTool, Environment, FunctionTool, PythonSandbox, PythonTool,
                                  RewardError, RewardFn, RewardSum, SandboxConfig, Task, TaskKind, Tool, ToolEnvironment,
                                  ToolRunnerConfig, Trajectory, UnknownTaskKindError, answer_correct, answer_format,
                                  calculator_environment, countdown_environment, generate_arithmetic_tasks,
                                  generate_countdown_tasks, get_task_kind, in_thread, load_tasks_jsonl, named,
                                  qa_environment,
                                  register_task_kind, registered_task_kinds, reward_component_means, run_agent,
                                  run_many, save_tasks_jsonl, tool_error_penalty, unregister_task_kind)
    from sfrrl_jax.agents import (BFCL_CATEGORIES, CodeTestsVerifier, FunctionCallingEnvironment, bfcl_tasks,
                                  code_tests_reward, function_call_match, humaneval_tasks, load_tasks, math_environment,
                                  math_equal, reasoning_gym_tasks, verify_math, verify_reasoning_gym)
    from sfrrl_jax.agents.tasks.verifiers import extract_answer
    from sfrrl_jax.agents.mcp_tools import McpTool, mcp_tools
    from sfrrl_jax.checkpoints import (Checkpointer, abstract_trainer_state, load_adapter, load_hf, load_trainer_state,
                                       save_adapter, save_hf, trainer_state)
    from sfrrl_jax.config import ModelConfig
    from sfrrl_jax.engine import Engine, EngineProtocol, generate
    from sfrrl_jax.learner import OptimizerConfig, TrainStep, make_train_step
    from sfrrl_jax.mesh import (CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS, LOGICAL_AXIS_RULES, TENSOR_AXIS, make_mesh,
                                shard_by_logical)
    from sfrrl_jax.models import forward, init_params, param_logical_axes
    from sfrrl_jax.models.lora import AdaptedParams, LoraAdapter, LoraConfig, init_adapter, merge_adapter
    from sfrrl_jax.rl import (AdvantageConfig, Loss, LossConfig, LossInputs, MicroBatch, ObjectiveParts, compute_advantages,
                              loss_from_config, policy_loss, sft_loss)
    from sfrrl_jax.tokenizer import Tokenizer, TokenizerProtocol, build_tiny_tokenizer, load_tokenizer
    from sfrrl_jax.trainer import (AgentRollout, RLTrainer, RolloutFn, RunLogger, TaskStream, TrainerConfig,
                                   TrainingDivergedError, evaluate, read_metrics, run_sft)

__all__ = [
    # mesh and models
    "CONTEXT_AXIS", "DATA_AXIS", "EXPERT_AXIS", "LOGICAL_AXIS_RULES", "TENSOR_AXIS", "ModelConfig", "forward", "init_params",
    "make_mesh", "param_logical_axes", "shard_by_logical",
    # LoRA adapters: trained on the frozen base, PEFT directories in and out
    "AdaptedParams", "LoraAdapter", "LoraConfig", "init_adapter", "load_adapter", "merge_adapter", "save_adapter",
    # checkpoints: Hugging Face formats and resumable trainer state
    "Checkpointer", "abstract_trainer_state", "load_hf", "load_trainer_state", "save_hf", "trainer_state",
    # rollout engine and tokenizers
    "Engine", "EngineProtocol", "generate", "Tokenizer", "TokenizerProtocol", "build_tiny_tokenizer", "load_tokenizer",
    # tasks, tools, environments, rewards, the agent loop
    "AgentConfig", "CalculatorTool", "Environment", "FunctionTool", "PythonSandbox", "PythonTool", "RewardError",
    "RewardFn", "RewardSum", "SandboxConfig", "Task", "TaskKind", "Tool", "ToolEnvironment", "ToolRunnerConfig",
    "Trajectory", "UnknownTaskKindError", "answer_correct", "answer_format", "calculator_environment",
    "countdown_environment", "extract_answer", "generate_arithmetic_tasks", "generate_countdown_tasks",
    "get_task_kind", "in_thread", "load_tasks_jsonl", "named", "qa_environment", "register_task_kind", "registered_task_kinds",
    "reward_component_means", "run_agent", "run_many", "save_tasks_jsonl", "tool_error_penalty",
    "unregister_task_kind",
    # tools from MCP servers (stdio or streamable HTTP)
    "McpTool", "mcp_tools",
    # task sets from files and packages (math, reasoning-gym, HumanEval code, BFCL function calling)
    "BFCL_CATEGORIES", "CodeTestsVerifier", "FunctionCallingEnvironment", "bfcl_tasks", "code_tests_reward",
    "function_call_match", "humaneval_tasks", "load_tasks", "math_environment", "math_equal",
    "reasoning_gym_tasks", "verify_math", "verify_reasoning_gym",
    # losses, advantages, the train step
    "AdvantageConfig", "Loss", "LossConfig", "LossInputs", "MicroBatch", "ObjectiveParts", "OptimizerConfig", "TrainStep",
    "compute_advantages", "loss_from_config", "make_train_step", "policy_loss", "sft_loss",
    # the loops
    "AgentRollout", "RLTrainer", "RolloutFn", "RunLogger", "TaskStream", "TrainerConfig", "TrainingDivergedError",
    "evaluate", "read_metrics", "run_sft",
]


def _exports() -> dict[str, str]:
    """{name: the module it is imported from} of the TYPE_CHECKING block above (a room's own name:
    the room's package)."""
    import ast
    import pathlib
    table: dict[str, str] = {}
    tree = ast.parse(pathlib.Path(__file__).read_text(encoding="utf-8"))
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") ==
                   "TYPE_CHECKING")
    for node in guarded.body:
        for alias in node.names:
            name = alias.asname or alias.name
            table[name] = f"{node.module}.{alias.name}" if node.module == __name__ else node.module
    return table


_WHERE: dict[str, str] = {}


def __getattr__(name: str):
    if not _WHERE:
        _WHERE.update(_exports())
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if module == f"{__name__}.{name}" else getattr(loaded, name)
    globals()[name] = value   # later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    if not _WHERE:
        _WHERE.update(_exports())
    return sorted(set(globals()) | set(_WHERE))
