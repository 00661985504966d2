"""Tool calls on a real local Ray cluster (issue #50): the same trajectories and rewards as the
local backend, BFCL multi-turn episodes held on actors, a killed actor, a hung tool, 1,000
concurrent calls, and a two-node cluster started with `ray start`."""
import asyncio
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="pip install 'sfrrl_jax[ray]' (in the test extra)")

from sfrrl_jax.agents.loop import AgentConfig, open_episode, run_agent  # noqa: E402
from sfrrl_jax.agents.protocols import ToolCall  # noqa: E402
from sfrrl_jax.agents.ray_tools import RayEpisode, RayToolRunner, tool_runner  # noqa: E402
from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task  # noqa: E402
from sfrrl_jax.agents.tasks.environments import ToolEnvironment, calculator_environment  # noqa: E402
from sfrrl_jax.agents.tools import FunctionTool, ToolRunner, ToolRunnerConfig  # noqa: E402
from sfrrl_jax.testing import ScriptedEngine  # noqa: E402
from sfrrl_jax.tokenizer import load_tokenizer  # noqa: E402

ANY = {"type": "object"}


def _nap(seconds: float = 0.0, tag: int = 0) -> str:
    time.sleep(seconds)
    return f"{tag} by {os.getpid()}"


def _exit() -> str:
    raise SystemExit(3)


NAP = FunctionTool("nap", "sleeps", {"type": "object", "properties": {"seconds": {"type": "number"},
                                                                       "tag": {"type": "integer"}}}, _nap)
EXIT = FunctionTool("exit", "exits", ANY, _exit)


@pytest.fixture(scope="module")
def cluster():
    # address='local': a new cluster of our own, never one a `ray start` on this machine left running
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    # the tools below are this test module's functions, which the actors' processes cannot import:
    # they travel by value, as a notebook's do
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_config_names_a_bad_backend_and_environments_pickle_with_a_local_runner():
    with pytest.raises(ValueError, match="ToolRunnerConfig.backend must be one of"):
        ToolRunnerConfig(backend="slurm")
    with pytest.raises(ValueError, match="ToolRunnerConfig.ray_actors"):
        ToolRunnerConfig(backend="ray", ray_actors=0)
    env = calculator_environment(ToolRunnerConfig(backend="ray", timeout_s=3.0))
    assert isinstance(env.runner, RayToolRunner) and env.runner.actors == []   # nothing starts before a call
    copy = pickle.loads(pickle.dumps(env))
    assert type(copy.runner) is ToolRunner and copy.runner.cfg.backend == "local"
    assert copy.runner.cfg.timeout_s == 3.0 and list(copy.runner.tools) == ["calculator"]


def _run(env, tok, task):
    from test_agent_loop import _demo   # the calculator demonstration's prompt and turns
    prompt, turns, _, _ = _demo(tok, task, env)
    engine = ScriptedEngine({tuple(prompt): turns})
    return asyncio.run(run_agent(engine, env, task, tok, AgentConfig(seed=1), sample_index=0, group_id="g"))


def test_ray_backend_gives_the_trajectories_and_rewards_of_the_local_one(cluster, tok):
    task = arithmetic_task("1933 - (85407 - 98)", "t0")
    local = _run(calculator_environment(), tok, task)
    env = calculator_environment(ToolRunnerConfig(backend="ray", ray_actors=2))
    remote = _run(env, tok, task)
    assert remote.error is None and remote.reward == local.reward == 1.0
    assert remote.tokens == local.tokens and remote.loss_mask == local.loss_mask
    assert [m["content"] for m in remote.messages] == [m["content"] for m in local.messages]
    assert len(env.runner.actors) == 2
    # errors read as they do locally
    calls = [ToolCall("calculator", {"expression": "1/0"}, "a"), ToolCall("calc", {}, "b"),
             ToolCall("calculator", {"x": 1}, "c")]
    assert ([r.content for r in asyncio.run(env.step(calls))]
            == [r.content for r in asyncio.run(calculator_environment().step(calls))])
    env.close()


