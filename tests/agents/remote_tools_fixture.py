"""Tools for tests/agents/test_tool_pool.py's worker processes (`module:factory` on their command line)."""
import asyncio
import os

from sfrrl_jax.agents.tools import FunctionTool, ToolError


class SlowAdd:
    name, description = "slow_add", "adds two integers, slowly, and says which worker did it"
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                   "sleep_s": {"type": "number"}}, "required": ["a", "b"]}

    in_flight = 0

    async def __call__(self, a, b, sleep_s=0.05):
        SlowAdd.in_flight += 1   # calls of this worker running at once (its loop is one thread)
        seen = SlowAdd.in_flight
        try:
            await asyncio.sleep(sleep_s)
        finally:
            SlowAdd.in_flight -= 1
        return f"{a + b} by {os.getpid()} with {seen}"


def _fail(kind):
    if kind == "tool_error":
        raise ToolError("the tool refuses: kind=tool_error")
    if kind == "crash":
        raise ZeroDivisionError("division by zero inside the tool")
    if kind == "die":
        os._exit(3)   # the worker process dies mid-call
    if kind == "exit":
        raise SystemExit(2)   # what argparse does on bad input
    if kind == "interrupt":
        raise KeyboardInterrupt
    return "fine"


class AsyncExit:
    name, description = "async_exit", "an async tool that calls sys.exit"
    parameters = {"type": "object", "properties": {}}

    async def __call__(self):
        raise SystemExit("async exit")


def tools():
    return [SlowAdd(), FunctionTool("fail", "fails as asked", {"type": "object", "properties": {"kind": {"type": "string"}},
                                                               "required": ["kind"]}, _fail),
            AsyncExit()]
