"""Tools and the bounded runner that executes parsed calls.

`ToolRunner.run(calls)` returns one `ToolResult` per item, in order, and never raises for anything
a call does: unparseable call, unknown tool, arguments violating the schema, a tool that raises
(SystemExit, KeyboardInterrupt and GeneratorExit included: see `sfrrl_jax.aio`), hangs past the
timeout, ignores cancellation, or returns garbage or a huge value all become observations. Only
the cancellation of the caller itself propagates (after the call in flight is given up).

Async tools run on the event loop, each call as its own task under a concurrency bound; at the
timeout the call is cancelled and, if it does not end within `aio.ABANDON_GRACE_S`, abandoned:
the observation says it timed out, and the task runs on unawaited (`orphaned_calls` counts these,
and a trajectory's count is its `metadata["orphaned_tool_calls"]`). Blocking functions run on the
runner's pool of daemon threads (`aio.DaemonThreadPool`). A hung *thread* cannot be killed: at the
timeout it is written off and another thread takes its place, so queued calls, which nobody but
their own caller ever cancels, never wait behind it, and it never holds the process at exit. A
pool that was shut down under the runner is replaced (`pools_replaced` counts these). Anything
that may hang for real, such as model-written code, belongs in a process: see `PythonTool`.

A non-str result is sent as its JSON, capped at `max_output_chars` like a str. A large one (a
bounded walk of it says so) is encoded in a worker thread by the incremental encoder, only as far
as the cap: a 50 MB list costs the event loop nothing and the thread microseconds.
"""
from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import operator
import time
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

from sfrrl_jax.agents.protocols import Tool, ToolCall, ToolCallError, ToolResult
from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox
from sfrrl_jax.agents.schema import validate
from sfrrl_jax.aio import (DaemonThreadPool, Deadline, Raised, describe, loop_waiter, note_orphan, own_cancellation,
                           user_task, wait_or_abandon)


_log = logging.getLogger(__name__)

# A non-str result walked past this many JSON items (or string bytes / 256) is encoded off the loop.
LARGE_RESULT_ITEMS = 20_000


class ToolError(Exception):
    """Raised by a tool to report a failure whose message the policy should read verbatim."""


