"""MCP servers' tools as ordinary tools of the agent loop.

`mcp_tools(server)` connects to a Model Context Protocol server, either a command that starts a
stdio server (`"npx -y @modelcontextprotocol/server-filesystem /data"`, or an argv list) or a
streamable-HTTP URL (`"http://host:8000/mcp"`), lists its tools (all pages) and returns one
`McpTool` per server tool. An `McpTool` is a `Tool` like any other (`name`, `description`, the
server's JSON input schema as `parameters`, `async __call__(**arguments) -> str`), so
`ToolEnvironment`, `ToolRunner` (schema check, timeout, output cap, errors as observations) and
the agent loop use it unchanged.

Why a thread per connection: the MCP SDK's client session is a stack of anyio context managers
(task groups, the stdio subprocess, the HTTP client) bound to the task, and so the event loop,
that entered them. The agent loop calls tools from many tasks, and a process may run several
event loops one after another (each `asyncio.run`, a notebook's `aio.run_sync`). So each
connection lives on its own daemon thread with its own event loop, from connecting to closing, in
one task that holds the SDK's context managers the way the SDK expects. A call from any loop
submits the request to the connection's loop (`asyncio.run_coroutine_threadsafe`) and awaits it
there (`asyncio.wrap_future`): cancelling the caller (the runner's timeout) cancels the remote
request, and the connection serves the next call. This also keeps `mcp_tools` a plain synchronous
function, callable from a notebook or a gin binding without a running loop.

What a call returns: the result's text blocks joined with newlines; non-text blocks as a short
placeholder (`[image/png content]`); structured content as its JSON where the result has no text.
A result flagged `isError`, an MCP protocol error and a broken connection (the server exited) raise
`ToolError` with the server's message, which `ToolRunner` turns into that call's error observation.

The tools of one `mcp_tools` call share one `McpConnection` (`tool.connection`); `close()` (also
the context manager's exit, and at interpreter exit) ends the session and stops a stdio server.
The `mcp` package is an optional extra (`pip install 'sfrrl_jax[mcp]'`), imported only when used.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import math
import shlex
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

from sfrrl_jax.agents.tools import ToolError
from sfrrl_jax.aio import describe, own_cancellation

DEFAULT_PARAMETERS = {"type": "object", "properties": {}}
MAX_LIST_PAGES = 1000  # a server whose tools/list cursors never end cannot hang the connect
CLOSE_TIMEOUT_S = 15.0  # the SDK's stdio shutdown: stdin closed, 2 s, SIGTERM, 2 s, SIGKILL, 2 s


def _import_mcp():
    try:
        import mcp
        import mcp.client.streamable_http  # noqa: F401
    except ImportError as e:
        raise ImportError(f"MCP tools need the MCP SDK: pip install 'sfrrl_jax[mcp]' ({e})") from e
    return mcp


def _errlog():
    """Where a stdio server's stderr goes: ours, where it is a real file (not in every notebook)."""
    try:
        return sys.stderr if sys.stderr.fileno() >= 0 else subprocess.DEVNULL
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


