"""Tools and the bounded runner that executes parsed calls.

`ToolRunner.run(calls)` returns one `ToolResult` per item, in order, and never raises for anything
a call does: unparseable call, unknown tool, arguments violating the schema, a tool that raises,
hangs past the timeout or returns garbage all become error observations. Async tools run on the
event loop under a concurrency bound; blocking functions run on the runner's bounded thread pool.
A hung *thread* cannot be killed (its slot stays busy until it returns): once half the pool is
stuck in timed-out calls, or the pool was shut down or broke, later calls get a fresh pool
(`pools_replaced` counts these). Anything that may hang for real, such as user code, belongs in
a process: see `PythonTool`.
"""
from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import operator
import threading
import time
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

from sfrrl_jax.agents.protocols import Tool, ToolCall, ToolCallError, ToolResult
from sfrrl_jax.agents.sandbox import PythonSandbox
from sfrrl_jax.agents.schema import validate


_log = logging.getLogger(__name__)


class ToolError(Exception):
    """Raised by a tool to report a failure whose message the policy should read verbatim."""


@dataclasses.dataclass(frozen=True)
class ToolRunnerConfig:
    """How tool calls run. remote_address: None runs them on this host (a thread pool); "HOST:PORT"
    serves them to remote workers (`agents.tool_pool`: `ToolEnvironment` then queues every call
    there, and workers started with `python -m sfrrl_jax.agents.tool_pool HOST:PORT module:factory`
    and the same SFRRL_TOOL_AUTHKEY run them). The runner's timeout covers the round trip."""

    timeout_s: float = 10.0
    max_concurrency: int = 1024
    thread_workers: int = 8
    max_output_chars: int = 4000
    remote_address: str | None = None

    def __post_init__(self):
        for name in ("timeout_s", "max_concurrency", "thread_workers", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ToolRunnerConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.remote_address is not None:
            host, _, port = str(self.remote_address).rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(f"ToolRunnerConfig.remote_address must be 'HOST:PORT' (e.g. '0.0.0.0:50051'), "
                                 f"got {self.remote_address!r}")


def tool_schema(tool: Tool) -> dict:
    """OpenAI function-calling schema of a tool (what chat templates render in the system turn)."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)}}


class FunctionTool:
    """Wrap a blocking function `fn(**arguments) -> str`; the runner runs it on its thread pool."""

    def __init__(self, name: str, description: str, parameters: Mapping[str, Any], fn: Callable[..., Any]):
        self.name, self.description, self.parameters, self.blocking_fn = name, description, parameters, fn

    async def __call__(self, **arguments: Any) -> Any:
        return await asyncio.to_thread(self.blocking_fn, **arguments)


class ToolRunner:
    def __init__(self, tools: Sequence[Tool], cfg: ToolRunnerConfig = ToolRunnerConfig()):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tool names: {names}")
        self.tools = {t.name: t for t in tools}
        self.cfg = cfg
        self._executor = self._new_pool()
        self._stuck = 0  # pool threads still inside a call that timed out (a thread cannot be killed)
        self._stuck_lock = threading.Lock()
        self.pools_replaced = 0
        self._semaphore: asyncio.Semaphore | None = None

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(self.cfg.thread_workers, thread_name_prefix="tool")

    def _replace_pool(self, why: str) -> None:
        """A fresh pool for later calls: the old one is shut down without waiting (its stuck
        threads end when their calls return, and hold nobody's slot meanwhile)."""
        with self._stuck_lock:
            old, self._executor, self._stuck = self._executor, self._new_pool(), 0
        old.shutdown(wait=False, cancel_futures=True)
        self.pools_replaced += 1
        _log.warning("tool thread pool replaced: %s", why)

    def _submit(self, fn, arguments) -> concurrent.futures.Future:
        try:
            return self._executor.submit(fn, **arguments)
        except (RuntimeError, concurrent.futures.BrokenExecutor) as e:  # shut down or broken: recover
            self._replace_pool(f"{type(e).__name__}: {e}")
            return self._executor.submit(fn, **arguments)

    def _thread_stuck(self, work: concurrent.futures.Future, executor) -> None:
        """A blocking call timed out; its thread is lost until the call returns. Once half the
        pool is lost that way, later calls get a fresh pool instead of queueing behind them."""
        if work.done() or executor is not self._executor:
            return  # it never started (cancelled while queued), or its pool was replaced already
        with self._stuck_lock:
            self._stuck += 1
        # Called on the pool's thread, perhaps after this event loop closed (each trainer step may
        # run its own): a lock, not the loop, guards the count.
        work.add_done_callback(lambda _: self._unstick(executor))
        if self._stuck * 2 >= self.cfg.thread_workers:
            self._replace_pool(f"{self._stuck} of {self.cfg.thread_workers} threads stuck in timed-out calls")

    def _unstick(self, executor) -> None:
        with self._stuck_lock:
            if executor is self._executor and self._stuck > 0:
                self._stuck -= 1

    def schemas(self) -> list[dict]:
        return [tool_schema(t) for t in self.tools.values()]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        """Run all calls of one turn concurrently; results in call order."""
        return list(await asyncio.gather(*(self.run_one(c) for c in calls)))

    def _error(self, name: str, message: str, call_id: str = "", elapsed: float = 0.0) -> ToolResult:
        return ToolResult(name=name, content=self._cap(f"error: {message}"), is_error=True, call_id=call_id,
                          elapsed_s=elapsed)

    def _cap(self, text: str) -> str:
        limit = self.cfg.max_output_chars
        return text if len(text) <= limit else text[:limit] + f"\n[truncated {len(text) - limit} chars]"

    async def run_one(self, call: ToolCall | ToolCallError, tools: Mapping[str, Tool] | None = None) -> ToolResult:
        """One call, against `tools` ({name: tool}; default: the runner's own), e.g. an episode's
        tools bound to its state, under this runner's pool, timeout and checks."""
        if isinstance(call, ToolCallError):
            return self._error(call.name or "invalid", call.message, call.call_id)
        tools = self.tools if tools is None else tools
        tool = tools.get(call.name)
        if tool is None:
            return self._error(call.name, f"unknown tool {call.name!r}; available tools: {sorted(tools)}",
                               call.call_id)
        problems = validate(call.arguments, tool.parameters)
        if problems:
            return self._error(call.name, "invalid arguments: " + "; ".join(problems), call.call_id)
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        async with self._semaphore:
            start = time.perf_counter()
            blocking = getattr(tool, "blocking_fn", None)
            work, executor = None, self._executor
            try:
                if blocking is not None:
                    work = self._submit(blocking, call.arguments)
                    executor = self._executor
                    pending = asyncio.wrap_future(work)
                queues = blocking is None and getattr(tool, "queues_for_capacity", False)
                # no extra Task, unlike wait_for
                async with asyncio.timeout(None if queues else self.cfg.timeout_s) as deadline:
                    if blocking is None:
                        if queues:
                            # Its wait for capacity (sandbox slots) is load, not the call's fault:
                            # the timeout starts once the tool says its work began (the agent's
                            # wall budget still bounds the wait).
                            loop = asyncio.get_running_loop()
                            pending = tool(**call.arguments, on_start=lambda: deadline.reschedule(
                                loop.time() + self.cfg.timeout_s))
                        else:
                            pending = tool(**call.arguments)
                    output = await pending
            except asyncio.TimeoutError:
                if work is not None:
                    self._thread_stuck(work, executor)
                return self._error(call.name, f"tool {call.name!r} timed out after {self.cfg.timeout_s} s",
                                   call.call_id, time.perf_counter() - start)
            except ToolError as e:
                return self._error(call.name, str(e), call.call_id, time.perf_counter() - start)
            except Exception as e:  # a crashing tool is an observation, not a crash of the loop
                return self._error(call.name, f"tool {call.name!r} failed: {type(e).__name__}: {e}",
                                   call.call_id, time.perf_counter() - start)
            elapsed = time.perf_counter() - start
        if not isinstance(output, str):
            try:
                output = json.dumps(output)
            except (TypeError, ValueError):
                return self._error(call.name, f"tool {call.name!r} returned a non-JSON value", call.call_id, elapsed)
        return ToolResult(name=call.name, content=self._cap(output), call_id=call.call_id, elapsed_s=elapsed)


# ----------------------------------------------------------------------------- calculator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION_CHARS = 400
MAX_RESULT_DIGITS = 400


def evaluate_arithmetic(expression: str) -> Fraction:
    """Exact value of `expression` (numbers, + - * / // % **, parentheses). Raises ValueError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1 or abs(right) > 1024:
                    raise ValueError("exponent must be an integer in [-1024, 1024]")
                right = int(right)
                size = max(left.numerator.bit_length(), left.denominator.bit_length()) * abs(right)
                if size > MAX_RESULT_DIGITS * 3.33:  # decide before computing a huge power
                    raise ValueError(f"result has more than {MAX_RESULT_DIGITS} digits")
            elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            value = Fraction(_BINARY[type(node.op)](left, right))
            if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_RESULT_DIGITS * 3.33:
                raise ValueError(f"result has more than {MAX_RESULT_DIGITS} digits")
            return value
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")

    return ev(tree.body)


def format_number(value: Fraction) -> str:
    """Integers exactly; other rationals as a decimal with 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


class CalculatorTool:
    name = "calculator"
    description = "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses)."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
                  "additionalProperties": False}

    async def __call__(self, expression: str) -> str:
        try:
            return format_number(evaluate_arithmetic(expression))
        except (ValueError, OverflowError) as e:
            raise ToolError(str(e)) from None


class PythonTool:
    """Run Python source in the sandbox; stdout is the observation, failures are errors."""

    name = "python"
    description = "Run a Python program (standard library only, no network) and return what it prints."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"],
                  "additionalProperties": False}

    queues_for_capacity = True  # ToolRunner's timeout starts at `on_start`, once a sandbox slot is held

    def __init__(self, sandbox: PythonSandbox):
        self.sandbox = sandbox

    async def __call__(self, code: str, on_start=None) -> str:
        result = await self.sandbox.run(code, on_slot=on_start)
        problem = result.error_summary()
        if problem is None:
            return result.stdout if result.stdout else "(no output)"
        parts = [problem]
        if result.stderr.strip():
            parts.append(result.stderr.strip()[-1500:])
        if result.stdout.strip():
            parts.append("stdout:\n" + result.stdout[:1500])
        raise ToolError("\n".join(parts))
