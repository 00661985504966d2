"""Tools that run on other machines: a queue of calls served by worker processes anywhere.

When one host's CPUs cannot run enough sandboxes for its trajectories, the tool calls go to
workers on other hosts. The trainer side serves two queues over TCP (the standard library's
`multiprocessing.managers`: authenticated connections, pickled messages, no new dependency);
each worker process connects, builds the tools once from a factory, takes calls off the queue
and puts results back. Whichever worker is free takes the next call, so load spreads by itself,
and adding a worker is starting one process.

    pool = ToolPoolServer(("0.0.0.0", 50051), authkey=secret)          # on the trainer host
    tools = pool.remote_tools(my_tools())    # same names and schemas; calls go to the workers
    env = ToolEnvironment(tools, system_prompt)                         # or any Environment
    # on each tool host (as many processes as it has cores to spare):
    #   SFRRL_TOOL_AUTHKEY=secret python -m sfrrl_jax.agents.tool_pool trainer-host:50051 mypkg.tools:my_tools

`remote_tools` returns ordinary `Tool`s, so the `ToolRunner` around them keeps its meaning: its
timeout covers the round trip (a worker that dies mid-call gives that call a timeout error
observation; the others go on), a tool's exception comes back as that call's error observation,
and a `ToolError` keeps its message. A local run passes the tools themselves. Choosing remote in a
config is `ToolRunnerConfig.remote_address = "HOST:PORT"` (gin-bound like the other configs):
`ToolEnvironment` then runs `place_tools(tools, address)`, one shared pool per address.
Messages are pickled: serve only on networks whose peers hold the authkey and are trusted.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import itertools
import multiprocessing
import os
import queue
import sys
import threading
from multiprocessing.managers import BaseManager
from typing import Any, Callable, Sequence

from sfrrl_jax.agents.protocols import Tool
from sfrrl_jax.agents.tools import ToolError

_CALLS: "queue.Queue" = queue.Queue()
_RESULTS: "queue.Queue" = queue.Queue()


def _calls():
    return _CALLS


def _results():
    return _RESULTS


class _QueueManager(BaseManager):
    pass


_QueueManager.register("calls", callable=_calls)
_QueueManager.register("results", callable=_results)


class ToolPoolServer:
    """Serves the call and result queues on `address` and routes results back to their callers.

    The queues live in a server process (`BaseManager.start`); this process keeps one reader
    thread that hands each result to the coroutine awaiting it."""

    def __init__(self, address: tuple[str, int] = ("127.0.0.1", 0), authkey: bytes | None = None):
        if authkey is None:
            raise ValueError("ToolPoolServer needs an authkey (bytes): workers must present it to connect")
        # spawn, not fork: this process runs JAX's threads, which a forked child must not inherit
        self._manager = _QueueManager(address=address, authkey=authkey, ctx=multiprocessing.get_context("spawn"))
        self._manager.start()
        self.address = self._manager.address          # the bound port when 0 was asked
        self._calls, self._results = self._manager.calls(), self._manager.results()
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_results, name="tool-pool-results", daemon=True)
        self._reader.start()

    def remote_tools(self, tools: Sequence[Tool]) -> list["RemoteTool"]:
        """Stand-ins for `tools` (same name, description, parameters) whose calls go to the workers."""
        return [RemoteTool(self, t.name, t.description, t.parameters) for t in tools]

    async def call(self, name: str, arguments: dict) -> Any:
        """Runs `name(**arguments)` on a worker; raises what the tool raised there."""
        if self._closed.is_set():
            raise RuntimeError("ToolPoolServer is closed")
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiting[call_id] = (loop, future)
        try:
            await asyncio.to_thread(self._calls.put, (call_id, name, dict(arguments)))
            return await future
        finally:  # answered, or given up (a timeout): a late answer is dropped
            with self._lock:
                self._waiting.pop(call_id, None)

    def _read_results(self) -> None:
        while not self._closed.is_set():
            try:
                call_id, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError, ConnectionError):   # the server process ended
                return
            with self._lock:
                waiting = self._waiting.get(call_id)
            if waiting is not None:
                loop, future = waiting
                loop.call_soon_threadsafe(_settle, future, ok, value)

    def close(self) -> None:
        self._closed.set()
        self._reader.join(timeout=2)
        self._manager.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_SHARED: dict[str, ToolPoolServer] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(address: str) -> ToolPoolServer:
    """The one pool this process serves on "HOST:PORT" (started on first use; every environment
    configured with that address shares it). The authkey comes from SFRRL_TOOL_AUTHKEY."""
    with _SHARED_LOCK:
        pool = _SHARED.get(address)
        if pool is None:
            key = os.environ.get("SFRRL_TOOL_AUTHKEY")
            if not key:
                raise ValueError(f"ToolRunnerConfig.remote_address={address!r} needs the SFRRL_TOOL_AUTHKEY "
                                 "environment variable (the shared secret the tool workers present)")
            host, _, port = address.rpartition(":")
            pool = _SHARED[address] = ToolPoolServer((host, int(port)), authkey=key.encode())
        return pool


def place_tools(tools: Sequence[Tool], remote_address: str | None) -> list:
    """`tools` as they run: themselves (None: on this host), or remote stand-ins whose calls go to
    the workers of the pool served on `remote_address` (`ToolRunnerConfig.remote_address`)."""
    if remote_address is None:
        return list(tools)
    return shared_pool(remote_address).remote_tools(tools)


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    elif isinstance(value, tuple) and value[0] == "ToolError":
        future.set_exception(ToolError(value[1]))
    else:
        future.set_exception(RemoteToolError(value[1] if isinstance(value, tuple) else str(value)))


class RemoteToolError(RuntimeError):
    """A tool raised on its worker; the message names the exception type and text."""


class RemoteTool:
    """A `Tool` whose calls run on a `ToolPoolServer`'s workers."""

    def __init__(self, pool: ToolPoolServer, name: str, description: str, parameters):
        self.pool, self.name, self.description, self.parameters = pool, name, description, parameters

    async def __call__(self, **arguments: Any) -> Any:
        return await self.pool.call(self.name, arguments)