class McpConnection:
    """One live MCP client session, held on its own daemon thread and event loop (module doc).

    Constructing it connects and lists the server's tools; calls may then come from any thread
    and any event loop. Use it as a context manager, or `close()` it; it is also closed at exit.

    Args:
      server: an http(s) URL (streamable HTTP), or the command of a stdio server: a string
        (split with `shlex`) or an argv sequence.
      env: environment variables for a stdio server, over the SDK's safe defaults (PATH, HOME...).
      cwd: the working directory of a stdio server.
      headers: HTTP headers for every request to a URL server (e.g. Authorization).
      connect_timeout_s: bound on starting, the handshake and listing the tools.

    Attributes:
      server: the server's URL or command line (for messages).
      listed_tools: the server's tools as the SDK lists them (`mcp.types.Tool`).

    Raises:
      ImportError: the `mcp` package is missing.
      ValueError: an empty command, or options that do not fit the transport.
      ConnectionError: the server could not be started or reached, or failed the handshake or the
        listing (the message names the server and the cause). Nothing is left running.
      TimeoutError: it did not get that far within `connect_timeout_s`; raised once the server is
        stopped (one that ignores its closed stdin adds the SDK's 2 s grace before SIGTERM).
    """

    def __init__(self, server: str | Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Any = None,
                 headers: Mapping[str, str] | None = None, connect_timeout_s: float = 30.0):
        mcp = _import_mcp()
        # how to connect again: a copy of this connection in another process (a Ray tool actor's)
        # opens its own session with the same server (a stdio server: its own subprocess)
        self._spec = (server if isinstance(server, str) else list(server),
                      {"env": dict(env) if env else None, "cwd": cwd, "headers": dict(headers) if headers else None,
                       "connect_timeout_s": connect_timeout_s})
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s!r}")
        is_url = isinstance(server, str) and server.strip().lower().startswith(("http://", "https://"))
        if is_url:
            if env is not None or cwd is not None:
                raise ValueError(f"env and cwd apply to a stdio server command, not to the URL {server!r}")
            self.server = server.strip()
            self._transport = lambda: _http_transport(mcp, self.server, headers, connect_timeout_s)
        else:
            argv = shlex.split(server) if isinstance(server, str) else [str(a) for a in server]
            if not argv:
                raise ValueError(f"empty MCP server command: {server!r}")
            if headers is not None:
                raise ValueError(f"headers apply to an http(s) MCP server URL, not to the command {argv!r}")
            self.server = shlex.join(argv)
            params = mcp.StdioServerParameters(command=argv[0], args=argv[1:], env=dict(env) if env else None,
                                               cwd=cwd)
            self._transport = lambda: mcp.stdio_client(params, errlog=_errlog())
        self._mcp = mcp
        self._timeout = float(connect_timeout_s)
        self._client: Any = None
        self._lock = threading.Lock()
        self._done = False  # the loop takes no more calls (closed, or the session ended)
        self._ended = "it is closed"  # why, for the ToolError of a later call
        self._stop_requested = False
        self._closing: asyncio.Event | None = None
        self._scope: Any = None  # the session's anyio cancel scope
        self._ready: Future = Future()
        self.listed_tools: list = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"mcp {self.server[:60]}", daemon=True)
        self._thread.start()
        try:
            self.listed_tools = self._ready.result(timeout=self._timeout + CLOSE_TIMEOUT_S)
        except BaseException as e:  # (also an interrupt while waiting: the session is given up)
            self._request_stop()
            self._thread.join(CLOSE_TIMEOUT_S)  # the session is unwound: no subprocess left
            if isinstance(e, TimeoutError):
                raise TimeoutError(f"MCP server {self.server} did not connect and list its tools within "
                                   f"{self._timeout} s") from None
            raise
        atexit.register(self.close)

    # ------------------------------------------------------------------ the connection's thread

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._session())
        finally:
            with self._lock:
                self._done = True
            try:  # calls still pending end now (their callers read a ToolError)
                self._loop.run_until_complete(asyncio.sleep(0))  # submissions made before `_done`
                pending = asyncio.all_tasks(self._loop)
                for task in pending:
                    task.cancel()
                if pending:
                    self._loop.run_until_complete(asyncio.wait(pending, timeout=CLOSE_TIMEOUT_S))
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    async def _session(self) -> None:
        import anyio
        self._closing = asyncio.Event()
        connected = False
        try:
            # One scope over the whole session, so the SDK's context managers nest properly; its
            # deadline bounds the connect and is lifted once the tools are listed.
            with anyio.CancelScope(deadline=anyio.current_time() + self._timeout) as scope:
                self._scope = scope
                if self._stop_requested:
                    scope.cancel()
                async with self._mcp.Client(self._transport(), cache=None) as client:
                    tools = await _list_all_tools(client)
                    self._client, connected = client, True
                    scope.deadline = math.inf
                    self._ready.set_result(tools)
                    await self._closing.wait()
            if not connected:
                self._ready.set_exception(TimeoutError())
        except Exception as e:
            if not connected:
                self._ready.set_exception(ConnectionError(
                    f"could not connect to MCP server {self.server}: {_cause(e)}"))
            else:
                self._ended = f"the connection broke: {_cause(e)}"
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            raise

    # ------------------------------------------------------------------ calls from any loop

    async def call_tool(self, name: str, arguments: Mapping[str, Any]) -> Any:
        """The server's `CallToolResult` of one call, from any event loop (module doc).

        Args:
          name: the server's tool name.
          arguments: the arguments object.
        Returns:
          The SDK's `CallToolResult` (its `is_error` flag is not acted on here).
        Raises:
          ToolError: an MCP protocol error, a broken connection, or a closed connection.
          asyncio.CancelledError: the caller was cancelled (the request on the server is cancelled).
        """
        with self._lock:
            if self._done or self._client is None:
                raise ToolError(f"no connection to MCP server {self.server}: {self._ended}")
            remote = asyncio.run_coroutine_threadsafe(self._call(name, dict(arguments)), self._loop)
        try:
            return await asyncio.wrap_future(remote)
        except asyncio.CancelledError:
            if own_cancellation():
                raise  # the caller's own cancellation (wrap_future has cancelled the remote call)
            raise ToolError(f"the connection to MCP server {self.server} was closed during the call") from None

    async def _call(self, name: str, arguments: dict) -> Any:
        try:
            return await self._client.call_tool(name, arguments)
        except self._mcp.MCPError as e:
            if e.code == self._mcp.types.CONNECTION_CLOSED:
                raise ToolError(f"the connection to MCP server {self.server} was lost (the server exited "
                                f"or the connection broke): {e.message}") from None
            raise ToolError(e.message or f"MCP error {e.code}") from None
        except Exception as e:
            raise ToolError(f"MCP call to {name!r} failed: {_cause(e)}") from None

    # ------------------------------------------------------------------ closing

    @property
    def closed(self) -> bool:
        """Whether the session has ended (closed, or the connection died and it was unwound)."""
        return self._done or not self._thread.is_alive()

    def _request_stop(self) -> None:
        """From any thread: end the session (a connect in progress is cancelled)."""
        def stop():
            self._stop_requested = True
            if self._closing is not None:
                self._closing.set()
            if self._scope is not None and self._client is None:
                self._scope.cancel()
        try:
            self._loop.call_soon_threadsafe(stop)
        except RuntimeError:
            pass  # the loop is already closed

    def __reduce__(self):
        # Pickles as what it connects to: the copy connects on its own (one session per process;
        # the tools of one pickled environment share it, as pickle keeps shared objects shared).
        server, kwargs = self._spec
        return (_reconnect, (server, kwargs))

    def close(self) -> None:
        """End the session: calls in flight fail with `ToolError`, a stdio server is stopped
        (its stdin closed, then SIGTERM, then SIGKILL, as the SDK does). Idempotent; waits for the
        shutdown (bounded) unless called on the connection's own thread."""
        atexit.unregister(self.close)
        self._request_stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_TIMEOUT_S)

    def __enter__(self) -> McpConnection:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"McpConnection({self.server!r}, {'closed' if self.closed else 'open'})"


