"""ToolRunner turns every failure into an error observation; the calculator is exact."""
import asyncio
import threading
import time
from fractions import Fraction

import pytest

from sfrrl_jax.agents.protocols import ToolCall, ToolCallError, ToolResult
from sfrrl_jax.agents.tools import (CalculatorTool, FunctionTool, ToolError, ToolRunner, ToolRunnerConfig,
                                    evaluate_arithmetic, format_number)

ANY_ARGS = {"type": "object"}


class AsyncTool:
    def __init__(self, name, fn, parameters=ANY_ARGS):
        self.name, self.description, self.parameters, self.fn = name, name, parameters, fn

    async def __call__(self, **kw):
        return await self.fn(**kw)


def _run(runner, calls):
    return asyncio.run(runner.run(calls))


def test_every_failure_is_an_observation_in_call_order():
    release = threading.Event()

    async def hang(**_):
        await asyncio.sleep(60)

    async def crash(**_):
        raise KeyError("boom")

    async def refuse(**_):
        raise ToolError("nope, try again")

    async def weird(**_):
        return {1, 2}

    async def structured(**_):
        return {"a": [1, 2]}

    tools = [CalculatorTool(), AsyncTool("hang", hang), AsyncTool("crash", crash), AsyncTool("refuse", refuse),
             AsyncTool("weird", weird), AsyncTool("structured", structured),
             FunctionTool("blocking_hang", "", ANY_ARGS, lambda: release.wait(30))]
    runner = ToolRunner(tools, ToolRunnerConfig(timeout_s=0.3))
    calls = [
        ToolCall("calculator", {"expression": "123456789 * 987654321"}, "c0"),
        ToolCall("nope", {}, "c1"),
        ToolCall("calculator", {"expression": 5, "extra": 1}, "c2"),
        ToolCallError("malformed tool call JSON in x: Expecting value at char 0", name="calculator"),
        ToolCall("hang", {}, "c4"),
        ToolCall("crash", {}, "c5"),
        ToolCall("refuse", {}, "c6"),
        ToolCall("weird", {}, "c7"),
        ToolCall("structured", {}, "c8"),
        ToolCall("blocking_hang", {}, "c9"),
        ToolCall("calculator", {"expression": "1/0"}, "c10"),
    ]
    start = time.perf_counter()
    results = _run(runner, calls)
    elapsed = time.perf_counter() - start
    release.set()
    runner.close()
    assert elapsed < 2.0  # the hung tools cost one timeout, concurrently, not a stuck loop
    got = [(r.name, r.is_error, r.content) for r in results]
    assert got == [
        ("calculator", False, "121932631112635269"),
        ("nope", True, "error: unknown tool 'nope'; available tools: ['blocking_hang', 'calculator', 'crash', "
                       "'hang', 'refuse', 'structured', 'weird']"),
        ("calculator", True, "error: invalid arguments: arguments.expression: expected string, got integer; "
                             "arguments: unexpected property 'extra' (allowed: ['expression'])"),
        ("calculator", True, "error: malformed tool call JSON in x: Expecting value at char 0"),
        ("hang", True, "error: tool 'hang' timed out after 0.3 s"),
        ("crash", True, "error: tool 'crash' failed: KeyError: 'boom'"),
        ("refuse", True, "error: nope, try again"),
        ("weird", True, "error: tool 'weird' returned a non-JSON value"),
        ("structured", False, '{"a": [1, 2]}'),
        ("blocking_hang", True, "error: tool 'blocking_hang' timed out after 0.3 s"),
        ("calculator", True, "error: division by zero"),
    ]
    assert [r.call_id for r in results] == ["c0", "c1", "c2", "", "c4", "c5", "c6", "c7", "c8", "c9", "c10"]


def test_concurrency_bound_and_output_cap():
    state = {"now": 0, "peak": 0}

    async def slow(**_):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.02)
        state["now"] -= 1
        return "y" * 50

    runner = ToolRunner([AsyncTool("slow", slow)], ToolRunnerConfig(max_concurrency=3, max_output_chars=10))
    results = _run(runner, [ToolCall("slow", {}, f"c{i}") for i in range(12)])
    runner.close()
    assert state["peak"] == 3
    assert all(r == ToolResult("slow", "y" * 10 + "\n[truncated 40 chars]", False, f"c{i}", r.elapsed_s)
               for i, r in enumerate(results))


def test_duplicate_tool_names_rejected():
    with pytest.raises(ValueError, match="duplicate tool names"):
        ToolRunner([CalculatorTool(), CalculatorTool()])


@pytest.mark.parametrize("expression, value", [
    ("2 ** 100 - 1", "1267650600228229401496703205375"),
    ("(48213 * 9172) - 55311 * 12", "441545904"),
    ("7 / 2", "3.5"),
    ("-(3 - 10) // 2", "3"),
    ("1/3", "0.333333333333"),
    ("17 % 5", "2"),
])
def test_calculator_values(expression, value):
    assert format_number(evaluate_arithmetic(expression)) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "unsupported syntax"),
    ("2 ** 2000", "exponent must be an integer in"),
    ("2 ** 0.5", "exponent must be an integer in"),
    ("10 ** 500", "result has more than 400 digits"),
    ("1 +", "not an arithmetic expression"),
    ("9" * 500, "expression longer than"),
    ("(10**60) ** 60", "result has more than 400 digits"),
    ("(9**400) ** 1024", "result has more than 400 digits"),
])
def test_calculator_rejects(expression, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        evaluate_arithmetic(expression)


def test_calculator_is_exact():
    assert evaluate_arithmetic("0.1 + 0.2") == Fraction(0.1) + Fraction(0.2)
    assert evaluate_arithmetic("99999 * 99999 * 99999 * 99999") == 99999**4
