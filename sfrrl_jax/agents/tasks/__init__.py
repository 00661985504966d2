"""Tasks and their rewards: what an agent is asked to do, in which environment, and how its answer
is scored.

The task-kind registry (`kinds.py`: a kind's verifier, JSONL record format and default
environment); the built-in kinds 'arithmetic', 'countdown' and 'qa' (`builtin_kinds.py`: seeded
generators); JSONL records <-> Tasks (`records.py`: the one record reader, line-numbered
errors); answer verifiers (`verifiers.py`) and the reward functions of a whole trajectory that
environments sum (`reward_fns.py`); the tool environments (`environments.py`) and SFT
demonstrations of them (`demos.py`). Task sets as data, rewards as verifiers: math
(math-verify), reasoning-gym generators, HumanEval code run in our sandbox, BFCL function calling
with an AST match, BFCL multi-turn items on their executable backends; `load_tasks(source, kind)`
reads them from JSONL files or installed packages. Importing this registers the task kinds
'arithmetic', 'countdown', 'qa', 'math', 'reasoning_gym', 'code', 'function_call' and
'bfcl_multi_turn'. The optional packages are imported only when used
(`pip install 'sfrrl_jax[tasks]'`; BFCL: `pip install --no-deps bfcl-eval`). Answers a model
writes are scored in child processes where a scorer evaluates them (`isolated.py`).
"""
from sfrrl_jax.agents.tasks.bfcl_multi_turn import (MULTI_TURN_CATEGORIES, BfclMultiTurnEnvironment,
                                                    bfcl_multi_turn_tasks, multi_turn_match, multi_turn_progress)
from sfrrl_jax.agents.tasks.builtin_kinds import generate_arithmetic_tasks, generate_countdown_tasks
from sfrrl_jax.agents.tasks.code_tasks import (CodeTestsVerifier, code_environment, code_task, code_tests_reward,
                                               extract_code, humaneval_tasks)
from sfrrl_jax.agents.tasks.demos import calculator_demonstration, calculator_tool_schemas, render_sft_example
from sfrrl_jax.agents.tasks.environments import (ToolEnvironment, calculator_environment, countdown_environment,
                                                 countdown_tool_environment, qa_environment)
from sfrrl_jax.agents.tasks.function_calling import (BFCL_CATEGORIES, FunctionCallingEnvironment, bfcl_tasks,
                                                     function_call_match, function_call_task, match_calls,
                                                     parse_python_calls)
from sfrrl_jax.agents.tasks.kinds import (TaskKind, UnknownTaskKindError, get_task_kind, register_task_kind,
                                          registered_task_kinds, unregister_task_kind)
from sfrrl_jax.agents.tasks.loading import load_tasks
from sfrrl_jax.agents.tasks.math_tasks import (math_environment, math_equal, math_task, math_tool_environment,
                                               verify_math)
from sfrrl_jax.agents.tasks.reasoning_gym_tasks import reasoning_gym_tasks, verify_reasoning_gym
from sfrrl_jax.agents.tasks.records import DatasetError, load_tasks_jsonl, read_records, save_tasks_jsonl
from sfrrl_jax.agents.tasks.reward_fns import (RewardError, RewardSum, answer_correct, answer_format, in_thread, named,
                                               reward_component_means, tool_error_penalty)
from sfrrl_jax.agents.tasks.verifiers import extract_answer, task_reward

__all__ = [
    # the registry, the built-in kinds, JSONL records
    "DatasetError", "TaskKind", "UnknownTaskKindError", "generate_arithmetic_tasks", "generate_countdown_tasks",
    "get_task_kind", "load_tasks_jsonl", "read_records", "register_task_kind", "registered_task_kinds",
    "save_tasks_jsonl", "unregister_task_kind",
    # verifiers and reward functions
    "RewardError", "RewardSum", "answer_correct", "answer_format", "extract_answer", "in_thread", "named",
    "reward_component_means", "task_reward", "tool_error_penalty",
    # environments and demonstrations
    "ToolEnvironment", "calculator_demonstration", "calculator_environment", "calculator_tool_schemas",
    "code_environment", "countdown_environment", "countdown_tool_environment", "math_tool_environment",
    "qa_environment", "render_sft_example",
    # task sets from files and packages
    "BFCL_CATEGORIES", "MULTI_TURN_CATEGORIES", "BfclMultiTurnEnvironment", "bfcl_multi_turn_tasks",
    "multi_turn_match", "multi_turn_progress", "CodeTestsVerifier", "FunctionCallingEnvironment", "bfcl_tasks",
    "code_task", "code_tests_reward", "extract_code", "function_call_match", "function_call_task", "humaneval_tasks",
    "load_tasks", "match_calls", "math_environment", "math_equal", "math_task", "parse_python_calls",
    "reasoning_gym_tasks", "verify_math", "verify_reasoning_gym",
]
