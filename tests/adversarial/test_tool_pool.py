"""Attacks on the tool runner's worker pool: blocking tools that hang and a pool that dies.
Each must cost only the calls involved (error observations), never the later calls of the run."""
import asyncio
import threading

from sfrrl_jax.agents.protocols import ToolCall
from sfrrl_jax.agents.tools import FunctionTool, ToolRunner, ToolRunnerConfig

SCHEMA = {"type": "object", "properties": {"hang": {"type": "boolean"}}, "required": ["hang"]}


def _runner(workers):
    release = threading.Event()

    def work(hang):
        if hang:
            release.wait(30)  # a blocking tool stuck (a dead NFS read, a deadlock)
        return "done"
    runner = ToolRunner([FunctionTool("work", "maybe hangs", SCHEMA, work)],
                        ToolRunnerConfig(timeout_s=0.3, thread_workers=workers))
    return runner, release


def test_threads_stuck_in_timed_out_calls_do_not_starve_later_calls():
    runner, release = _runner(workers=2)

    async def main():
        hung = await runner.run([ToolCall("work", {"hang": True}, "a"), ToolCall("work", {"hang": True}, "b")])
        later = await runner.run([ToolCall("work", {"hang": False}, f"c{i}") for i in range(4)])
        return hung, later

    try:
        hung, later = asyncio.run(main())
    finally:
        release.set()
        runner.close()
    assert all(r.is_error and "timed out" in r.content for r in hung)
    # Both threads are stuck: without threads in their place these would queue and time out.
    assert [r.content for r in later] == ["done"] * 4  # none timed out (0.3 s) behind the stuck ones
    assert runner.orphaned_calls == 2 and runner.pools_replaced == 0


def test_a_dead_pool_is_replaced_and_the_call_runs():
    runner, release = _runner(workers=2)
    runner._executor.shutdown(wait=True)  # the pool died under the runner

    async def main():
        return await runner.run([ToolCall("work", {"hang": False}, "a")])

    (result,) = asyncio.run(main())
    runner.close()
    assert not result.is_error and result.content == "done" and runner.pools_replaced == 1


def test_queueing_for_sandbox_slots_does_not_count_against_the_tool_timeout():
    # As tried: many sleep() calls at once through a sandbox with fewer slots; each call's own
    # run is well inside the timeout, the queue is not (it was: 128 of 200 "timed out").
    from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox, SandboxConfig
    from sfrrl_jax.agents.tools import PythonTool
    sandbox = PythonSandbox(SandboxConfig(max_concurrency=2, wall_timeout_s=5))
    runner = ToolRunner([PythonTool(sandbox)], ToolRunnerConfig(timeout_s=2.5))
    calls = [ToolCall("python", {"code": "import time; time.sleep(0.5); print('ok')"}, f"c{i}") for i in range(12)]
    # The last calls queue > 2.7 s (5 rounds of >= 0.55 s) > timeout_s; each run has 2 s to spare.
    results = asyncio.run(runner.run(calls))
    runner.close()
    assert [r.content.strip() for r in results] == ["ok"] * 12, [r.content for r in results if r.is_error]