def _http_transport(mcp, url: str, headers: Mapping[str, str] | None, timeout: float):
    """The SDK's streamable-HTTP transport over an HTTP client that sends `headers`."""
    import httpx2  # the SDK's HTTP client

    @contextlib.asynccontextmanager
    async def connect():
        client = httpx2.AsyncClient(headers=dict(headers or {}),
                                    timeout=httpx2.Timeout(min(30.0, timeout), read=300.0))  # the SDK's defaults
        async with client, mcp.client.streamable_http.streamable_http_client(url, http_client=client) as streams:
            yield streams
    return connect()


async def _list_all_tools(client) -> list:
    tools, cursor, seen = [], None, set()
    for _ in range(MAX_LIST_PAGES):  # the pages of tools/list, until no (or a repeated) cursor
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        if page.next_cursor is None or page.next_cursor in seen:
            break
        cursor = page.next_cursor
        seen.add(cursor)
    return tools


def _cause(e: BaseException) -> str:
    """A readable cause: an exception group's leaves (the SDK's task groups wrap errors)."""
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_cause(x) for x in e.exceptions)
    return describe(e)


def _reconnect(server: str | list, kwargs: dict) -> "McpConnection":
    return McpConnection(server, **kwargs)


class McpTool:
    """One tool of an MCP server, as a `Tool` of the agent loop (see the module doc).

    Attributes:
      name: the server's tool name.
      description: its description ('' when the server gives none).
      parameters: its JSON input schema (`{"type": "object", "properties": {}}` when none).
      connection: the `McpConnection` it calls through (shared by one `mcp_tools` call's tools).
    """

    def __init__(self, connection: McpConnection, name: str, description: str | None,
                 parameters: Mapping[str, Any] | None):
        self.connection, self.name = connection, name
        self.description = description or ""
        self.parameters = dict(parameters) if parameters else dict(DEFAULT_PARAMETERS)

    async def __call__(self, **arguments: Any) -> str:
        """Call the tool on the server.

        Returns:
          The observation text (module doc).
        Raises:
          ToolError: the server flagged the result as an error (its message), a protocol error, or
            a broken or closed connection.
        """
        return result_text(await self.connection.call_tool(self.name, arguments), self.name)

    def __repr__(self) -> str:
        return f"McpTool({self.name!r}, server={self.connection.server!r})"


