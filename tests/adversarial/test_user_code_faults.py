"""User code that misbehaves in one sample costs that sample, never the step or the process (issue #48).

Tools, reward functions and environments are user code; the agent loop runs them behind
boundaries, and each attack here once went through one:
- SystemExit / KeyboardInterrupt / GeneratorExit raised by a tool become an error observation, by
  a reward function or an environment that sample's error (a failed trajectory), never the step's;
- a blocking tool that never returns is abandoned at its timeout without cancelling anybody else's
  queued call, and its thread does not hold the process at exit;
- an async tool that ignores cancellation is abandoned at its budget (the runner's timeout, the
  agent's wall budget) and counted (`ToolRunner.orphaned_calls`, `metadata["orphaned_tool_calls"]`);
- a huge non-str tool result is capped without stalling the event loop.
"""
import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from sfrrl_jax.agents.loop import AgentConfig, run_agent, run_many
from sfrrl_jax.agents.tasks.environments import ToolEnvironment
from sfrrl_jax.agents.protocols import Task, ToolCall, ToolResult
from sfrrl_jax.agents.tasks.reward_fns import RewardError, RewardSum, in_thread
from sfrrl_jax.agents.tools import FunctionTool, ToolRunner, ToolRunnerConfig
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.aio import run_sync
from sfrrl_jax.testing import ScriptedEngine
from sfrrl_jax.tokenizer import load_tokenizer

ANY = {"type": "object"}
CALL = '<|call|>{name}{{}}<|/call|><|end|>'
ANSWER = "<answer>x</answer><|end|>"


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


class AsyncTool:
    def __init__(self, name, fn):
        self.name, self.description, self.parameters, self.fn = name, name, ANY, fn

    async def __call__(self, **kw):
        return await self.fn(**kw)


def no_escape(fn, *args):
    """fn(*args); a BaseException that is not an Exception escaping it fails the test (and a
    KeyboardInterrupt would stop pytest itself)."""
    try:
        return fn(*args)
    except Exception:
        raise
    except BaseException as e:  # the point of these tests: none comes out
        pytest.fail(f"{type(e).__name__} escaped: {e!r}")


def cli(**_):
    """A tool running argparse on bad input: argparse prints its usage and raises SystemExit(2)."""
    parser = argparse.ArgumentParser(prog="grep")
    parser.add_argument("pattern")
    parser.parse_args([])


def tasks(n):
    return [Task(f"t{i}", "qa", f"question {i}", answer="x") for i in range(n)]


def zero(task, trajectory):
    return 0.0


def observations(traj):
    return [m["content"] for m in traj.messages if m["role"] == "tool"]


# -- SystemExit, KeyboardInterrupt, GeneratorExit --------------------------------------------------

def test_base_exceptions_raised_by_tools_are_error_observations():
    async def interrupt(**_):
        raise KeyboardInterrupt

    async def generator_exit(**_):
        raise GeneratorExit("closed")

    async def own_cancel(**_):  # nobody cancelled it: it raises CancelledError itself
        raise asyncio.CancelledError

    def blocking_interrupt():
        raise KeyboardInterrupt("in a thread")

    runner = ToolRunner([FunctionTool("cli", "", ANY, cli), AsyncTool("interrupt", interrupt),
                         AsyncTool("generator_exit", generator_exit), AsyncTool("own_cancel", own_cancel),
                         FunctionTool("blocking_interrupt", "", ANY, blocking_interrupt)],
                        ToolRunnerConfig(timeout_s=5))
    names = ["cli", "interrupt", "generator_exit", "own_cancel", "blocking_interrupt"]
    results = no_escape(asyncio.run, runner.run([ToolCall(n, {}, f"c{i}") for i, n in enumerate(names)]))
    runner.close()
    assert [(r.is_error, r.content) for r in results] == [
        (True, "error: tool 'cli' failed: SystemExit: 2"),
        (True, "error: tool 'interrupt' failed: KeyboardInterrupt"),
        (True, "error: tool 'generator_exit' failed: GeneratorExit: closed"),
        (True, "error: tool 'own_cancel' failed: CancelledError"),
        (True, "error: tool 'blocking_interrupt' failed: KeyboardInterrupt: in a thread"),
    ]


