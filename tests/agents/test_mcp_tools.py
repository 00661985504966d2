"""MCP servers' tools as agent-loop tools (`agents.mcp_tools`), against a real MCP server written
with the SDK (`mcp_server_fixture.py`) over stdio and streamable HTTP."""
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("mcp")

from sfrrl_jax.agents.loop import AgentConfig, run_agent  # noqa: E402
from sfrrl_jax.agents.mcp_tools import McpConnection, McpTool, mcp_tools  # noqa: E402
from sfrrl_jax.agents.protocols import Task, Tool, ToolCall  # noqa: E402
from sfrrl_jax.agents.tasks.environments import ToolEnvironment  # noqa: E402
from sfrrl_jax.agents.tools import ToolRunner, ToolRunnerConfig  # noqa: E402
from sfrrl_jax.testing import ScriptedEngine  # noqa: E402
from sfrrl_jax.tokenizer import load_tokenizer  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcp_server_fixture.py")
STDIO = [sys.executable, FIXTURE, "stdio"]


@pytest.fixture(scope="module")
def tools():
    """One stdio fixture server for the module: {name: McpTool}."""
    listed = mcp_tools(STDIO)
    yield {t.name: t for t in listed}
    listed[0].connection.close()


def _run(runner, *calls):
    return asyncio.run(runner.run([ToolCall(name, args, call_id=f"c{i}") for i, (name, args) in enumerate(calls)]))


def _mcp_threads():
    return {t for t in threading.enumerate() if t.name.startswith("mcp ")}


def _children() -> set[int]:
    """This process's live child processes (Linux; empty elsewhere)."""
    pids = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


# ----------------------------------------------------------------------------- listing

def test_lists_the_servers_tools_as_it_declares_them(tools):
    from mcp import Client, StdioServerParameters

    async def sdk_listing():  # what the server reports to the SDK's own client
        async with Client(StdioServerParameters(command=STDIO[0], args=STDIO[1:])) as client:
            return (await client.list_tools()).tools

    declared = asyncio.run(sdk_listing())
    assert [t.name for t in declared] == list(tools)
    for t in declared:
        ours = tools[t.name]
        assert isinstance(ours, Tool) and isinstance(ours, McpTool)
        assert (ours.name, ours.description, ours.parameters) == (t.name, t.description or "", t.input_schema)
    add = tools["add"]
    assert add.description == "Add two integers."
    assert add.parameters["type"] == "object" and sorted(add.parameters["required"]) == ["a", "b"]
    assert {k: v["type"] for k, v in add.parameters["properties"].items()} == {"a": "integer", "b": "integer"}
    assert tools["ping"].description == "" and tools["ping"].parameters["properties"] == {}
    assert len({id(t.connection) for t in tools.values()}) == 1
    assert tools["add"].connection.listed_tools[0].name == "add"


def test_include_picks_tools_in_order_and_rejects_unknown_names():
    picked = mcp_tools(STDIO, include=["echo", "add"])
    try:
        assert [t.name for t in picked] == ["echo", "add"]
        assert asyncio.run(picked[1](a=20, b=22)) == "42"
    finally:
        picked[0].connection.close()
    before = _mcp_threads()
    with pytest.raises(ValueError, match=r"no tool\(s\) \['nope'\].*available: \[.*'add'"):
        mcp_tools(STDIO, include=["add", "nope"])
    assert _mcp_threads() <= before  # the connection was closed


# ----------------------------------------------------------------------------- calls through our runner

def test_calls_through_the_tool_runner(tools):
    runner = ToolRunner(list(tools.values()), ToolRunnerConfig(timeout_s=20))
    ok, failed, protocol, echoed = _run(runner, ("add", {"a": 2, "b": 3}), ("fail", {"message": "disk on fire"}),
                                        ("protocol_error", {"message": "bad request"}), ("echo", {"text": "a\nb"}))
    assert (ok.content, ok.is_error, ok.call_id) == ("5", False, "c0")
    assert failed.is_error and failed.content.startswith("error: ") and "disk on fire" in failed.content
    assert protocol.is_error and protocol.content == "error: bad request"
    assert (echoed.content, echoed.is_error) == ("a\nb", False)