def result_text(result: Any, name: str = "tool") -> str:
    """The observation text of an MCP `CallToolResult`.

    Args:
      result: the SDK's `CallToolResult`.
      name: the tool's name (for an error without a message).
    Returns:
      Text blocks joined with newlines; other blocks as placeholders; structured content as JSON
      when there is no text.
    Raises:
      ToolError: the result is flagged `is_error` (its text is the message).
    """
    parts, has_text = [], False
    for block in result.content or ():
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
            has_text = True
        elif kind in ("image", "audio"):
            parts.append(f"[{getattr(block, 'mime_type', None) or kind} content]")
        elif kind == "resource" and getattr(block.resource, "text", None) is not None:
            parts.append(block.resource.text)  # an embedded text resource: its text
            has_text = True
        elif kind == "resource":
            parts.append(f"[{block.resource.mime_type or 'binary'} resource {block.resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource link {block.uri}]")
        else:
            parts.append(f"[{kind or type(block).__name__} content]")
    structured = getattr(result, "structured_content", None)
    if not has_text and structured is not None:
        parts.insert(0, json.dumps(structured))
    text = "\n".join(parts)
    if getattr(result, "is_error", False):
        raise ToolError(text or f"MCP tool {name!r} reported an error")
    return text


def mcp_tools(server: str | Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Any = None,
              headers: Mapping[str, str] | None = None, connect_timeout_s: float = 30.0,
              include: Sequence[str] | None = None) -> list[McpTool]:
    """Connect to an MCP server and return its tools as `Tool`s of the agent loop (module doc).

    Args:
      server: an http(s) URL (streamable HTTP, e.g. 'http://127.0.0.1:8000/mcp'), or the command
        of a stdio server: a string (split with `shlex`) or an argv sequence.
      env: environment variables for a stdio server, over the SDK's safe defaults.
      cwd: the working directory of a stdio server.
      headers: HTTP headers for a URL server (e.g. {'Authorization': 'Bearer ...'}).
      connect_timeout_s: bound on starting the server, the handshake and listing its tools.
      include: only these tools (by server name, in this order); None: all, in the server's order.
    Returns:
      One `McpTool` per (included) server tool, sharing one `McpConnection` (`.connection`).
    Raises:
      ImportError: the `mcp` package is missing (`pip install 'sfrrl_jax[mcp]'`).
      ValueError: an empty command, options that do not fit the transport, or a name in
        `include` the server does not have (the connection is closed first).
      ConnectionError: the server could not be started or reached (message names it and the cause).
      TimeoutError: it did not connect and list its tools within `connect_timeout_s`.
    """
    connection = McpConnection(server, env=env, cwd=cwd, headers=headers, connect_timeout_s=connect_timeout_s)
    listed = {t.name: t for t in connection.listed_tools}
    names = list(listed) if include is None else [include] if isinstance(include, str) else list(include)
    unknown = [n for n in names if n not in listed]
    if unknown:
        connection.close()
        raise ValueError(f"MCP server {connection.server} has no tool(s) {unknown}; available: {sorted(listed)}")
    chosen = [listed[n] for n in names]
    return [McpTool(connection, t.name, t.description, t.input_schema) for t in chosen]