def test_base_exceptions_raised_by_reward_functions_are_reward_errors():
    task, traj = tasks(1)[0], Trajectory("t0", "t0", 0, 0, [], [], [])

    def quits(task, trajectory):
        sys.exit("giving up")

    async def interrupted(task, trajectory):
        raise KeyboardInterrupt

    def exits_in_thread(task, trajectory):
        raise SystemExit(3)

    with pytest.raises(RewardError, match=r"reward function 'quits' raised SystemExit: giving up"):
        no_escape(RewardSum([quits]), task, traj)
    with pytest.raises(RewardError, match=r"reward function 'interrupted' raised KeyboardInterrupt"):
        no_escape(asyncio.run, RewardSum([interrupted])(task, traj))
    with pytest.raises(RewardError, match=r"reward function 'exits_in_thread' raised SystemExit: 3"):
        no_escape(asyncio.run, RewardSum([in_thread(exits_in_thread)])(task, traj))


class FragileEnvironment:
    """An environment with episodes whose hooks raise, for the task named in `faults`, what it maps
    to: {task_id: (hook, exception)}; hooks 'reset', 'step', 'async_step', 'next_user_turn',
    'close', 'reward'. Its one tool call answers 'ok'."""

    def __init__(self, faults):
        self.faults = faults

    def tool_schemas(self):
        return [{"type": "function", "function": {"name": "probe", "description": "", "parameters": ANY}}]

    def open_episode(self, task):
        return FragileEpisode(self, task)

    def reward(self, task, trajectory):
        self.fault(task, "reward")
        return 1.0

    def fault(self, task, hook):
        where, error = self.faults.get(task.task_id, (None, None))
        if where == hook:
            raise error


class FragileEpisode:
    def __init__(self, env, task):
        self.env, self.task = env, task

    def reset(self):
        self.env.fault(self.task, "reset")
        return [{"role": "user", "content": self.task.prompt}]

    async def step(self, calls):
        self.env.fault(self.task, "step")
        await asyncio.sleep(0)
        self.env.fault(self.task, "async_step")
        return [ToolResult(c.name, "ok", call_id=c.call_id) for c in calls]

    def next_user_turn(self):
        self.env.fault(self.task, "next_user_turn")
        return None

    def close(self):
        self.env.fault(self.task, "close")


def test_base_exceptions_raised_by_an_environment_fail_that_sample_only(tok):
    faults = {"t0": ("step", SystemExit(3)), "t1": ("async_step", KeyboardInterrupt()),
              "t2": ("next_user_turn", KeyboardInterrupt("user turn")), "t3": ("reward", SystemExit("no reward")),
              "t4": ("close", GeneratorExit()), "t5": ("reset", SystemExit(5))}
    env = FragileEnvironment(faults)
    engine = ScriptedEngine([CALL.format(name="probe"), ANSWER], tokenizer=tok)
    trajs = no_escape(asyncio.run, run_many(engine, env, tasks(7), tok, AgentConfig(max_turns=3)))
    assert [t.task_id for t in trajs] == [f"t{i}" for i in range(7)]
    assert [t.error for t in trajs] == ["SystemExit: 3", "KeyboardInterrupt", "KeyboardInterrupt: user turn",
                                        "SystemExit: no reward", None, "SystemExit: 5", None]
    assert [t.finish_reason for t in trajs] == ["error"] * 4 + ["answer", "error", "answer"]
    assert trajs[4].reward == trajs[6].reward == 1.0  # a close that raised: the trajectory stands
    # the reset of t5 raised: the sample never had a prompt, so its slot holds an empty failed one
    assert trajs[5].tokens == [] and trajs[5].reward == 0.0
    assert len(engine.released) == 6  # every slot that opened was released