def serve_tools(address: tuple[str, int], authkey: bytes, tools: Sequence[Tool], concurrency: int = 8,
                stop: threading.Event | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """A worker: takes calls off the pool at `address` and runs them, `concurrency` at a time,
    until `stop` is set or the pool goes away. The tools' coroutines share one event loop.
    `on_ready()` runs once connected."""
    manager = _QueueManager(address=address, authkey=authkey)
    manager.connect()
    calls, results = manager.calls(), manager.results()
    if on_ready is not None:
        on_ready()
    by_name = {t.name: t for t in tools}
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="tool-worker-loop", daemon=True).start()
    stop = stop or threading.Event()

    def take_calls() -> None:
        while not stop.is_set():
            try:
                call_id, name, arguments = calls.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError, ConnectionError):
                stop.set()
                return
            try:
                tool = by_name[name]   # KeyError: the trainer's tool list and this worker's differ
                message = asyncio.run_coroutine_threadsafe(_answer(call_id, tool(**arguments)), loop).result()
            except BaseException as e:  # noqa: BLE001 -- every failure goes back as that call's error
                message = _failure(call_id, e)
            try:
                results.put(message)
            except (EOFError, OSError, ConnectionError):
                stop.set()
                return

    with concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="tool-worker") as pool:
        for _ in range(concurrency):
            pool.submit(take_calls)
    loop.call_soon_threadsafe(loop.stop)


async def _answer(call_id: int, call) -> tuple:
    """The result message of one call. What the tool raises is caught inside its own coroutine:
    a SystemExit or KeyboardInterrupt (an argparse in the tool) leaving an asyncio Task is
    re-raised out of the worker's event loop, which would stop serving every later call."""
    try:
        return (call_id, True, await call)
    except BaseException as e:  # noqa: BLE001 -- that call's error; the worker's stop is a signal to its main thread
        return _failure(call_id, e)


def _failure(call_id: int, e: BaseException) -> tuple:
    if isinstance(e, ToolError):
        return (call_id, False, ("ToolError", str(e)))
    return (call_id, False, (type(e).__name__, f"{type(e).__name__} on worker {os.getpid()}: {e}"))


def _load_factory(spec: str) -> Callable[[], Sequence[Tool]]:
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"tool factory must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), attr)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sfrrl_jax.agents.tool_pool HOST:PORT module:factory [--concurrency N]`; the
    authkey comes from SFRRL_TOOL_AUTHKEY (never on the command line, where `ps` shows it)."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m sfrrl_jax.agents.tool_pool", description=main.__doc__)
    p.add_argument("address", help="HOST:PORT of the ToolPoolServer")
    p.add_argument("factory", help="module:function returning the tools (the trainer's same list)")
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    key = os.environ.get("SFRRL_TOOL_AUTHKEY")
    if not key:
        print("tool worker: set SFRRL_TOOL_AUTHKEY to the pool's authkey", file=sys.stderr)
        return 2
    host, _, port = args.address.rpartition(":")
    tools = list(_load_factory(args.factory)())
    serve_tools((host, int(port)), key.encode(), tools, args.concurrency, on_ready=lambda: print(
        f"tool worker {os.getpid()}: serving {[t.name for t in tools]} from {args.address}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
