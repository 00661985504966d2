"""Pure verifiers: (final assistant text, task data) -> reward in [0, 1].

Every task asks for the final answer inside `<answer>...</answer>`; the last such block counts.
`verify_arithmetic` / `verify_countdown` / `verify_qa` are the built-in kinds' verifiers
(`(task, final_text) -> float`, registered in `builtin_kinds.py`); `task_reward` dispatches on `task.kind`
through the registry (`kinds.py`). Reward *functions* of a whole trajectory, which an
environment sums, are in `reward_fns.py`.
"""
from __future__ import annotations

import ast
import math
import re
from collections import Counter
from fractions import Fraction
from typing import Sequence

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tasks.kinds import UnknownTaskKindError, get_task_kind

def extract_answer(text: str) -> str | None:
    """Content of the last <answer>...</answer> block, stripped; None if there is none.

    Blocks are read left to right, each from an <answer> to the next </answer> (so '<answer>a<answer>b
    </answer>' holds 'a<answer>b'), as `re.findall(r"<answer>(.*?)</answer>")` reads them; that
    regex took quadratic time on a text of unclosed <answer> tags (200,000 of them: minutes). This
    scan is linear.

    Args:
      text: the text to search, typically the final assistant turn.
    Returns:
      The last closed block's content with surrounding whitespace stripped, or None when `text`
      holds no closed <answer>...</answer> block.
    """
    found, pos = None, 0
    while (start := text.find("<answer>", pos)) >= 0:
        end = text.find("</answer>", start + len("<answer>"))
        if end < 0:   # no later block can close either
            break
        found, pos = (start + len("<answer>"), end), end + len("</answer>")
    return None if found is None else text[found[0]:found[1]].strip()


def parse_number(text: str) -> Fraction | None:
    """'1,234', '-5', '3.25', '7/2' -> exact Fraction; None if `text` is not a number."""
    cleaned = text.strip().replace(",", "").replace("_", "")
    if not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?(/[+-]?\d+)?", cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _normalize(text: str) -> str:
    return " ".join(text.strip().lower().split()).rstrip(".")


def exact_match_reward(text: str, answer: str) -> float:
    got = extract_answer(text)
    return float(got is not None and _normalize(got) == _normalize(answer))


def numeric_match_reward(text: str, answer: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    got, want = extract_answer(text), parse_number(answer)
    if got is None or want is None:
        return 0.0
    value = parse_number(got)
    return float(value is not None and math.isclose(value, want, rel_tol=rel_tol, abs_tol=abs_tol))


def arithmetic_reward(text: str, answer: str) -> float:
    """Exact integer (or exact rational) equality: big numbers must be right to the last digit."""
    got, want = extract_answer(text), parse_number(answer)
    value = None if got is None else parse_number(got)
    return float(value is not None and value == want)


def _countdown_value(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and the integer literals of an expression over + - * / and parentheses."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return None
    literals: list[int] = []
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError
            return ops[type(node.op)](left, right)
        raise ValueError("unsupported")

    try:
        return ev(tree.body), literals
    except (ValueError, ZeroDivisionError):
        return None


def countdown_reward(text: str, numbers: Sequence[int], target: int) -> float:
    """1 if the answer is an expression using each given number at most once that equals target."""
    got = extract_answer(text)
    if got is None:
        return 0.0
    expression = got.split("=")[0].strip()  # tolerate "expr = target"
    evaluated = _countdown_value(expression)
    if evaluated is None:
        return 0.0
    value, literals = evaluated
    if Counter(literals) - Counter(numbers):  # some number used more often than given
        return 0.0
    return float(value == target)


def verify_arithmetic(task: Task, final_text: str) -> float:
    return arithmetic_reward(final_text, task.answer)


def verify_countdown(task: Task, final_text: str) -> float:
    return countdown_reward(final_text, task.metadata["numbers"], task.metadata["target"])


def verify_qa(task: Task, final_text: str) -> float:
    """Exact match, or numeric within `metadata['tolerance']` when `metadata['match'] == 'numeric'`."""
    if task.metadata.get("match", "exact") == "numeric":
        return numeric_match_reward(final_text, task.answer, rel_tol=task.metadata.get("tolerance", 1e-6))
    return exact_match_reward(final_text, task.answer)


def task_reward(task: Task, final_text: str) -> float:
    """The reward of `final_text` for `task`, by the verifier of `task.kind` from the registry.

    Kinds are registered with `kinds.register_task_kind`.

    Args:
      task: the task answered; `task.kind` picks the verifier.
      final_text: the final assistant text, holding the answer in <answer>...</answer>.
    Returns:
      The verifier's reward (the built-in verifiers give a value in [0, 1]).
    Raises:
      UnknownTaskKindError: (a ValueError) `task.kind` is not registered; the message names the
        task and lists the registered kinds.
    """
    try:
        kind = get_task_kind(task.kind)
    except UnknownTaskKindError as e:
        raise UnknownTaskKindError(f"task {task.task_id}: {e}") from None
    return kind.verify(task, final_text)