# -- a blocking tool that never returns ---------------------------------------------------------

def test_a_hung_blocking_tool_cancels_nobody_elses_queued_call(tok):
    # 2 threads, timeout 1 s. Samples 0 and 1 call first (t = 0) and hang; the 10 others call at
    # t = 0.5 and queue behind them. At t = 1 the two hung calls time out: their threads are
    # written off and the queued calls run at once, 0.5 s before their own timeouts (they were
    # cancelled with the replaced pool instead: 10 results came back None).
    release, started = threading.Event(), itertools.count()

    def work():
        if next(started) < 2:
            release.wait(30)  # a dead NFS read
        return "done"

    env = ToolEnvironment([FunctionTool("work", "", ANY, work)], None,
                          ToolRunnerConfig(timeout_s=1.0, thread_workers=2), reward_fns=[zero])
    delays = iter([0.0, 0.0] + [0.5] * 10)
    engine = ScriptedEngine([CALL.format(name="work"), ANSWER], tokenizer=tok, delay=lambda: next(delays, 0.0))
    try:
        trajs = no_escape(run_sync, run_many(engine, env, tasks(12), tok, AgentConfig(max_turns=3)))
    finally:
        release.set()
        env.close()
    assert len(trajs) == 12 and all(isinstance(t, Trajectory) for t in trajs)
    assert [t.error for t in trajs] == [None] * 12
    assert [observations(t) for t in trajs] == (
        [["error: tool 'work' timed out after 1.0 s"]] * 2 + [["done"]] * 10)
    assert [t.finish_reason for t in trajs] == ["answer"] * 12
    assert env.runner.orphaned_calls == 2
    assert [t.metadata.get("orphaned_tool_calls", 0) for t in trajs] == [1, 1] + [0] * 10


HUNG_TOOL_SCRIPT = """
import asyncio, threading, time
from sfrrl_jax.agents.protocols import ToolCall
from sfrrl_jax.agents.tools import FunctionTool, ToolRunner, ToolRunnerConfig

never = threading.Event()
runner = ToolRunner([FunctionTool("stuck", "", {"type": "object"}, lambda: never.wait())],
                    ToolRunnerConfig(timeout_s=0.5, thread_workers=2))
(result,) = asyncio.run(runner.run([ToolCall("stuck", {}, "c0")]))
runner.close()
print(result.content)
print("ended", time.time(), flush=True)
"""