@dataclasses.dataclass(frozen=True)
class ToolRunnerConfig:
    """How tool calls run (gin-bound as `sfrrl.ToolRunnerConfig`).

    Attributes:
      timeout_s: each call's limit, from the moment it starts (on Ray: from its dispatch to an
        actor, so it covers the round trip; time queued for a free actor slot never counts).
      max_concurrency: calls running at once on this host (local backend).
      thread_workers: threads for blocking tools (`FunctionTool`), per host / per Ray actor.
      max_output_chars: an observation's cap; longer ones are truncated, saying so.
      backend: 'local' runs the calls on this host; 'ray' on a pool of Ray actors
        (`agents.ray_tools`: the tools are built once per actor, calls spread over the actors'
        free slots, a dead actor's call is an error observation and the actor is replaced; an
        environment with `open_episode` keeps each episode's state on an actor).
      ray_address: the cluster `ray.init(address=...)` joins when Ray is not yet initialized in
        this process: 'auto' (the cluster `ray start` runs on this machine), 'HOST:PORT' or
        'ray://HOST:PORT'; None: RAY_ADDRESS if set, else a new cluster on this machine alone.
      ray_actors: size of the actor pool; None: the cluster's CPUs / `ray_actor_cpus`.
      ray_actor_cpus: CPUs each pool actor reserves (Ray's `num_cpus`); 0 reserves none, so several
        pools (a train and an eval environment, a bench's trainers) share a cluster (their sandboxes
        use the CPUs either way). A pool that needs more than the cluster has free is refused.
      ray_actor_concurrency: calls one actor runs at once; more wait in this process for a free
        slot (reported as the result's `queue_s`, `tools/queue_s_p50|p99` in a step's metrics).
      ray_actor_per_episode: each episode gets an actor of its own, killed when it closes (a
        process start and the package's imports per trajectory); False places episodes on the
        pool's actors, each holding its episodes' state until they close.
    """

    timeout_s: float = 10.0
    max_concurrency: int = 1024
    thread_workers: int = 8
    max_output_chars: int = 4000
    backend: str = "local"
    ray_address: str | None = None
    ray_actors: int | None = None
    ray_actor_cpus: float = 0.0
    ray_actor_concurrency: int = 8
    ray_actor_per_episode: bool = False

    def __post_init__(self):
        for name in ("timeout_s", "max_concurrency", "thread_workers", "max_output_chars", "ray_actor_concurrency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ToolRunnerConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.backend not in TOOL_BACKENDS:
            raise ValueError(f"ToolRunnerConfig.backend must be one of {list(TOOL_BACKENDS)}, got {self.backend!r}")
        if self.ray_actors is not None and (not isinstance(self.ray_actors, int) or self.ray_actors <= 0):
            raise ValueError(f"ToolRunnerConfig.ray_actors must be a positive int or None, got {self.ray_actors!r}")
        if not self.ray_actor_cpus >= 0:
            raise ValueError(f"ToolRunnerConfig.ray_actor_cpus must be >= 0, got {self.ray_actor_cpus!r}")
        if self.ray_address is not None and not (isinstance(self.ray_address, str) and self.ray_address.strip()):
            raise ValueError(f"ToolRunnerConfig.ray_address must be None, 'auto', 'HOST:PORT' or 'ray://HOST:PORT', "
                             f"got {self.ray_address!r}")


# Where calls run: this host, or a Ray cluster's actors (`agents.ray_tools`).
TOOL_BACKENDS = ("local", "ray")


def tool_schema(tool: Tool) -> dict:
    """OpenAI function-calling schema of a tool (what chat templates render in the system turn)."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)}}


class FunctionTool:
    """Wrap a blocking function `fn(**arguments) -> str`; the runner runs it on its daemon thread
    pool (awaited directly, outside a runner, it runs in asyncio's default executor)."""

    def __init__(self, name: str, description: str, parameters: Mapping[str, Any], fn: Callable[..., Any]):
        self.name, self.description, self.parameters, self.blocking_fn = name, description, parameters, fn

    async def __call__(self, **arguments: Any) -> Any:
        return await asyncio.to_thread(self.blocking_fn, **arguments)


class _TimedOut:
    """run_one's outcome of a call given up at its timeout."""


_TIMED_OUT = _TimedOut()


class _Cancelled:
    """run_one's outcome of a blocking call cancelled before it ran (its pool was shut down)."""


_CANCELLED = _Cancelled()


class ToolRunner:
    """Runs parsed calls against `tools` under `cfg` (see the module doc for what it guarantees).

    Each call's arguments are checked against its tool's JSON schema (`parameters`); async tools
    run on the event loop as their own tasks, blocking ones (with a `blocking_fn`, as
    `FunctionTool`) on the runner's pool of `cfg.thread_workers` daemon threads; at most
    `cfg.max_concurrency` calls run at once, each under `cfg.timeout_s`. Observations longer than
    `cfg.max_output_chars` are truncated.

    `run(calls)` (one turn's calls, run concurrently) returns a `list[ToolResult]`, one per item of
    `calls`, in call order. It never raises for anything a call does: an unparseable call
    (`ToolCallError`), an unknown tool, arguments violating the schema, a tool that raises (a
    `ToolError`'s message is passed on verbatim), times out, or returns a value JSON cannot hold
    each give a result with `is_error=True` and content 'error: <message>'. Only the cancellation
    of the caller itself propagates. `run_one(call, tools)` runs one call, optionally against other
    tools. `close()` cancels queued blocking calls.

    Args:
      tools: the tools, by their distinct `name`s.
      cfg: timeout, concurrency bound, thread-pool size and output cap (`ToolRunnerConfig`).

    Attributes:
      tools: `{name: tool}`.
      cfg: the `ToolRunnerConfig`.
      orphaned_calls: calls abandoned at their timeout, or when their caller was cancelled, while
        still running: an async tool that ignored cancellation, a blocking call in a thread written off.
      pools_replaced: thread pools found shut down and replaced.

    Raises:
      ValueError: (constructor) two tools share a name.
    """

    def __init__(self, tools: Sequence[Tool], cfg: ToolRunnerConfig = ToolRunnerConfig()):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tool names: {names}")
        self.tools = {t.name: t for t in tools}
        self.cfg = cfg
        self._executor = self._new_pool()
        self.pools_replaced = 0
        self.orphaned_calls = 0
        self._semaphore: asyncio.Semaphore | None = None

    def _new_pool(self) -> DaemonThreadPool:
        return DaemonThreadPool(self.cfg.thread_workers, name="tool")

    def _submit(self, fn, arguments) -> tuple[concurrent.futures.Future, DaemonThreadPool]:
        pool = self._executor
        try:
            return pool.submit(fn, **arguments), pool
        except RuntimeError as e:  # shut down under the runner: later calls get a fresh pool
            self._executor = pool = self._new_pool()
            self.pools_replaced += 1
            _log.warning("tool thread pool replaced: %s", e)
            return pool.submit(fn, **arguments), pool

    def _orphaned(self) -> None:
        self.orphaned_calls += 1

    def schemas(self) -> list[dict]:
        return [tool_schema(t) for t in self.tools.values()]

    def close(self) -> None:
        """Queued blocking calls are cancelled (their callers read an error); running ones end
        when they return, on daemon threads."""
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

    def checked_tool(self, call: ToolCall | ToolCallError, tools: Mapping[str, Tool] | None = None
                     ) -> Tool | ToolResult:
        """The tool `call` names, or the error result of a call that cannot run: it did not parse,
        names no tool of `tools` (default: the runner's own), or its arguments break the schema."""
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
        return tool

    async def run_one(self, call: ToolCall | ToolCallError, tools: Mapping[str, Tool] | None = None) -> ToolResult:
        """One call, against `tools` ({name: tool}; default: the runner's own), e.g. an episode's
        tools bound to its state, under this runner's pool, timeout and checks."""
        tool = self.checked_tool(call, tools)
        if isinstance(tool, ToolResult):
            return tool
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        async with self._semaphore:
            start = time.perf_counter()
            blocking = getattr(tool, "blocking_fn", None)
            if blocking is not None:
                output = await self._run_blocking(blocking, call.arguments)
            else:
                output = await self._run_async(tool, call.arguments)
            elapsed = time.perf_counter() - start
        if output is _TIMED_OUT:
            return self._error(call.name, f"tool {call.name!r} timed out after {self.cfg.timeout_s} s",
                               call.call_id, elapsed)
        if output is _CANCELLED:
            return self._error(call.name, f"tool {call.name!r} was not run: its thread pool was shut down",
                               call.call_id, elapsed)
        if isinstance(output, Raised):
            if isinstance(output.error, ToolError):
                return self._error(call.name, str(output.error), call.call_id, elapsed)
            # a crashing tool is an observation, not a crash of the loop
            return self._error(call.name, f"tool {call.name!r} failed: {describe(output.error)}", call.call_id,
                               elapsed)
        content = await self._content(output)
        if content is None:
            return self._error(call.name, f"tool {call.name!r} returned a non-JSON value", call.call_id, elapsed)
        return ToolResult(name=call.name, content=content, call_id=call.call_id, elapsed_s=elapsed)

    async def _run_async(self, tool: Tool, arguments: Mapping[str, Any]) -> Any:
        """The tool's value, a `Raised`, or _TIMED_OUT. The call is a task of its own, so that one
        ignoring cancellation can be abandoned (`aio.wait_or_abandon`)."""
        loop = asyncio.get_running_loop()
        timeout = self.cfg.timeout_s
        kwargs = dict(arguments)
        if getattr(tool, "queues_for_capacity", False):
            # Its wait for capacity (sandbox slots) is load, not the call's fault: the timeout
            # starts once the tool says its work began (the agent's wall budget still bounds the wait).
            deadline = Deadline(None)
            kwargs["on_start"] = lambda: deadline.move(loop.time() + timeout)
        else:
            deadline = Deadline(loop.time() + timeout)
        task = user_task(tool, **kwargs)
        if not await wait_or_abandon(task, deadline, on_abandon=self._orphaned):
            return _TIMED_OUT
        if task.cancelled():  # it cancelled itself: its own error, not a stop of the caller
            return Raised(asyncio.CancelledError())
        return task.result()

    async def _run_blocking(self, fn: Callable[..., Any], arguments: Mapping[str, Any]) -> Any:
        """The function's value, a `Raised`, _TIMED_OUT or _CANCELLED. At the timeout (or when
        the caller is cancelled) a call still queued is dropped, one running is abandoned: its
        thread is written off (the pool starts another)."""
        work, pool = self._submit(fn, arguments)
        try:
            await asyncio.wait((loop_waiter(work),), timeout=self.cfg.timeout_s)
        except asyncio.CancelledError:
            self._give_up_thread(work, pool)
            raise
        if not work.done():
            self._give_up_thread(work, pool)
            return _TIMED_OUT
        if work.cancelled():
            return _CANCELLED
        error = work.exception()
        return Raised(error) if error is not None else work.result()

    def _give_up_thread(self, work: concurrent.futures.Future, pool: DaemonThreadPool) -> None:
        if work.cancel() or work.done():
            return  # dropped from the queue before it ran, or it just finished
        pool.abandon(work)  # running: its thread is written off, another takes its place
        note_orphan()
        self._orphaned()

    async def _content(self, output: Any) -> str | None:
        """The observation text of a tool's value (capped), or None for a value JSON cannot hold."""
        if isinstance(output, str):
            return self._cap(output)  # len and a slice: cheap however long
        limit = self.cfg.max_output_chars
        try:
            if not _large(output):
                return self._cap(json.dumps(output))
            return await asyncio.to_thread(_capped_json, output, limit)
        except asyncio.CancelledError:
            if own_cancellation():
                raise
            return None
        except BaseException:  # the value's own methods (a float subclass's repr...) are user code too
            return None


def _large(value: Any, budget: int = LARGE_RESULT_ITEMS) -> bool:
    """Whether encoding `value` may take long: a walk of at most `budget` steps (containers'
    lengths are read, not iterated, before they are walked)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            budget -= 1 + len(item) // 256
        elif isinstance(item, (list, tuple, dict)):
            if len(item) > budget:
                return True
            budget -= 1 + len(item)
            stack.extend(item.values() if isinstance(item, dict) else item)
            if isinstance(item, dict):
                stack.extend(k for k in item if isinstance(k, str))
        else:
            budget -= 1
        if budget < 0:
            return True
    return False


def _capped_json(value: Any, limit: int) -> str:
    """`json.dumps(value)` up to `limit` characters, the rest never encoded: the pure-Python
    incremental encoder (not json.dumps's one-shot C encoder, which would hold the GIL, and so
    the event loop, for the whole value) stops at the cap. Raises as json.dumps does for what it
    reached."""
    pieces, size = [], 0
    for piece in json.JSONEncoder().iterencode(value):
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            return "".join(pieces)[:limit] + f"\n[truncated: its JSON is longer than {limit} chars]"
    return "".join(pieces)


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
    """The `calculator` tool: exact arithmetic on one `expression` argument (a string).

    Evaluates with `evaluate_arithmetic` (numbers, + - * / // % **, parentheses; at most
    `MAX_EXPRESSION_CHARS` characters and `MAX_RESULT_DIGITS` digits) and returns the value as
    `format_number` writes it: integers exactly, other rationals as a decimal with 12 significant
    digits. An expression it cannot evaluate (bad syntax, division by zero, too large) raises
    `ToolError` with the reason, which the runner returns as an error observation. Stateless: one
    instance serves every trajectory.
    """

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
