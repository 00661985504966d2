"""The built-in task kinds 'arithmetic', 'countdown' and 'qa': seeded generators (arithmetic,
Countdown), their JSONL records, and their default environments, registered below exactly as a
user registers a kind (`kinds.register_task_kind`).

JSONL fields of each (read and written by `records.py`, which names the line of a bad one):
  qa          question: str, answer: str|number, [match: 'exact'|'numeric'], [tolerance: number]
  arithmetic  expression: str (answer derived; if given it must agree)
  countdown   numbers: [int, ...], target: int, [solution: str]
  all kinds   [id: str] (default '<file stem>-<line>'); blank lines are skipped.
Default environments: 'arithmetic' the calculator (`calculator_environment`), 'countdown' a
jailed Python tool (`countdown_tool_environment`), 'qa' the math tools
(`math_tasks.math_tool_environment`).
"""
from __future__ import annotations

import ast
import random
from fractions import Fraction
from typing import Any

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tasks.environments import calculator_environment, countdown_tool_environment
from sfrrl_jax.agents.tasks.kinds import register_task_kind
from sfrrl_jax.agents.tasks.math_tasks import math_tool_environment
from sfrrl_jax.agents.tasks.verifiers import verify_arithmetic, verify_countdown, verify_qa
from sfrrl_jax.agents.tools import evaluate_arithmetic, format_number

ANSWER_INSTRUCTION = "Give the final answer as <answer>N</answer>."


# ----------------------------------------------------------------------------- arithmetic