def test_schema_violations_are_refused_before_the_server(tools):
    runner = ToolRunner(list(tools.values()), ToolRunnerConfig(timeout_s=20))
    (before,) = _run(runner, ("add_calls", {}))
    wrong_type, missing = _run(runner, ("add", {"a": "2", "b": 3}), ("add", {"a": 2}))
    assert wrong_type.is_error and wrong_type.content.startswith("error: invalid arguments: arguments.a")
    assert missing.is_error and missing.content.startswith("error: invalid arguments:") and "'b'" in missing.content
    (after,) = _run(runner, ("add_calls", {}))
    assert after.content == before.content  # the server never ran `add` for them


def test_non_text_blocks_and_structured_content(tools):
    runner = ToolRunner(list(tools.values()), ToolRunnerConfig(timeout_s=20))
    image, data = _run(runner, ("image", {}), ("data", {}))
    assert (image.content, image.is_error) == ("[image/png content]", False)
    assert (data.content, data.is_error) == ('{"x": 1, "y": [2, 3]}', False)


def test_timeout_cancels_the_call_and_the_connection_serves_the_next(tools):
    runner = ToolRunner(list(tools.values()), ToolRunnerConfig(timeout_s=1.0))
    cancelled_before = int(asyncio.run(tools["slow_cancelled"]()))
    start = time.monotonic()
    (slow,) = _run(runner, ("slow", {"seconds": 60}))
    assert time.monotonic() - start < 15
    assert slow.is_error and "timed out" in slow.content
    assert runner.orphaned_calls == 0  # the caller's cancellation ended the remote call at once
    (ok,) = _run(runner, ("add", {"a": 1, "b": 2}))
    assert (ok.content, ok.is_error) == ("3", False)
    deadline = time.monotonic() + 10  # the cancellation reached the server's own `slow`
    while int(asyncio.run(tools["slow_cancelled"]())) == cancelled_before:
        assert time.monotonic() < deadline, "the server's slow call was never cancelled"
        time.sleep(0.05)


def test_calls_from_two_event_loops_and_concurrent_calls(tools):
    add, echo = tools["add"], tools["echo"]
    assert asyncio.run(add(a=1, b=1)) == "2"
    assert asyncio.run(echo(text="second loop")) == "second loop"

    async def many():
        return await asyncio.gather(*(add(a=i, b=i) for i in range(8)))

    assert asyncio.run(many()) == [str(2 * i) for i in range(8)]


# ----------------------------------------------------------------------------- the agent loop

def test_agent_loop_against_mcp_tools(tools, tok_dir):
    tok = load_tokenizer(tok_dir)
    env = ToolEnvironment([tools["add"], tools["fail"]], "Use the tools.", ToolRunnerConfig(timeout_s=20))
    task = Task(task_id="m0", kind="arithmetic", prompt="What is 2 + 3?", answer="5")
    prompt = tok.apply_chat_template(env.reset(task), env.tool_schemas(), add_generation_prompt=True)
    turns = [tok.encode('<|call|>add{"a":2,"b":3}<|/call|><|end|>'),
             tok.encode('<|call|>fail{"message":"no luck"}<|/call|><|end|>'),
             tok.encode("<answer>5</answer><|end|>")]
    engine = ScriptedEngine({tuple(prompt): turns})
    traj = asyncio.run(run_agent(engine, env, task, tok, AgentConfig()))
    tool_messages = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["5", "error: Error executing tool fail: no luck"]
    assert tok.decode(engine.requests[1].tokens) == "<|tool|>5<|end|><|assistant|>"
    assert tok.decode(engine.requests[2].tokens) == ("<|tool|>error: Error executing tool fail: no luck"
                                                     "<|end|><|assistant|>")
    assert (traj.num_tool_calls, traj.num_tool_errors, traj.finish_reason, traj.reward) == (2, 1, "answer", 1.0)


