"""Fault injection: wrappers that make the engine, tools and rollouts fail the way real ones do.

For chaos tests of a setup (ours in `tests/adversarial/`, the soak in `testing.fault_soak`, or a
user's own before a long run). Every wrapper draws from its own seeded `random.Random`, so a
failing run replays, and counts what it injected.

  FlakyEngineSteps   device steps raise (before the step ran, or after it consumed the state)
  FaultyWorkloadTool the workload's latency tool, blocking, that sometimes crashes or hangs
  RolloutLedger      a rollout function's every call accounted for (returned / raised /
                     cancelled), optionally raising after a finished rollout
"""
from __future__ import annotations

import asyncio
import collections
import random
import threading
import time

import jax

from sfrrl_jax.agents.tools import FunctionTool


class FlakyEngineSteps:
    """An engine's `EngineSteps` whose device steps raise: each call with probability `p`, the
    first call of each step always (so a short run covers them all), or every call (`always`).
    Half the faults come before the step runs, half after it ran, when its donated input state
    is already gone, as after a real runtime failure. Install: `engine.steps = FlakyEngineSteps(engine.steps, ...)`.
    """

    FAULTY = ("prefill", "insert", "prefill_many", "generate", "append_prefill", "append_many", "prefill_at_many",
              "free_resource")

    def __init__(self, steps, p: float, seed: int = 0, always: bool = False, first_calls: bool = True):
        if not 0 <= p <= 1:
            raise ValueError(f"FlakyEngineSteps: p must be in [0, 1], got {p}")
        self.inner, self._p, self._rng = steps, p, random.Random(seed)
        self._always, self._first_calls = always, first_calls
        self.injected: collections.Counter = collections.Counter()
        self._lock = threading.Lock()  # steps run on the driver's worker thread

    def __getattr__(self, name):
        real = getattr(self.inner, name)
        if name not in self.FAULTY:
            return real

        def flaky(*args, **kwargs):
            with self._lock:
                fault = (self._always or (self._first_calls and name not in self.injected)
                         or self._rng.random() < self._p)
                after = self._rng.random() < 0.5
            if fault and not after:
                self.injected[name] += 1
                raise RuntimeError(f"injected device fault before {name}")
            out = real(*args, **kwargs)
            if fault:
                jax.block_until_ready(out)
                self.injected[name] += 1
                raise RuntimeError(f"injected device fault after {name}")
            return out
        return flaky


def faulty_workload_tool(name: str, crash_p: float, hang_p: float, hang_s: float, seed: int = 0) -> FunctionTool:
    """The workload's `latency_tool(latency)`, as a *blocking* function on the runner's thread
    pool: it sleeps `latency`, or raises (crash_p), or blocks `hang_s` (hang_p; set it past the
    runner's timeout: the call times out and its thread is stuck that long). `tool.injected`
    counts both."""
    rng, lock = random.Random(seed), threading.Lock()
    injected: collections.Counter = collections.Counter()

    def latency_tool(latency: float) -> str:
        with lock:
            draw = rng.random()
        if draw < crash_p:
            injected["crash"] += 1
            raise RuntimeError("injected tool crash")
        if draw < crash_p + hang_p:
            injected["hang"] += 1
            time.sleep(hang_s)
            return "late"
        time.sleep(latency)
        return f"ok {latency:.3f}"

    tool = FunctionTool(name, "waits `latency` seconds (sometimes crashes or hangs)",
                        {"type": "object", "properties": {"latency": {"type": "number"}}, "required": ["latency"]},
                        latency_tool)
    tool.injected = injected
    return tool


class RolloutLedger:
    """Wraps `rollout_fn(engine, task, sample_index)`: every call ends up in exactly one of
    `returned`, `raised` or `cancelled`, so `started == returned + raised + cancelled` once the
    calls are over means no rollout was lost. With `raise_p`, a finished rollout raises anyway
    (an injected bug after the trajectory, e.g. in a user's reward): `injected_raises` counts them."""

    def __init__(self, rollout_fn, raise_p: float = 0.0, seed: int = 0):
        self.inner, self.raise_p, self._rng = rollout_fn, raise_p, random.Random(seed)
        self.counts: collections.Counter = collections.Counter()

    def __getattr__(self, name):  # state_dict / load_state_dict of a stateful rollout pass through
        return getattr(self.inner, name)

    async def __call__(self, engine, task, sample_index: int):
        self.counts["started"] += 1
        try:
            traj = await self.inner(engine, task, sample_index)
        except asyncio.CancelledError:
            self.counts["cancelled"] += 1
            raise
        except Exception:
            self.counts["raised"] += 1
            raise
        if self._rng.random() < self.raise_p:
            self.counts["raised"] += 1
            self.counts["injected_raises"] += 1
            raise RuntimeError(f"injected rollout failure ({task.task_id}/{sample_index})")
        self.counts["returned"] += 1
        return traj

    @property
    def in_limbo(self) -> int:
        c = self.counts
        return c["started"] - c["returned"] - c["raised"] - c["cancelled"]
