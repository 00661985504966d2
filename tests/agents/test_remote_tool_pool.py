"""Tool calls served by worker processes over the pool's queues (agents.tool_pool), through the
ordinary ToolRunner: results, load spread, errors as observations, a dead worker as a timeout."""
import asyncio
import os
import subprocess
import sys
from pathlib import Path

from sfrrl_jax.agents.protocols import ToolCall
from sfrrl_jax.agents.tool_pool import ToolPoolServer
from sfrrl_jax.agents.tools import ToolRunner, ToolRunnerConfig

import remote_tools_fixture

HERE = Path(__file__).resolve().parent


def _worker(address, key, concurrency=4):
    env = dict(os.environ, SFRRL_TOOL_AUTHKEY=key.decode(),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "sfrrl_jax.agents.tool_pool", f"{address[0]}:{address[1]}",
                             "remote_tools_fixture:tools", "--concurrency", str(concurrency)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_remote_workers_run_the_calls_and_failures_stay_observations():
    key = os.urandom(16).hex().encode()
    with ToolPoolServer(("127.0.0.1", 0), authkey=key) as pool:
        workers = [_worker(pool.address, key) for _ in range(2)]
        try:
            for w in workers:   # both connected before any call is queued
                assert "serving ['slow_add', 'fail', 'async_exit']" in w.stdout.readline()
            runner = ToolRunner(pool.remote_tools(remote_tools_fixture.tools()), ToolRunnerConfig(timeout_s=20.0))
            assert [s["function"]["name"] for s in runner.schemas()] == ["slow_add", "fail", "async_exit"]

            async def main():
                calls = [ToolCall("slow_add", {"a": i, "b": 1000, "sleep_s": 0.2}, call_id=str(i)) for i in range(24)]
                return await runner.run(calls)
            results = asyncio.run(main())
            assert [r.content.split(" by ")[0] for r in results] == [str(i + 1000) for i in range(24)]
            assert not any(r.is_error for r in results)
            pids = {r.content.split(" by ")[1].split(" with ")[0] for r in results}
            assert len(pids) == 2                                              # both workers took calls
            assert max(int(r.content.split(" with ")[1]) for r in results) > 1  # several at once in one

            async def failures():
                return await runner.run([ToolCall("fail", {"kind": "tool_error"}), ToolCall("fail", {"kind": "crash"}),
                                         ToolCall("fail", {"kind": "ok"})])
            tool_error, crash, ok = asyncio.run(failures())
            assert tool_error.is_error and tool_error.content == "error: the tool refuses: kind=tool_error"
            assert crash.is_error and "ZeroDivisionError" in crash.content and "division by zero" in crash.content
            assert not ok.is_error and ok.content == "fine"

            # a worker that dies mid-call: that call times out as an observation, the pool goes on
            runner = ToolRunner(pool.remote_tools(remote_tools_fixture.tools()), ToolRunnerConfig(timeout_s=3.0))

            async def death():
                return await runner.run([ToolCall("fail", {"kind": "die"})])
            (dead,) = asyncio.run(death())
            assert dead.is_error and "timed out after 3.0 s" in dead.content
            assert sum(w.poll() is not None for w in workers) == 1

            async def after():
                return await runner.run([ToolCall("slow_add", {"a": 1, "b": 2}) for _ in range(4)])
            assert all(r.content.startswith("3 by ") for r in asyncio.run(after()))
        finally:
            for w in workers:
                w.kill()
                w.wait()


def test_a_tool_that_exits_is_that_calls_error_and_the_worker_goes_on():
    """Issue #48: SystemExit / KeyboardInterrupt raised by a tool on a worker (an argparse, a stray
    sys.exit) come back as that call's error. Before, they ended the worker's call thread or its
    event loop, and every later call on it timed out."""
    key = os.urandom(16).hex().encode()
    with ToolPoolServer(("127.0.0.1", 0), authkey=key) as pool:
        worker = _worker(pool.address, key, concurrency=1)
        try:
            assert "serving" in worker.stdout.readline()
            runner = ToolRunner(pool.remote_tools(remote_tools_fixture.tools()), ToolRunnerConfig(timeout_s=10.0))

            async def main():
                exits = await runner.run([ToolCall("fail", {"kind": "exit"}), ToolCall("fail", {"kind": "interrupt"}),
                                          ToolCall("async_exit", {})])
                return exits, await runner.run([ToolCall("slow_add", {"a": 1, "b": 2}) for _ in range(3)])
            (exit_, interrupt, async_exit), after = asyncio.run(main())
            assert exit_.is_error and "SystemExit on worker" in exit_.content and ": 2" in exit_.content
            assert interrupt.is_error and "KeyboardInterrupt on worker" in interrupt.content
            assert async_exit.is_error and "SystemExit on worker" in async_exit.content and "async exit" in async_exit.content
            assert [r.content.split(" by ")[0] for r in after] == ["3"] * 3 and worker.poll() is None
        finally:
            worker.kill()
            worker.wait()


def test_a_worker_without_the_authkey_is_refused_by_name():
    env = {k: v for k, v in os.environ.items() if k != "SFRRL_TOOL_AUTHKEY"}
    out = subprocess.run([sys.executable, "-m", "sfrrl_jax.agents.tool_pool", "127.0.0.1:1", "x:y"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "SFRRL_TOOL_AUTHKEY" in out.stderr


def test_the_config_chooses_remote_workers_for_an_environments_tools(monkeypatch):
    """`ToolRunnerConfig.remote_address` (gin-bindable) sends a ToolEnvironment's calls to workers."""
    import socket

    import gin

    from sfrrl_jax.agents.tasks.environments import ToolEnvironment
    from sfrrl_jax.agents.tool_pool import shared_pool
    from sfrrl_jax.launch import gin_bindings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    gin_bindings.register()
    with gin.unlock_config():
        gin.parse_config(f"sfrrl.ToolRunnerConfig.remote_address = {address!r}\nsfrrl.ToolRunnerConfig.timeout_s = 20.0")
    try:
        cfg = gin.get_configurable("sfrrl.ToolRunnerConfig")()
    finally:
        gin.clear_config()
    assert cfg.remote_address == address and isinstance(cfg, ToolRunnerConfig)
    monkeypatch.delenv("SFRRL_TOOL_AUTHKEY", raising=False)
    try:
        ToolEnvironment(remote_tools_fixture.tools(), None, cfg)
        raise AssertionError("a remote address without the shared secret must be refused")
    except ValueError as e:
        assert "SFRRL_TOOL_AUTHKEY" in str(e) and address in str(e)
    key = os.urandom(16).hex().encode()
    monkeypatch.setenv("SFRRL_TOOL_AUTHKEY", key.decode())
    env = ToolEnvironment(remote_tools_fixture.tools(), None, cfg)
    env2 = ToolEnvironment(remote_tools_fixture.tools(), None, cfg)      # the same pool, not a second server
    pool = shared_pool(address)
    worker = _worker(pool.address, key)
    try:
        assert "serving ['slow_add', 'fail', 'async_exit']" in worker.stdout.readline()

        async def main():
            return (await env.step([ToolCall("slow_add", {"a": 2, "b": 3})])
                    + await env2.step([ToolCall("fail", {"kind": "tool_error"})]))
        added, refused = asyncio.run(main())
        assert added.content.startswith("5 by ") and int(added.content.split(" by ")[1].split()[0]) == worker.pid
        assert refused.is_error and "the tool refuses" in refused.content
    finally:
        worker.kill()
        worker.wait()
        pool.close()
    for bad in ("50051", "host:", "host:port", "h:70000"):
        try:
            ToolRunnerConfig(remote_address=bad)
            raise AssertionError(bad)
        except ValueError as e:
            assert "ToolRunnerConfig.remote_address" in str(e)