# ----------------------------------------------------------------------------- streamable HTTP

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server():
    port = _free_port()
    server = subprocess.Popen([sys.executable, FIXTURE, "http", str(port)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    listed = []
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                pytest.fail(f"the HTTP fixture server exited: {server.stderr.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the HTTP fixture server did not start listening"
                time.sleep(0.1)
        listed = mcp_tools(f"http://127.0.0.1:{port}/mcp", headers={"X-Test": "1"}, include=["add", "fail"])
        add, fail = listed
        assert sorted(add.parameters["required"]) == ["a", "b"]
        runner = ToolRunner(listed, ToolRunnerConfig(timeout_s=20))
        ok, failed = _run(runner, ("add", {"a": 40, "b": 2}), ("fail", {"message": "over http"}))
        assert (ok.content, ok.is_error) == ("42", False)
        assert failed.is_error and "over http" in failed.content
        assert asyncio.run(add(a=1, b=2)) == "3"  # another event loop
    finally:
        if listed:
            listed[0].connection.close()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        server.stderr.close()


# ----------------------------------------------------------------------------- failures and closing

def test_connection_failures_raise_clear_errors_quickly():
    threads, children = _mcp_threads(), _children()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"no-such-mcp-server-xyz.*(No such file|not found)"):
        mcp_tools("no-such-mcp-server-xyz --flag")
    with pytest.raises(ConnectionError, match=r"could not connect to MCP server .*sys.exit"):
        mcp_tools([sys.executable, "-c", "import sys; sys.exit(3)"])
    url = f"http://127.0.0.1:{_free_port()}/mcp"
    with pytest.raises(ConnectionError, match=rf"{url}.*(ConnectError|onnect)"):
        mcp_tools(url)
    assert time.monotonic() - start < 30
    # A server that never answers: the connect timeout, then the SDK's shutdown of the process.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"sleep.*within 1.0 s"):
        mcp_tools([sys.executable, "-c", "import time; time.sleep(120)"], connect_timeout_s=1.0)
    assert time.monotonic() - start < 20
    assert _mcp_threads() <= threads and _children() <= children  # nothing left behind
    with pytest.raises(ValueError, match="empty"):
        mcp_tools([])
    with pytest.raises(ValueError, match="headers"):
        mcp_tools(STDIO, headers={"X": "1"})


def test_close_stops_the_stdio_server_and_later_calls_are_errors():
    listed = mcp_tools(STDIO, include=["pid", "add"])
    pid_tool, add = listed
    connection = add.connection
    assert isinstance(connection, McpConnection) and not connection.closed
    pid = int(asyncio.run(pid_tool()))
    assert pid in _children() or not os.path.isdir("/proc")
    with connection:  # the context manager closes it too
        pass
    assert connection.closed
    assert _gone(pid), f"the MCP server process {pid} is still running after close()"
    (after,) = _run(ToolRunner(listed, ToolRunnerConfig(timeout_s=20)), ("add", {"a": 1, "b": 1}))
    assert after.is_error and "no connection to MCP server" in after.content
    connection.close()  # idempotent


def test_a_dead_server_becomes_an_error_observation_quickly():
    listed = mcp_tools(STDIO, include=["pid", "add"])
    pid_tool, add = listed
    try:
        pid = int(asyncio.run(pid_tool()))
        os.kill(pid, 9)
        assert _gone(pid)
        runner = ToolRunner(listed, ToolRunnerConfig(timeout_s=60))
        start = time.monotonic()
        (dead,) = _run(runner, ("add", {"a": 1, "b": 1}))
        assert time.monotonic() - start < 10
        assert dead.is_error and "MCP server" in dead.content
    finally:
        add.connection.close()


def test_a_gin_file_gives_an_environment_an_mcp_servers_tools():
    """`ToolEnvironment.tools = @mcp_tools()` with the server bound in gin: the environment
    renders and runs the server's tools."""
    import gin
    from sfrrl_jax.launch.gin_bindings import register
    register()
    gin.clear_config()
    try:
        gin.parse_config([f"sfrrl.mcp_tools.server = {STDIO!r}", "sfrrl.mcp_tools.include = ['add', 'echo']",
                          "sfrrl.ToolEnvironment.tools = @sfrrl.mcp_tools()",
                          "sfrrl.ToolEnvironment.system_prompt = 'Use the tools.'"])
        env = gin.get_configurable("sfrrl.ToolEnvironment")()
    finally:
        gin.clear_config()
    try:
        assert [s["function"]["name"] for s in env.tool_schemas()] == ["add", "echo"]
        (result,) = asyncio.run(env.step([ToolCall("add", {"a": 2, "b": 40})]))
        assert result.content == "42" and not result.is_error
    finally:
        env.runner.tools["add"].connection.close()
