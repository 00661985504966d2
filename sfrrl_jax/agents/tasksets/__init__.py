"""Task sets as data, rewards as verifiers: math (math-verify), reasoning-gym generators, HumanEval
code run in our sandbox, BFCL function calling with an AST match, BFCL multi-turn items on their
executable backends; `load_tasks(source, kind)` reads
them from JSONL files (line-numbered errors) or installed packages. Importing this registers the
task kinds 'math', 'reasoning_gym', 'code', 'function_call' and 'bfcl_multi_turn'. The optional packages are imported
only when used (`pip install 'sfrrl_jax[tasks]'`; BFCL: `pip install --no-deps bfcl-eval`)."""
from sfrrl_jax.agents.tasksets.bfcl_multi_turn import (MULTI_TURN_CATEGORIES, BfclMultiTurnEnvironment,
                                                       bfcl_multi_turn_tasks, multi_turn_match, multi_turn_progress)
from sfrrl_jax.agents.tasksets.code_tasks import (CodeTestsVerifier, code_task, code_tests_reward, extract_code,
                                                  humaneval_tasks)
from sfrrl_jax.agents.tasksets.function_calling import (BFCL_CATEGORIES, FunctionCallingEnvironment, bfcl_tasks,
                                                        function_call_match, function_call_task, match_calls,
                                                        parse_python_calls)
from sfrrl_jax.agents.tasksets.loading import load_tasks
from sfrrl_jax.agents.tasksets.math_tasks import math_environment, math_equal, math_task, verify_math
from sfrrl_jax.agents.tasksets.reasoning_gym_tasks import reasoning_gym_tasks, verify_reasoning_gym
from sfrrl_jax.agents.tasksets.records import read_records

__all__ = ["BFCL_CATEGORIES", "MULTI_TURN_CATEGORIES", "BfclMultiTurnEnvironment", "bfcl_multi_turn_tasks",
           "multi_turn_match", "multi_turn_progress", "CodeTestsVerifier", "FunctionCallingEnvironment", "bfcl_tasks", "code_task",
           "code_tests_reward", "extract_code", "function_call_match", "function_call_task", "humaneval_tasks",
           "load_tasks", "match_calls", "math_environment", "math_equal", "math_task", "parse_python_calls",
           "read_records", "reasoning_gym_tasks", "verify_math", "verify_reasoning_gym"]