def test_the_process_exits_promptly_with_a_hung_tool_thread(tmp_path):
    script = tmp_path / "hung_tool.py"
    script.write_text(HUNG_TOOL_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit within 60 s of starting (the hung thread held it):\n{out}")
    exited = time.time()
    assert proc.returncode == 0, err[-3000:]
    lines = out.splitlines()
    assert lines[0] == "error: tool 'stuck' timed out after 0.5 s"
    ended = float(lines[1].split()[1])
    assert exited - ended < 5.0, f"the process took {exited - ended:.1f} s to exit after its run ended"


# -- an async tool that ignores cancellation -------------------------------------------------------

def stubborn_tool(seconds):
    """An async tool that swallows every cancellation for `seconds` (then returns)."""

    async def stubborn(**_):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass
        return "finally"
    return AsyncTool("stubborn", stubborn)


def _timed_run_agent(engine, env, tok, cfg):
    async def main():
        start = time.perf_counter()
        traj = await run_agent(engine, env, tasks(1)[0], tok, cfg)
        return traj, time.perf_counter() - start
    start = time.perf_counter()
    traj, inside = no_escape(run_sync, main())
    return traj, inside, time.perf_counter() - start


def test_an_async_tool_ignoring_cancellation_is_abandoned_at_the_tool_timeout(tok):
    env = ToolEnvironment([stubborn_tool(6.0)], None, ToolRunnerConfig(timeout_s=0.5),
                          reward_fns=[zero])
    engine = ScriptedEngine([CALL.format(name="stubborn"), ANSWER], tokenizer=tok)
    traj, inside, total = _timed_run_agent(engine, env, tok, AgentConfig(max_turns=3))
    env.close()
    # the trajectory goes on past the abandoned call: the model reads a timeout and answers
    assert (traj.error, traj.finish_reason) == (None, "answer")
    assert observations(traj) == ["error: tool 'stubborn' timed out after 0.5 s"]
    assert inside < 3.0 and total < 5.0, (inside, total)  # not the 6 s the tool keeps running
    assert env.runner.orphaned_calls == 1 and traj.metadata["orphaned_tool_calls"] == 1


def test_an_async_tool_ignoring_cancellation_is_abandoned_at_the_wall_budget(tok):
    env = ToolEnvironment([stubborn_tool(6.0)], None, ToolRunnerConfig(timeout_s=60),
                          reward_fns=[zero])
    engine = ScriptedEngine([CALL.format(name="stubborn"), ANSWER], tokenizer=tok)
    traj, inside, total = _timed_run_agent(engine, env, tok, AgentConfig(max_turns=3, wall_budget_s=0.5))
    env.close()
    assert (traj.error, traj.finish_reason) == (None, "wall_budget")
    assert inside < 3.0 and total < 5.0, (inside, total)
    assert env.runner.orphaned_calls == 1 and traj.metadata["orphaned_tool_calls"] == 1
    assert engine.released == [0]


# -- a huge tool result ---------------------------------------------------------------------------

def test_a_huge_tool_result_does_not_stall_other_trajectories():
    # ~55 MB of JSON (json.dumps of it held the event loop for 1.2 s here); the list itself is 40 MB
    # of pointers to one float.
    huge = [0.1234567] * 5_000_000

    async def dump(**_):
        return huge

    runner = ToolRunner([AsyncTool("dump", dump)], ToolRunnerConfig(max_output_chars=50))

    async def main():
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticks = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        (result,) = await runner.run([ToolCall("dump", {}, "c0")])
        await asyncio.sleep(0.05)
        done.set()
        await ticks
        return result, max(gaps)

    result, worst_gap = no_escape(asyncio.run, main())
    runner.close()
    assert not result.is_error
    assert result.content.startswith("[0.1234567, 0.1234567, 0.1234567, 0.1234567, 0.12")
    assert result.content.endswith("chars]") and len(result.content) < 120
    assert worst_gap < 0.3, f"the event loop stalled {worst_gap:.2f} s"


def test_a_small_non_str_result_is_encoded_and_capped_as_before():
    values = {"small": {"a": [1, 2.5, "\u00e9"], "b": None}, "longer": list(range(100))}
    runner = ToolRunner([AsyncTool(name, lambda v=v: _value(v)) for name, v in values.items()],
                        ToolRunnerConfig(max_output_chars=20))
    results = asyncio.run(runner.run([ToolCall(name, {}, name) for name in values]))
    runner.close()
    encoded = [json.dumps(v) for v in values.values()]
    assert [r.content for r in results] == [e[:20] + f"\n[truncated {len(e) - 20} chars]" for e in encoded]


async def _value(v):
    return v


# -- through the trainer -------------------------------------------------------------------------

def test_a_tool_and_a_reward_exiting_cost_their_samples_not_the_step(tok_dir):
    import jax

    import sfrrl_jax as S

    def quits_on_sample_0(task, trajectory):
        if trajectory.sample_index == 0:
            sys.exit("reward gave up")
        return 0.5

    seen = []

    class ScriptedTurns(S.AgentRollout):
        """The agent loop on scripted model turns (call grep, then answer): a random model's turn
        seldom ends, let alone calls. The trainer trains its tiny model on these trajectories."""

        async def __call__(self, engine, task, sample_index):
            scripted = ScriptedEngine([CALL.format(name="grep"), ANSWER], tokenizer=self.tokenizer)
            traj = await super().__call__(scripted, task, sample_index)
            seen.append(traj)
            return traj

    env = S.ToolEnvironment([S.FunctionTool("grep", "Search.", ANY, cli)], "Call grep.",
                            reward_fns=[quits_on_sample_0])
    model_cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=256)
    params = S.init_params(model_cfg, S.make_mesh(devices=jax.devices()[:1]), seed=0)
    rollout = ScriptedTurns(env, S.load_tokenizer(tok_dir),
                            S.AgentConfig(max_turns=3, max_new_tokens_per_turn=32, max_total_tokens=192))
    trainer = S.RLTrainer(model_cfg, params, S.TrainerConfig(groups_per_step=2, group_size=2, max_slots=4, max_len=192),
                          S.LossConfig(), S.OptimizerConfig(learning_rate=1e-4), rollout, S.TaskStream(tasks(2)))
    metrics = no_escape(trainer.step)  # it raised SystemExit (the CLI exited 2, no final checkpoint)
    env.close()
    exited = "RewardError: reward function 'quits_on_sample_0' raised SystemExit: reward gave up"
    assert sorted((t.task_id, t.sample_index, t.error) for t in seen) == [
        ("t0", 0, exited), ("t0", 1, None), ("t1", 0, exited), ("t1", 1, None)]
    assert [observations(t) for t in seen] == [["error: tool 'grep' failed: SystemExit: 2"]] * 4
    assert metrics["rollout/failed_samples"] == 2 and metrics["rollout/tool_errors"] == 4
    assert metrics["rollout/groups_failed"] == 0


