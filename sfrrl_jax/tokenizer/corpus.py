"""A small, deterministic training corpus for the tiny tokenizer: the calculator/countdown domain.

It holds the kinds of text the tiny model reads and writes: task prompts, tool schemas, tool-call
JSON, tool results, short Python for Countdown, error observations and answers. Digits are split
one by one by the pre-tokenizer, so the numbers here only teach the merges around them.
"""
from __future__ import annotations

import json
import random

_WORDS = (
    "You are a careful assistant that solves problems step by step with tools. "
    "Call the calculator tool for every arithmetic step. Compute the value of the expression. "
    "Give the final answer as <answer>N</answer>. Using the numbers each at most once, and the "
    "operations + - * /, reach the target. You may run Python code with the python tool. "
    "Answer the question. The result is correct. error: unknown tool. error: malformed tool call "
    "JSON. error: invalid arguments. error: timed out. Traceback (most recent call last): File "
    "line in module NameError SyntaxError ValueError ZeroDivisionError division by zero "
    "Available tools: calculator, python. Let me compute the first step. Now the next step. "
    "So the answer is"
)


def _expression(rng: random.Random) -> str:
    a, b = rng.randint(10, 99999), rng.randint(2, 9999)
    op = rng.choice(["+", "-", "*"])
    if rng.random() < 0.4:
        c = rng.randint(2, 999)
        return f"({a} {op} {b}) {rng.choice(['+', '-', '*'])} {c}"
    return f"{a} {op} {b}"


def _python_snippet(rng: random.Random) -> str:
    nums = [rng.randint(1, 100) for _ in range(rng.randint(3, 4))]
    target = rng.randint(10, 999)
    return (
        "import itertools\n"
        f"nums = {nums}\n"
        f"target = {target}\n"
        "for a, b, c in itertools.permutations(nums, 3):\n"
        "    for expr in [f'{a}+{b}*{c}', f'({a}-{b})*{c}', f'{a}*{b}-{c}']:\n"
        "        if eval(expr) == target:\n"
        "            print(expr)\n"
    )


def build_corpus(num_lines: int = 3000, seed: int = 0) -> list[str]:
    """Return `num_lines` domain lines (plus fixed vocabulary lines); identical for the same seed."""
    rng = random.Random(seed)
    schema = {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    }
    lines = [_WORDS, json.dumps(schema, separators=(",", ":"))]
    for i in range(num_lines):
        kind = i % 6
        if kind == 0:
            lines.append(f"Compute {_expression(rng)} using the calculator tool. "
                         "Give the final answer as <answer>N</answer>.")
        elif kind == 1:
            lines.append("calculator" + json.dumps({"expression": _expression(rng)}, separators=(",", ":")))
        elif kind == 2:
            lines.append(str(rng.randint(0, 10**12)))
        elif kind == 3:
            nums = [rng.randint(1, 100) for _ in range(4)]
            lines.append(f"Using the numbers {nums}, each at most once, and + - * /, reach {rng.randint(10, 999)}. "
                         "Give the expression as <answer>expression</answer>.")
        elif kind == 4:
            lines.append("python" + json.dumps({"code": _python_snippet(rng)}, separators=(",", ":")))
        else:
            lines.append(f"So the answer is <answer>{rng.randint(-10**9, 10**12)}</answer>")
    return lines
