"""A small MCP server for the MCP-tools tests, written with the SDK's server API (`MCPServer`, mcp 2.x's
FastMCP).

    python3 tests/agents/mcp_server_fixture.py stdio
    python3 tests/agents/mcp_server_fixture.py http PORT     (streamable HTTP at http://127.0.0.1:PORT/mcp)

Tools: `add(a, b)`, `echo(text)`, `add_calls()` (how often `add` ran),
`fail(message)` (raises: the server answers with isError), `protocol_error(message)` (a JSON-RPC error),
`slow(seconds)` (sleeps, then says so), `slow_cancelled()`
(how many `slow` calls were cancelled), `ping()` (no description), `pid()` (the server's process id), `image()` (one
image block), `data()` (structured content only, no text).
"""
import asyncio
import os
import sys

import mcp_types
from mcp import MCPError
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import INVALID_PARAMS

_add_calls = _slow_cancelled = 0
server = MCPServer("sfrrl-test-fixture", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    global _add_calls
    _add_calls += 1
    return a + b


@server.tool()
def add_calls() -> int:
    """How many times `add` ran in this server."""
    return _add_calls


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@server.tool()
def fail(message: str) -> str:
    """Always fails with the given message."""
    raise ToolError(message)  # an anticipated failure: the client reads the message (isError)


@server.tool()
def protocol_error(message: str) -> str:
    """Answers with a JSON-RPC error (not a tool result)."""
    raise MCPError(INVALID_PARAMS, message)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep for `seconds`, then answer."""
    global _slow_cancelled
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:  # the client cancelled the request
        _slow_cancelled += 1
        raise
    return f"slept {seconds}"


@server.tool()
def slow_cancelled() -> int:
    """How many `slow` calls the client cancelled."""
    return _slow_cancelled


@server.tool()
def ping() -> str:  # no docstring: the server lists no description
    return "pong"


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def image() -> mcp_types.CallToolResult:
    """One 1x1 PNG image block."""
    return mcp_types.CallToolResult(content=[mcp_types.ImageContent(
        data="iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==",
        mime_type="image/png")])


@server.tool()
def data() -> mcp_types.CallToolResult:
    """Structured content only."""
    return mcp_types.CallToolResult(content=[], structured_content={"x": 1, "y": [2, 3]})


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