def test_a_killed_actor_is_that_calls_error_and_is_replaced(cluster):
    runner = RayToolRunner([NAP], ToolRunnerConfig(backend="ray", ray_actors=1, timeout_s=600.0))

    async def main():
        first = await runner.run_one(ToolCall("nap", {"tag": 1}))
        pid = int(first.content.split(" by ")[1])
        call = asyncio.ensure_future(runner.run_one(ToolCall("nap", {"seconds": 300.0, "tag": 2})))
        await asyncio.sleep(1.0)
        ray.kill(runner.actors[0])
        t0 = time.perf_counter()
        dead = await call
        waited = time.perf_counter() - t0
        after = await runner.run([ToolCall("nap", {"tag": i}) for i in range(3)])
        return pid, dead, waited, after

    pid, dead, waited, after = asyncio.run(main())
    assert waited < 60.0, waited   # the death ends the call, not the tool's 300 s nor the timeout
    assert dead.is_error and "its Ray actor died" in dead.content, dead.content
    assert runner.pools_replaced == 1
    assert [r.content.split(" by ")[0] for r in after] == ["0", "1", "2"] and not any(r.is_error for r in after)
    assert {int(r.content.split(" by ")[1]) for r in after} != {pid}   # a new process
    runner.close()


def test_a_hung_tool_times_out_and_one_that_exits_is_an_error_the_actor_survives(cluster):
    runner = RayToolRunner([NAP, EXIT], ToolRunnerConfig(backend="ray", ray_actors=1, timeout_s=2.0))

    async def main():
        await runner.started()
        t0 = time.perf_counter()
        out = await runner.run([ToolCall("nap", {"seconds": 600.0}), ToolCall("exit", {}),
                                ToolCall("nap", {"tag": 7})])
        return out, time.perf_counter() - t0

    (hung, exited, fine), took = asyncio.run(main())
    assert took < 30.0, took   # the 2 s timeout, not the 600 s nap
    assert hung.is_error and hung.content == "error: tool 'nap' timed out after 2.0 s"
    assert exited.is_error and "SystemExit" in exited.content
    assert fine.content.startswith("7 by ")
    assert asyncio.run(runner.run_one(ToolCall("nap", {"tag": 8}))).content.startswith("8 by ")
    assert runner.pools_replaced == 0
    runner.close()


def test_a_thousand_concurrent_calls_queue_outside_their_timeout(cluster):
    # 2 actors x 4 slots for 1000 calls of 20 ms: ~2.5 s of queueing, beyond the 1 s timeout,
    # which starts at dispatch: none times out
    cfg = ToolRunnerConfig(backend="ray", ray_actors=2, ray_actor_concurrency=4, timeout_s=1.0, thread_workers=4)
    runner = tool_runner([NAP], cfg)

    async def main():
        return await runner.run([ToolCall("nap", {"seconds": 0.02, "tag": i}, str(i)) for i in range(1000)])

    results = asyncio.run(main())
    assert [r.content.split(" by ")[0] for r in results] == [str(i) for i in range(1000)]
    assert [r.call_id for r in results] == [str(i) for i in range(1000)] and not any(r.is_error for r in results)
    assert len({r.content.split(" by ")[1] for r in results}) == 2          # both actors served
    assert max(r.queue_s for r in results) > cfg.timeout_s                  # queued longer than the timeout
    runner.close()


