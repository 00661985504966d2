"""Tool calls on a Ray cluster: a pool of actors that build the tools once and run the calls.

When one host's CPUs cannot run enough sandboxes for its trajectories, `ToolRunnerConfig(backend=
'ray')` puts the calls on Ray, the distributed engine verl, SkyRL, slime and AReaL run their
agentic work on. `tool_runner(tools, cfg, env)` then returns a `RayToolRunner` in place of the
local `ToolRunner`, with the same interface and the same observations:

- **Actors build the tools.** Each of `ray_actors` actors (default: the cluster's CPUs) receives
  the environment (or the tool list) pickled with a *local* runner config, so the tools are
  constructed once per actor, on its node: a `PythonSandbox` probes and jails on the actor's
  host (it pickles as its config). The actors start on the first call, not when the environment
  is built (a `--validate_only` starts nothing).
- **Calls spread over free slots.** Each actor runs `ray_actor_concurrency` calls at once; a call
  takes the least busy actor with a free slot, or waits in this process for one. That wait is
  load, not the call's fault: it never counts against `timeout_s` and comes back as the result's
  `queue_s` (`tools/queue_s_p50|p99` in a step's metrics). From its dispatch, `timeout_s` covers
  the round trip; the actor's own local runner applies the same limit to the tool, so a hung
  tool's observation reads as it would locally, and the call is cancelled on the actor.
- **Faults are observations.** An actor that dies mid-call (a crash, a node lost, `ray.kill`)
  gives that call an error observation and is replaced (`pools_replaced` counts these); the
  other calls go on. Schema checks and unknown tools are answered here, before any round trip.
- **Episodes stay remote.** An environment with `open_episode(task)` (BFCL multi-turn) opens each
  episode on an actor that holds its state until it closes: the pool's least loaded one, or, with
  `ray_actor_per_episode`, an actor of its own (a process start per trajectory). Reset, steps and
  user turns run there. An episode's actor dying loses its state: the trajectory fails (its
  sample's error), since a replay on a fresh actor would not be the episode the policy saw.

Security is Ray's: a cluster's nodes and drivers authenticate as Ray configures them (token
authentication, TLS between nodes: see README "Multiple processes"); nothing here listens.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any, Sequence

from sfrrl_jax.agents.protocols import Message, Task, Tool, ToolCall, ToolCallError, ToolResult
from sfrrl_jax.agents.tools import ToolRunner, ToolRunnerConfig
from sfrrl_jax.aio import describe, settled

_log = logging.getLogger(__name__)

# Extra async slots an actor accepts beyond the ones this process hands out: a call given up at its
# timeout may still be ending there when its slot is handed to the next call.
_ACTOR_SLACK = 8
# How long the actors may take to start (process, imports, building the tools) before the pool fails.
ACTOR_START_TIMEOUT_S = 300.0


def tool_runner(tools: Sequence[Tool], cfg: ToolRunnerConfig = ToolRunnerConfig(), env: Any = None):
    """The runner of `tools` under `cfg`: a local `ToolRunner`, or a `RayToolRunner` for
    `cfg.backend == 'ray'` whose actors receive `env` (pickled with a local runner; it must then
    pickle, as `ToolEnvironment` does) or, without one, the tools themselves."""
    if cfg.backend == "ray":
        return RayToolRunner(tools, cfg, env)
    return ToolRunner(tools, cfg)


class ToolActor:
    """What each Ray actor runs (wrapped by `ray.remote` when the pool starts): the tools of
    `env` (a local-backend copy) or `tools`, and the episodes opened on it, by key."""

    def __init__(self, tools: Sequence[Tool], env: Any, cfg: ToolRunnerConfig):
        self.env = env
        self.runner = env.runner if env is not None else ToolRunner(tools, cfg)
        self.episodes: dict[str, Any] = {}

    def where(self) -> dict:
        """This actor's process and node (tests and the bench read where calls ran)."""
        import ray
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    async def call(self, call: ToolCall) -> ToolResult:
        return await self.runner.run_one(call)

    async def open_episode(self, key: str, task: Task) -> list[Message]:
        if self.env is None or not hasattr(self.env, "open_episode"):
            raise TypeError("this tool pool's environment has no open_episode(task)")
        episode = self.episodes[key] = self.env.open_episode(task)
        return await settled(episode.reset())

    async def step(self, key: str, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        return await self._episode(key).step(calls)

    async def next_user_turn(self, key: str) -> list[Message] | None:
        return await settled(self._episode(key).next_user_turn())

    def close_episode(self, key: str) -> None:
        episode = self.episodes.pop(key, None)
        if episode is not None:
            episode.close()

    def _episode(self, key: str):
        episode = self.episodes.get(key)
        if episode is None:
            raise KeyError(f"no open episode {key!r} on this actor (pid {os.getpid()})")
        return episode



@dataclasses.dataclass(eq=False)
class _Actor:
    """One pool actor as this process sees it: its handle (replaced when it dies), calls in
    flight, episodes held."""

    handle: Any
    busy: int = 0
    episodes: int = 0
    node: str | None = None   # the node it was placed on (its replacement goes there too)


class RayToolRunner:
    """`ToolRunner`'s interface over a pool of Ray actors (see the module doc).

    Args:
      tools: the tools, by their distinct names (checked here; built on the actors from `env`
        or from this list).
      cfg: the runner config; `backend` 'ray' and the `ray_*` fields.
      env: the environment the actors rebuild (pickled), or None: the tools alone.

    Attributes:
      tools, cfg: as `ToolRunner`'s.
      pools_replaced: actors found dead and replaced.
      orphaned_calls: always 0 here (a call given up at its timeout is cancelled on its actor,
        whose own runner counts what it abandons).
      actors: the live actor handles (after the first call).
    """

    def __init__(self, tools: Sequence[Tool], cfg: ToolRunnerConfig, env: Any = None):
        self._local = ToolRunner(tools, dataclasses.replace(cfg, backend="local"))
        self.tools, self.cfg, self.env = self._local.tools, cfg, env
        self.pools_replaced = 0
        self.orphaned_calls = 0
        self._pool: list[_Actor] = []
        self._actor_cls: Any = None
        self._lock = threading.Lock()
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._startup: concurrent.futures.Future | None = None

    @property
    def actors(self) -> list:
        return [a.handle for a in self._pool]

    def schemas(self) -> list[dict]:
        return self._local.schemas()

    def checked_tool(self, call: ToolCall | ToolCallError, tools=None) -> Tool | ToolResult:
        return self._local.checked_tool(call, tools)

    # -- the pool ---------------------------------------------------------------------------------
    async def started(self) -> None:
        """Starts the pool once (Ray joined or started, actors up), off the event loop; raises
        RuntimeError naming the cause when the actors cannot start."""
        with self._lock:
            if self._startup is None:
                self._startup = concurrent.futures.Future()
                threading.Thread(target=self._start, name="ray-tool-pool-start", daemon=True).start()
        await asyncio.wrap_future(self._startup)

    def _start(self) -> None:
        started_ray = False
        try:
            import ray
            if not ray.is_initialized():
                # None: RAY_ADDRESS, else a new local cluster, never a stale `ray start` record
                # (Ray's own default joins the last cluster started on this machine, dead or alive)
                address = self.cfg.ray_address or os.environ.get("RAY_ADDRESS") or "local"
                ray.init(address=address, ignore_reinit_error=True)
                started_ray = True
            cfg = self.cfg
            n = cfg.ray_actors
            if n is None:
                cpus = ray.cluster_resources().get("CPU", 1.0)
                n = max(1, int(cpus // cfg.ray_actor_cpus) if cfg.ray_actor_cpus > 0 else int(cpus))
            free = ray.available_resources().get("CPU", 0.0)
            if n * cfg.ray_actor_cpus > free + 1e-9:   # Ray would wait for them forever
                raise RuntimeError(f"{n} actors x ToolRunnerConfig.ray_actor_cpus={cfg.ray_actor_cpus} need "
                                   f"{n * cfg.ray_actor_cpus:g} CPUs; the cluster has {free:g} free (other pools or "
                                   f"jobs hold the rest): lower ray_actor_cpus (0 reserves none) or ray_actors")
            self._actor_cls = ray.remote(ToolActor)
            homes = _spread_over_nodes(ray.nodes(), n)
            self._pool = [_Actor(self._new_actor(cfg.ray_actor_cpus, home), node=home) for home in homes]
            ray.get([a.handle.where.remote() for a in self._pool], timeout=ACTOR_START_TIMEOUT_S)
            self._startup.set_result(None)
        except BaseException as e:  # noqa: BLE001 -- every waiting caller reads why
            self._startup.set_exception(RuntimeError(
                f"the Ray tool pool (ToolRunnerConfig backend='ray', ray_address={self.cfg.ray_address!r}) could not "
                f"start: {describe(e)}"))
        if started_ray:
            # A local cluster's daemons (GCS, raylet) die with the *thread* that started them (Linux's
            # parent-death signal follows the creating thread): this one stays, asleep, until the
            # process exits (it is a daemon thread), so the cluster lives as long as this process.
            threading.Event().wait()

    def _new_actor(self, num_cpus: float, node: str | None = None):
        """An actor, on `node` if given, else where Ray spreads it. Hard affinity: with a soft one, Ray
        put actors that reserve no CPUs on the head node all the same."""
        local = dataclasses.replace(self.cfg, backend="local")
        tools = list(self.tools.values()) if self.env is None else []
        strategy: Any = "SPREAD"
        if node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        return self._actor_cls.options(
            num_cpus=num_cpus, max_concurrency=self.cfg.ray_actor_concurrency + _ACTOR_SLACK,
            scheduling_strategy=strategy).remote(tools, self.env, local)

    def _replace(self, actor: _Actor, dead: Any) -> None:
        with self._lock:
            if actor.handle is not dead:  # another call on it saw it die first
                return
            import ray
            alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
            if actor.node not in alive:   # its node is gone with it: Ray places the replacement
                actor.node = None
            actor.handle = self._new_actor(self.cfg.ray_actor_cpus, actor.node)
            self.pools_replaced += 1
        _log.warning("a Ray tool actor died and was replaced (%d so far)", self.pools_replaced)

    async def _acquire(self) -> _Actor:
        limit = self.cfg.ray_actor_concurrency
        while True:
            with self._lock:
                free = [a for a in self._pool if a.busy < limit]
                if free:
                    actor = min(free, key=lambda a: a.busy)
                    actor.busy += 1
                    return actor
                waiter = asyncio.get_running_loop().create_future()
                self._waiting.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # it was woken for a slot it will not take: pass it on
                raise

    def _release(self, actor: _Actor) -> None:
        with self._lock:
            actor.busy -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        with self._lock:
            while self._waiting:
                waiter = self._waiting.popleft()
                if not waiter.done():
                    waiter.get_loop().call_soon_threadsafe(_wake, waiter)
                    return

    # -- calls ------------------------------------------------------------------------------------
    async def run(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        """All calls of one turn, concurrently; results in call order."""
        return list(await asyncio.gather(*(self.run_one(c) for c in calls)))

    async def run_one(self, call: ToolCall | ToolCallError, tools=None) -> ToolResult:
        """One call on a pool actor (against other `tools`: on this host, as `ToolRunner.run_one`).
        Never raises for anything the call or its actor does; a pool that cannot start raises."""
        if tools is not None:
            return await self._local.run_one(call, tools)
        checked = self._local.checked_tool(call)
        if isinstance(checked, ToolResult):
            return checked
        await self.started()
        queued = time.perf_counter()
        actor = await self._acquire()
        start = time.perf_counter()
        handle = actor.handle
        ref = handle.call.remote(call)
        work = asyncio.wrap_future(ref.future())
        try:
            done, _ = await asyncio.wait((work,), timeout=self.cfg.timeout_s)
        except asyncio.CancelledError:
            _cancel(ref)
            raise
        finally:
            self._release(actor)
        queue_s, elapsed = start - queued, time.perf_counter() - start
        if not done:
            _cancel(ref)
            result = self._local._error(call.name, f"tool {call.name!r} timed out after {self.cfg.timeout_s} s",
                                        call.call_id, elapsed)
        else:
            try:
                result = work.result()
            except BaseException as e:  # noqa: BLE001 -- the actor's failure is this call's observation
                if _actor_died(e):
                    self._replace(actor, handle)
                    message = f"tool {call.name!r} failed: its Ray actor died ({_first_line(e)})"
                else:
                    message = f"tool {call.name!r} failed: {describe(e)}"
                result = self._local._error(call.name, message, call.call_id, elapsed)
        return dataclasses.replace(result, queue_s=queue_s)

    def open_remote_episode(self, task: Task) -> "RayEpisode":
        """An episode of `self.env.open_episode(task)` held on an actor (`agents.loop` asks this
        of an environment whose runner has it)."""
        return RayEpisode(self, task)

    def close(self) -> None:
        """Kills the pool's actors (their calls in flight end as errors) and the local pool."""
        import sys
        ray = sys.modules.get("ray")
        for actor in self._pool:
            try:
                ray.kill(actor.handle)
            except Exception:  # noqa: BLE001 -- already gone, or Ray shut down first
                pass
        self._pool = []
        self._startup = None
        self._local.close()


class RayEpisode:
    """One trajectory's episode on a Ray actor (`protocols.Episode`; reset and user turns are
    awaitables, which the agent loop awaits). Its state lives on the actor until `close()`."""

    def __init__(self, runner: RayToolRunner, task: Task):
        self.runner, self.task = runner, task
        self.key = uuid.uuid4().hex
        self._actor: _Actor | None = None
        self._handle: Any = None

    async def reset(self) -> list[Message]:
        runner = self.runner
        await runner.started()
        if runner.cfg.ray_actor_per_episode:
            self._handle = runner._new_actor(0)
        else:
            with runner._lock:
                self._actor = min(runner._pool, key=lambda a: a.episodes)
                self._actor.episodes += 1
                self._handle = self._actor.handle
        return await self._remote("open_episode", ACTOR_START_TIMEOUT_S, self.task)

    async def step(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        # each call is bounded on the actor; the slack covers the round trips
        return await self._remote("step", self.runner.cfg.timeout_s * max(len(calls), 1) + 30.0, list(calls))

    async def next_user_turn(self) -> list[Message] | None:
        return await self._remote("next_user_turn", 60.0)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        handle.close_episode.remote(self.key)
        if self.runner.cfg.ray_actor_per_episode:
            handle.__ray_terminate__.remote()   # after the close, in order
        elif self._actor is not None:
            with self.runner._lock:
                self._actor.episodes -= 1

    async def _remote(self, method: str, timeout_s: float, *args: Any) -> Any:
        if self._handle is None:
            raise RuntimeError("this episode is closed")
        ref = getattr(self._handle, method).remote(self.key, *args)
        work = asyncio.wrap_future(ref.future())
        try:
            done, _ = await asyncio.wait((work,), timeout=timeout_s)
        except asyncio.CancelledError:
            _cancel(ref)
            raise
        if not done:
            _cancel(ref)
            raise TimeoutError(f"the episode's Ray actor did not answer {method} within {timeout_s:.0f} s")
        try:
            return work.result()
        except BaseException as e:
            if _actor_died(e):
                if self._actor is not None:
                    self.runner._replace(self._actor, self._handle)
                raise RuntimeError(f"the Ray actor holding this episode died; its state is lost: "
                                   f"{_first_line(e)}") from None
            raise


def _spread_over_nodes(nodes: Sequence[dict], n: int) -> list[str | None]:
    """A node id for each of `n` actors: the alive nodes with CPUs in turn, each as often as it has
    CPUs (a node of 8 CPUs gets 4x the actors of one of 2). Placed by node, not by Ray's SPREAD:
    actors that reserve no CPUs (the default) were all put on one node of two. None: Ray places it."""
    cpus = {node["NodeID"]: int(node.get("Resources", {}).get("CPU", 0)) for node in nodes if node.get("Alive")}
    cpus = {node: count for node, count in sorted(cpus.items()) if count > 0}
    if not cpus:
        return [None] * n
    turns: list[str] = []
    for round_ in range(max(cpus.values())):   # round robin over the nodes, weighted by their CPUs
        turns += [node for node, count in cpus.items() if count > round_]
    return [turns[i % len(turns)] for i in range(n)]


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _cancel(ref: Any) -> None:
    import ray
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 -- finished, or its actor is gone
        pass


def _actor_died(e: BaseException) -> bool:
    import ray.exceptions
    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__

