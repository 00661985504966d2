"""Math word problems with a Python tool, verified by mathematical equivalence, not string equality.

Kind 'math' (registered on import). JSONL record:
    {"kind": "math", "problem": str (or "question" / "prompt"), "answer": str | number, [id], ...}
Other fields go to `Task.metadata`. The prompt is the problem plus `MATH_INSTRUCTION`.

`verify_math(task, final_text)` -> 1.0 or 0.0:
  * the prediction is the last `<answer>...</answer>` block of the final text if there is one (read
    as one LaTeX expression when it has any of \\ ^ _ { }, e.g. '1 + x^2', else as text whose number
    counts, e.g. '3 dollars'); else the final text's last `\\boxed{}`; else the final text's last
    number ('-9 + 7 = -2' -> -2), and a text without one scores 0. Never an expression the text
    merely mentions: math-verify reads free text as math and evaluates what it finds, so 'To
    calculate 3 * -1, we use multiplication...' stated the answer -3 to it; RL on one-digit
    arithmetic (SmolLM2-135M) learnt to restate the question so and scored 87 % held out while
    answering nothing. A gold answer that is an expression needs the tags or \\boxed{};
  * the gold answer is parsed as LaTeX inside `\\boxed{}` (so '\\frac{1}{2}', '0.5', '1/2' and
    '50\\%'-style answers all parse), and the two are compared by math-verify: numbers (fractions,
    decimals rounded to 6 places, thousands separators), units and currency stripped ('3 dollars',
    '\\$3', '\\boxed{3 \\text{ apples}}' all equal 3), symbolic expressions (x^2+1 == 1+x^2), sets,
    intervals, tuples and matrices;
  * a gold answer that is plain words ('yes', 'Paris') is compared as normalized text instead, as
    math-verify would read 'yes' as the product e*s*y;
  * numbers in E notation, in either, are written out first ('6.02e23', '1e-3' -> 0.001): math-verify
    reads a predicted '1e20' as 1 and a gold '6.02e23' as 6.02 * e * 23.

Why math-verify (PyPI `math-verify`, Hugging Face's, used by open-r1 and lighteval): it is the
well-kept verifier of this job: LaTeX and plain-expression extraction, sympy equivalence with
float tolerance, unit stripping, tested on MATH/GSM8K answers, one small dependency
(latex2sympy2_extended). Writing our own would repeat its many cases badly. Its trap: a model's
answer is hostile input (`2^{2^{2^{2^{20}}}}` is an integer no memory holds) and its timeouts are
signal.alarm, which works on the main thread only; so it runs in a child process with a memory
limit that is killed past its time (`isolated.MathVerifierProcess`: the answer then scores 0),
and the text it parses is cut to `MAX_PARSE_CHARS`.

`math_environment(sandbox)` is the tool environment: the python tool (jailed `PythonSandbox`) and
the calculator, reward `answer_correct` (this verifier) unless given other reward functions.
"""
from __future__ import annotations

import atexit
import re
from typing import Any, Sequence

from sfrrl_jax.agents.protocols import RewardFn, Task
from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox
from sfrrl_jax.agents.tasks.environments import ToolEnvironment
from sfrrl_jax.agents.tasks.isolated import MathVerifierProcess
from sfrrl_jax.agents.tasks.kinds import register_task_kind
from sfrrl_jax.agents.tasks.verifiers import extract_answer
from sfrrl_jax.agents.tools import CalculatorTool, PythonTool, ToolRunnerConfig

MATH_INSTRUCTION = "Give the final answer as <answer>...</answer> (LaTeX such as \\frac{1}{2} is fine)."
MATH_SYSTEM_PROMPT = ("You are a careful assistant that solves math problems step by step. You may run Python "
                      "code with the python tool to compute; check your arithmetic with it.")
MAX_PARSE_CHARS = 2000  # longer predictions are cut to their tail before parsing (sympy time grows with size)
_PROBLEM_FIELDS = ("problem", "question", "prompt")
_WORDS = re.compile(r"[A-Za-z]{2,}([\s'-]+[A-Za-z]+)*\.?")
# A number as a final answer states it: sign, digits with thousands separators, decimals, an
# exponent, a fraction without spaces ('-2', '1,234', '0.5', '6.02e23', '3/4').
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?")


# math-verify runs in a child process killed past its time (isolated.py): an answer such as
# 2^{2^{2^{2^{20}}}} froze the whole process off the main thread, where math-verify has no timeout.
_VERIFIER = MathVerifierProcess()
atexit.register(_VERIFIER.close)


def _normalize_words(text: str) -> str:
    return " ".join(text.strip().lower().rstrip(".").split())


def math_equal(prediction: str, answer: str, boxed: bool = False) -> bool:
    """Whether the text `prediction` states the gold `answer` (see the module docstring).

    A gold answer of plain words, or one math-verify cannot read as math, is compared as normalized text
    (lower case, spaces collapsed, a final '.' dropped); otherwise math-verify compares the two in a child
    process (`isolated.MathVerifierProcess`) on the last `MAX_PARSE_CHARS` characters of `prediction`.

    Args:
      prediction: the predicted text.
      answer: the gold answer.
      boxed: `prediction` is the answer alone (an <answer> block), so LaTeX in it (any of \\ ^ _ { }) is read
        as one expression, as if in \\boxed{}; else the text's \\boxed{} or last number counts.
    Returns:
      True if they are equal; False otherwise, and when math-verify runs past its time or dies (out of memory).
    Raises:
      ImportError: math-verify is not installed.
      RuntimeError: the math-verify process did not start in time.
    """
    if _WORDS.fullmatch(answer.strip()):
        return _normalize_words(prediction) == _normalize_words(answer)
    verdict = _VERIFIER.equal(prediction[-MAX_PARSE_CHARS:], answer, boxed)
    if verdict is None:  # the gold answer is not math either: the text must agree
        return _normalize_words(prediction) == _normalize_words(answer)
    return verdict