def _arithmetic_steps(expression: str) -> list[list[str]]:
    """Post-order binary steps [left, op, right, result] that evaluate `expression` one op at a time."""
    symbols = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
    steps: list[list[str]] = []

    def walk(node) -> str:
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return str(-int(walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in symbols:
            left, right = walk(node.left), walk(node.right)
            op = symbols[type(node.op)]
            value = format_number(evaluate_arithmetic(f"({left}) {op} ({right})"))
            steps.append([left, op, right, value])
            return value
        raise ValueError(f"unsupported syntax in arithmetic task: {ast.dump(node)[:60]}")

    walk(ast.parse(expression, mode="eval").body)
    return steps


def arithmetic_task(expression: str, task_id: str) -> Task:
    """A calculator task for `expression` (+ - * / and parentheses over integers)."""
    answer = format_number(evaluate_arithmetic(expression))
    return Task(task_id=task_id, kind="arithmetic",
                prompt=f"Compute {expression} using the calculator tool. {ANSWER_INSTRUCTION}",
                answer=answer, metadata={"expression": expression, "steps": _arithmetic_steps(expression)})


def generate_arithmetic_tasks(n: int, seed: int = 0, min_ops: int = 2, max_ops: int = 4,
                              max_digits: int = 5) -> list[Task]:
    """`n` multi-step expressions over integers of up to `max_digits` digits (+ - * only: exact).

    Each expression is made by `arithmetic_task` (kind 'arithmetic', with its calculator steps in
    `metadata["steps"]`); each operand is a random integer in [2, 10**d - 1], d drawn from
    [2, `max_digits`].

    Args:
      n: number of tasks.
      seed: seed of the generator (`random.Random(seed)`); the same seed gives the same tasks.
      min_ops: fewest binary operations in an expression.
      max_ops: most binary operations in an expression (each count drawn uniformly in
        [`min_ops`, `max_ops`]).
      max_digits: most decimal digits of an operand; at least 2.
    Returns:
      `n` tasks with ids 'arith-<seed>-<i>', i in [0, n).
    """
    rng = random.Random(seed)

    def number() -> str:
        return str(rng.randint(2, 10 ** rng.randint(2, max_digits) - 1))

    def build(ops: int, top: bool) -> str:
        if ops == 0:
            return number()
        left_ops = rng.randint(0, ops - 1)
        text = f"{build(left_ops, False)} {rng.choice('+-*')} {build(ops - 1 - left_ops, False)}"
        return text if top else f"({text})"

    return [arithmetic_task(build(rng.randint(min_ops, max_ops), True), f"arith-{seed}-{i}") for i in range(n)]


# ----------------------------------------------------------------------------- countdown

def countdown_task(numbers: list[int], target: int, task_id: str, solution: str | None = None) -> Task:
    prompt = (f"Using the numbers {numbers}, each at most once, and the operations + - * /, reach {target}. "
              "You may run Python code with the python tool. Give the expression as <answer>expression</answer>.")
    return Task(task_id=task_id, kind="countdown", prompt=prompt, answer=solution,
                metadata={"numbers": list(numbers), "target": target})


def generate_countdown_tasks(n: int, seed: int = 0, count: int = 4, max_number: int = 100,
                             max_target: int = 1000) -> list[Task]:
    """Solvable instances: the target is the value of a random expression over a subset of the numbers.

    Each task's `answer` is that expression (one solution); draws whose value is not an integer in
    [1, `max_target`] are discarded and drawn again.

    Args:
      n: number of tasks.
      seed: seed of the generator (`random.Random(seed)`); the same seed gives the same tasks.
      count: how many numbers each task gives (the expression uses 2 to `count` of them).
      max_number: the largest number given (numbers are drawn from [1, `max_number`]).
      max_target: the largest target.
    Returns:
      `n` 'countdown' tasks with ids 'countdown-<seed>-<i>', i in [0, n), and `metadata` holding
      `numbers` and `target`.
    """
    rng = random.Random(seed)
    tasks = []
    while len(tasks) < n:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        chosen = rng.sample(numbers, rng.randint(2, count))
        expr, value = str(chosen[0]), Fraction(chosen[0])
        for x in chosen[1:]:
            op = rng.choice("+-*/")
            if op == "/" and (x == 0 or (value / x).denominator != 1):
                op = "+"
            expr, value = f"({expr} {op} {x})", eval_fraction(value, op, x)
        if value.denominator == 1 and 1 <= value <= max_target:
            tasks.append(countdown_task(numbers, int(value), f"countdown-{seed}-{len(tasks)}", solution=expr))
    return tasks


def eval_fraction(a: Fraction, op: str, b: int) -> Fraction:
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]


# ----------------------------------------------------------------------------- JSONL

def _qa_from_record(record: dict, task_id: str) -> Task:
    question, answer = record["question"], record["answer"]
    if not isinstance(question, str):
        raise ValueError(f"field 'question' must be a string, got {type(question).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"field 'answer' must be a string or number, got {type(answer).__name__}")
    match = record.get("match", "exact")
    if match not in ("exact", "numeric"):
        raise ValueError(f"field 'match' must be 'exact' or 'numeric', got {match!r}")
    metadata: dict[str, Any] = {"match": match}
    if "tolerance" in record:
        tol = record["tolerance"]
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
            raise ValueError(f"field 'tolerance' must be a non-negative number, got {tol!r}")
        metadata["tolerance"] = float(tol)
    return Task(task_id=task_id, kind="qa", prompt=f"{question} {ANSWER_INSTRUCTION}", answer=str(answer),
                metadata=metadata)


def _qa_to_record(task: Task) -> dict:
    return {"question": task.prompt[: -len(ANSWER_INSTRUCTION) - 1], "answer": task.answer, **task.metadata}


def _arithmetic_from_record(record: dict, task_id: str) -> Task:
    expression = record["expression"]
    if not isinstance(expression, str):
        raise ValueError(f"field 'expression' must be a string, got {type(expression).__name__}")
    try:
        task = arithmetic_task(expression, task_id)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"field 'expression' is not a valid arithmetic expression: {e}") from None
    if "answer" in record and str(record["answer"]) != task.answer:
        raise ValueError(f"field 'answer' {record['answer']!r} disagrees with the expression's value {task.answer}")
    return task


def _arithmetic_to_record(task: Task) -> dict:
    return {"expression": task.metadata["expression"]}


def _countdown_from_record(record: dict, task_id: str) -> Task:
    numbers, target = record["numbers"], record["target"]
    if not isinstance(numbers, list) or not numbers or not all(type(x) is int for x in numbers):
        raise ValueError(f"field 'numbers' must be a non-empty list of integers, got {numbers!r}")
    if type(target) is not int:
        raise ValueError(f"field 'target' must be an integer, got {target!r}")
    return countdown_task(numbers, target, task_id, solution=record.get("solution"))


def _countdown_to_record(task: Task) -> dict:
    record = {"numbers": task.metadata["numbers"], "target": task.metadata["target"]}
    if task.answer is not None:
        record["solution"] = task.answer
    return record


# The built-in kinds, registered exactly as a user registers one (see kinds.py).
register_task_kind("qa", verify_qa, from_record=_qa_from_record, to_record=_qa_to_record,
                   fields=("question", "answer"), environment=math_tool_environment)
register_task_kind("arithmetic", verify_arithmetic, from_record=_arithmetic_from_record,
                   to_record=_arithmetic_to_record, fields=("expression",), environment=calculator_environment)
register_task_kind("countdown", verify_countdown, from_record=_countdown_from_record,
                   to_record=_countdown_to_record, fields=("numbers", "target"),
                   environment=countdown_tool_environment)