def test_bfcl_multi_turn_episodes_live_on_actors_with_the_local_rewards(cluster):
    pytest.importorskip("bfcl_eval", reason="pip install --no-deps 'bfcl-eval==2026.3.23' (README: Tests)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_bfcl_multi_turn import THINKING_TEMPLATE, ScriptedModel, script_for, truth_per_turn
    from hf_tokenizer_fixtures import CORPUS, build_qwen3_style_tokenizer
    from sfrrl_jax.agents.tasks import load_tasks
    from sfrrl_jax.agents.tasks.bfcl_multi_turn import BfclMultiTurnEnvironment, multi_turn_match, multi_turn_progress
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        build_qwen3_style_tokenizer(Path(directory), THINKING_TEMPLATE, corpus=CORPUS + ["cd mkdir mv grep sort diff"] * 10)
        qtok = load_tokenizer(directory)
    task = load_tasks("bfcl:multi_turn_base", limit=1)[0]
    cfg = AgentConfig(max_turns=20, max_new_tokens_per_turn=512, max_total_tokens=16384, temperature=0.0,
                      tool_format="qwen3")
    truth = truth_per_turn(task)

    def play(runner_cfg):
        env = BfclMultiTurnEnvironment(reward_fns=[multi_turn_match, multi_turn_progress], runner_cfg=runner_cfg,
                                       reward_weights=[1.0, 0.0])
        good = ScriptedModel(qtok, script_for(task))
        bad = ScriptedModel(qtok, [qwen3_turn(truth[0]), "ok<|im_end|>", "I cannot.<|im_end|>"]
                            + ["no<|im_end|>"] * (len(truth) - 2))

        async def both():
            return await asyncio.gather(run_agent(good, env, task, qtok, cfg, sample_index=0),
                                        run_agent(bad, env, task, qtok, cfg, sample_index=1))
        out = asyncio.run(both())
        return env, out

    from test_bfcl_multi_turn import qwen3_turn
    _, (local_good, local_bad) = play(ToolRunnerConfig())
    for per_episode in (False, True):
        env, (good, bad) = play(ToolRunnerConfig(backend="ray", ray_actors=1, ray_actor_per_episode=per_episode))
        assert isinstance(open_episode(env, task), RayEpisode)
        assert good.error is None and good.reward == 1.0 == local_good.reward
        assert bad.reward == local_bad.reward == 0.0
        assert bad.metadata["rewards"] == local_bad.metadata["rewards"]
        assert good.tokens == local_good.tokens and bad.tokens == local_bad.tokens
        env.runner.close()


def test_an_episode_whose_actor_dies_fails_its_trajectory_loudly(cluster):
    pytest.importorskip("bfcl_eval", reason="pip install --no-deps 'bfcl-eval==2026.3.23' (README: Tests)")
    from sfrrl_jax.agents.tasks import load_tasks
    from sfrrl_jax.agents.tasks.bfcl_multi_turn import BfclMultiTurnEnvironment
    task = load_tasks("bfcl:multi_turn_base", limit=1)[0]
    env = BfclMultiTurnEnvironment(runner_cfg=ToolRunnerConfig(backend="ray", ray_actors=1))

    async def main():
        episode = open_episode(env, task)
        messages = await episode.reset()
        ray.kill(episode._handle)
        with pytest.raises(RuntimeError, match="its state is lost"):
            await episode.step([ToolCall("pwd", {})])
        episode.close()
        return messages

    assert asyncio.run(main())[-1]["role"] == "user"
    assert env.runner.pools_replaced == 1
    env.runner.close()


TWO_NODE_DRIVER = textwrap.dedent("""
    import asyncio, sys, time, ray
    from sfrrl_jax.agents.protocols import ToolCall
    from sfrrl_jax.agents.ray_tools import RayToolRunner
    from sfrrl_jax.agents.tools import FunctionTool, ToolRunnerConfig

    def nap(seconds, tag):   # defined in __main__: it travels to the actors by value
        time.sleep(seconds)
        return str(tag)
    ray.init(address=sys.argv[1])
    deadline = time.monotonic() + 120
    while sum(n["Alive"] for n in ray.nodes()) < 2:   # the second node is still joining
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.5)
    # the pool, sized by the cluster's CPUs (one per node), has an actor on each node; they reserve no CPUs
    cfg = ToolRunnerConfig(backend="ray", ray_address=sys.argv[1], timeout_s=30.0)
    runner = RayToolRunner([FunctionTool("nap", "", {"type": "object"}, nap)], cfg)
    results = asyncio.run(runner.run([ToolCall("nap", {"seconds": 0.05, "tag": i}) for i in range(40)]))
    nodes = {info["node_id"] for info in ray.get([a.where.remote() for a in runner.actors])}
    print("ACTORS", len(runner.actors), "NODES", len(nodes), "OK", sum(not r.is_error for r in results))
""")



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_two_node_cluster_started_with_ray_start_spreads_the_actors(tmp_path):
    """Two nodes on one machine (`ray start --head`, then `ray start --address`), one CPU each; a
    driver joins with `ray_address`: the pool (sized by the cluster's CPUs) has an actor per node."""
    port = _free_port()
    # Ray's token authentication, as the README has clusters run it: every node and driver in token mode,
    # the token from ~/.ray/auth_token (which the head writes) or RAY_AUTH_TOKEN
    env = dict(os.environ, RAY_AUTH_MODE="token")
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus=1",
               "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    # each `ray start` and the daemons it spawns in a session of its own: killing that group stops the node
    nodes = [subprocess.Popen(ray_cli + ["--head", f"--port={port}", "--include-dashboard=false"], env=env,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 120
        while True:   # the head's GCS answers before the second node joins it
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and nodes[0].poll() is None, "ray start --head did not come up"
                time.sleep(0.5)
        nodes.append(subprocess.Popen(ray_cli + [f"--address=127.0.0.1:{port}"],
                                      env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        script = tmp_path / "driver.py"
        script.write_text(TWO_NODE_DRIVER)
        out = subprocess.run([sys.executable, str(script), f"127.0.0.1:{port}"], env=env, capture_output=True,
                             text=True, timeout=300)
        assert "ACTORS 2 NODES 2 OK 40" in out.stdout, out.stdout + out.stderr[-3000:]
    finally:   # each node's session: `ray start` and the daemons it spawned, killed at once
        for node in reversed(nodes):
            try:
                os.killpg(node.pid, 9)
            except ProcessLookupError:
                pass
            node.wait()


def test_mcp_tools_on_ray_connect_from_each_actor(cluster):
    """An environment of MCP tools on the Ray backend: each actor opens its own session with the
    server (a stdio server: its own subprocess), so the calls run there, not through ours."""
    pytest.importorskip("mcp", reason="pip install 'sfrrl_jax[mcp]' (in the test extra)")
    from sfrrl_jax.agents.mcp_tools import mcp_tools
    server = [sys.executable, str(Path(__file__).resolve().parent / "mcp_server_fixture.py"), "stdio"]
    tools = mcp_tools(server, include=["add", "pid"])
    env = ToolEnvironment(tools, None, ToolRunnerConfig(backend="ray", ray_actors=1, timeout_s=60.0))
    try:
        ours = asyncio.run(ToolRunner(tools).run_one(ToolCall("pid", {}))).content
        add, pid = asyncio.run(env.step([ToolCall("add", {"a": 2, "b": 3}), ToolCall("pid", {})]))
        assert add.content == "5" and not pid.is_error and pid.content != ours
    finally:
        env.runner.close()
        tools[0].connection.close()


def test_the_straggler_workload_trains_a_step_with_its_tools_on_ray(cluster):
    """The synthetic long-tail workload (WorkloadRollout's agent) with its tool calls on the actor
    pool: the step's trajectories and rewards are the local backend's, and the step reports the
    calls' queue times."""
    import jax
    import sfrrl_jax as S
    from sfrrl_jax.learner.optimizer import OptimizerConfig
    from sfrrl_jax.rl.config import LossConfig
    from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
    from sfrrl_jax.trainer.config import TrainerConfig
    from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=64, n_layers=1)
    wl = WorkloadConfig(num_prompts=3, response_median=4, max_response=8, tool_latency_median_s=0.01,
                        max_tool_latency_s=0.05)
    tc = TrainerConfig(groups_per_step=3, group_size=2, max_len=64, buckets=(16, 32), seq_bucket=64)

    def step(tools):
        params = S.init_params(cfg, S.make_mesh(devices=jax.devices()[:1]), seed=0)
        trainer = RLTrainer(cfg, params, tc, LossConfig(), OptimizerConfig(), WorkloadAgent(wl, tools=tools),
                            TaskStream(make_tasks(wl)))
        return trainer.step()

    local = step(ToolRunnerConfig())
    remote = step(ToolRunnerConfig(backend="ray", ray_actors=2))
    for key in ("reward/mean", "rollout/generated_tokens", "train/trained_tokens", "rollout/tool_errors"):
        assert remote[key] == local[key], key
    assert local["tools/remote_calls"] == 0 and remote["tools/remote_calls"] > 0
    assert 0.0 < remote["tools/queue_s_p50"] <= remote["tools/queue_s_p99"]


SELF_STARTED = textwrap.dedent("""
    import asyncio, time
    from sfrrl_jax.agents.protocols import ToolCall
    from sfrrl_jax.agents.tasks.environments import calculator_environment
    from sfrrl_jax.agents.tools import ToolRunnerConfig
    env = calculator_environment(ToolRunnerConfig(backend="ray", ray_actors=1))
    first = asyncio.run(env.step([ToolCall("calculator", {"expression": "6*7"})]))[0].content
    time.sleep(3)   # the start thread's work is done: had it exited, its daemons died within a second
    second = asyncio.run(env.step([ToolCall("calculator", {"expression": "6*8"})]))[0].content
    print("RESULTS", first, second)
""")


def test_a_cluster_the_runner_starts_itself_outlives_its_start(tmp_path):
    """Without ray.init in the caller, the pool starts a local cluster from its start thread; the
    cluster's daemons die with the thread that started them, so that thread must live on (a
    straggler bench lost its cluster a minute in before it did)."""
    script = tmp_path / "self_started.py"
    script.write_text(SELF_STARTED)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert "RESULTS 42 48" in out.stdout, out.stdout + out.stderr[-3000:]


def test_pools_share_the_cluster_and_one_that_cannot_fit_is_refused_by_name(cluster):
    """Actors reserve no CPUs by default, so several pools (a bench's trainers, a train and an eval
    environment) run side by side; a pool whose reservations exceed the free CPUs fails at once,
    naming the key, where Ray would wait for them forever."""
    runners = [tool_runner([NAP], ToolRunnerConfig(backend="ray")) for _ in range(3)]

    async def main():
        return [await r.run_one(ToolCall("nap", {"tag": i})) for i, r in enumerate(runners)]

    assert [r.content.split(" by ")[0] for r in asyncio.run(main())] == ["0", "1", "2"]
    assert all(len(r.actors) == 2 for r in runners)   # sized by the cluster's 2 CPUs
    greedy = tool_runner([NAP], ToolRunnerConfig(backend="ray", ray_actors=3, ray_actor_cpus=1.0))
    with pytest.raises(RuntimeError, match="ray_actor_cpus=1.0 need 3 CPUs"):
        asyncio.run(greedy.run_one(ToolCall("nap", {})))
    for r in runners:
        r.close()


def test_pool_actors_are_spread_over_the_nodes_by_their_cpus():
    from sfrrl_jax.agents.ray_tools import _spread_over_nodes
    nodes = [{"NodeID": "big", "Alive": True, "Resources": {"CPU": 3.0}},
             {"NodeID": "small", "Alive": True, "Resources": {"CPU": 1.0}},
             {"NodeID": "gone", "Alive": False, "Resources": {"CPU": 8.0}},
             {"NodeID": "no_cpu", "Alive": True, "Resources": {"GPU": 1.0}}]
    assert _spread_over_nodes(nodes, 4) == ["big", "small", "big", "big"]
    assert _spread_over_nodes(nodes, 6) == ["big", "small", "big", "big", "big", "small"]
    assert _spread_over_nodes([], 2) == [None, None]   # Ray places them


def test_the_jailed_sandbox_runs_inside_the_actors(cluster):
    """A sandboxed environment on Ray: the PythonSandbox travels as its config and jails the code on
    the actor's host. This process's sandbox is disabled: the answer can only come from an actor's."""
    from sfrrl_jax.agents.tasks.environments import countdown_tool_environment
    env = countdown_tool_environment(ToolRunnerConfig(backend="ray", ray_actors=1, timeout_s=60.0))
    env.runner.tools["python"].sandbox.run = None   # a local run would fail: 'NoneType' is not callable
    (result,) = asyncio.run(env.step([ToolCall("python", {"code": "print(6 * 7)"})]))
    assert result.content == "42\n" and not result.is_error, result.content
    env.close()