def test_call_rollout_turns_a_rollout_functions_system_exit_into_an_exception():
    from sfrrl_jax.aio import UserCodeExit
    from sfrrl_jax.trainer.rollout_fn import call_rollout

    async def exits(engine, task, sample_index):
        sys.exit(4)

    with pytest.raises(UserCodeExit, match=r"SystemExit: 4 \(raised by the rollout function\)"):
        no_escape(asyncio.run, call_rollout(exits, None, tasks(1)[0], 0))


def test_a_rollout_function_exiting_fails_its_group_and_orphans_reach_the_metrics(tok_dir):
    """A user's own rollout function raising SystemExit / KeyboardInterrupt for one sample loses
    that group (refilled by another prompt), not the step; a tool call abandoned at its timeout is
    counted in the step's metrics (`rollout/orphaned_tool_calls`)."""
    import jax

    import sfrrl_jax as S

    env = S.ToolEnvironment([stubborn_tool(3.0)], None, S.ToolRunnerConfig(timeout_s=0.3), reward_fns=[zero])
    tokenizer = S.load_tokenizer(tok_dir)
    agent = S.AgentRollout(env, tokenizer, S.AgentConfig(max_turns=3, max_new_tokens_per_turn=32,
                                                         max_total_tokens=192))
    exits = [SystemExit(3), KeyboardInterrupt()]

    async def rollout(engine, task, sample_index):
        if sample_index == 0 and exits:
            raise exits.pop(0)   # the first two groups launched lose sample 0, so the group
        scripted = ScriptedEngine([CALL.format(name="stubborn"), ANSWER], tokenizer=tokenizer)
        return await agent(scripted, task, sample_index)

    model_cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=256)
    params = S.init_params(model_cfg, S.make_mesh(devices=jax.devices()[:1]), seed=0)
    trainer = S.RLTrainer(model_cfg, params, S.TrainerConfig(mode="sync", groups_per_step=2, group_size=2,
                                                             max_slots=4, max_len=192, longest_first=False),
                          S.LossConfig(), S.OptimizerConfig(learning_rate=1e-4), rollout, S.TaskStream(tasks(3)))
    metrics = [no_escape(trainer.step) for _ in range(2)]
    env.close()
    assert [m["rollout/groups_failed"] for m in metrics] == [2, 0]   # refilled: each step trained 2 groups
    assert [m["rollout/kept_groups"] for m in metrics] == [2, 2]
    # every kept sample called the stubborn tool once and left it running at the 0.3 s timeout
    assert [m["rollout/orphaned_tool_calls"] for m in metrics] == [4, 4]