def final_answer(final_text: str, gold: str) -> tuple[str, bool] | None:
    """(the prediction, whether it is the answer alone) that `verify_math` compares (module doc):
    the last <answer> block; else the text when it has a \\boxed{} (math-verify reads the last
    one) or the gold answer is words (the whole text must say them); else the last number alone;
    None when the text has none of these."""
    block = extract_answer(final_text)
    if block is not None:
        return block, True
    if "\\boxed" in final_text or _WORDS.fullmatch(gold.strip()):
        return final_text, False
    numbers = _NUMBER.findall(final_text.replace("\u2212", "-"))
    return (numbers[-1], True) if numbers else None


def verify_math(task: Task, final_text: str) -> float:
    """1.0 if the final answer (`final_answer`: the last <answer> block, \\boxed{} or number) equals `task.answer`.

    The 'math' kind's verifier (module docstring), comparing with `math_equal`.

    Args:
      task: a 'math' task with its gold `answer`.
      final_text: the model's final assistant text.
    Returns:
      1.0 if equal, else 0.0 (also when the text has no <answer> block, \\boxed{} or number).
    Raises:
      ValueError: `task.answer` is None.
      ImportError: math-verify is not installed (raised by `math_equal`).
    """
    if task.answer is None:
        raise ValueError(f"task {task.task_id}: a 'math' task needs an answer to verify against")
    found = final_answer(final_text, task.answer)
    if found is None:
        return 0.0
    prediction, alone = found
    return float(math_equal(prediction, task.answer, boxed=alone))


def math_task(problem: str, answer: Any, task_id: str, **metadata: Any) -> Task:
    """A 'math' task: `problem` + `MATH_INSTRUCTION`, the gold `answer` as text.

    Args:
      problem: the problem statement.
      answer: the gold answer (a string or number), stored as `str(answer)`.
      task_id: the task's id.
      **metadata: more `Task.metadata` entries (besides 'problem', which holds `problem`).
    Returns:
      The Task, kind 'math', prompt `problem` + two newlines + `MATH_INSTRUCTION`.
    """
    return Task(task_id=task_id, kind="math", prompt=f"{problem}\n\n{MATH_INSTRUCTION}", answer=str(answer),
                metadata={"problem": problem, **metadata})


def _math_from_record(record: dict, task_id: str) -> Task:
    present = [f for f in _PROBLEM_FIELDS if f in record]
    if not present:
        raise ValueError("missing required field 'problem' (or 'question' / 'prompt') (kind 'math')")
    problem, answer = record[present[0]], record["answer"]
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"field {present[0]!r} must be a non-empty string, got {problem!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
        raise ValueError(f"field 'answer' must be a non-empty string or a number, got {answer!r}")
    extra = {k: v for k, v in record.items() if k not in ("id", "task_id", "kind", "answer", *_PROBLEM_FIELDS)}
    return math_task(problem, answer, task_id, **extra)


def _math_to_record(task: Task) -> dict:
    return {"answer": task.answer, **task.metadata}


register_task_kind("math", verify_math, from_record=_math_from_record, to_record=_math_to_record,
                   fields=("answer",))


def math_environment(sandbox: PythonSandbox, runner_cfg: ToolRunnerConfig = ToolRunnerConfig(),
                     reward_fns: Sequence[RewardFn] | None = None,
                     reward_weights: Sequence[float] | None = None) -> ToolEnvironment:
    """Python tool (jailed) + calculator; reward: `answer_correct` (the kind's verifier) by default.

    Args:
      sandbox: the jailed sandbox the python tool runs code in.
      runner_cfg: how tool calls run (timeouts, concurrency, remote workers).
      reward_fns: the reward functions; None: `[answer_correct]`, which calls the task kind's verifier
        (`verify_math` for 'math' tasks).
      reward_weights: one weight per reward function; None: 1 each.
    Returns:
      A `ToolEnvironment` with the tools `PythonTool(sandbox)` and `CalculatorTool()` and the system prompt
      `MATH_SYSTEM_PROMPT`.
    Raises:
      ValueError, TypeError: bad `reward_fns` / `reward_weights` (see `reward_fns.RewardSum`).
    """
    return ToolEnvironment([PythonTool(sandbox), CalculatorTool()], MATH_SYSTEM_PROMPT, runner_cfg, reward_fns,
                           reward_weights)


def math_tool_environment(runner_cfg: ToolRunnerConfig = ToolRunnerConfig()) -> ToolEnvironment:
    """`math_environment` over a fresh jailed sandbox (Python tool + calculator; the kind's verifier):
    the default environment of the 'qa' and 'reasoning_gym' kinds.

    Args:
      runner_cfg: how the tool calls run (`ToolRunnerConfig`; backend 'ray' runs them, and the
        sandbox, on a Ray cluster's actors).
    Returns:
      A `ToolEnvironment` as `math_environment(PythonSandbox())` builds it.
    Raises:
      RuntimeError: the sandbox's jail cannot be built on this machine (see `PythonSandbox`).
    """
    return math_environment(PythonSandbox(), runner_cfg)
