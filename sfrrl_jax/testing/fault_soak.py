"""The fault-injection soak: the straggler workload trained for N steps while everything fails.

Device steps raise at random (`FlakyEngineSteps`), the blocking tool crashes or hangs past its
timeout (`faulty_workload_tool`), the tool pool is shut down under the runner now and then,
finished rollouts raise (`RolloutLedger`), and over-provisioned groups are cancelled mid-flight
every step (the trainer's own cancellation path). Every step must complete, and after each one:
no slot held, no token log left, no rollout in limbo. At the end, no thread or child process
left over. `run_fault_soak(SoakConfig(...))` returns the figures; `experiments/soak/fault_soak.py`
prints them as a table and writes JSON.
"""
from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time

import jax
import numpy as np

from sfrrl_jax.agents.tools import ToolRunner, ToolRunnerConfig
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.models.api import init_params
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.testing.faults import FlakyEngineSteps, RolloutLedger, faulty_workload_tool
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    steps: int = 200
    seed: int = 0
    engine_fault_p: float = 0.01      # per device step call
    tool_crash_p: float = 0.05        # per tool call
    tool_hang_p: float = 0.03         # per tool call; hangs `tool_hang_s`, past `tool_timeout_s`
    tool_hang_s: float = 1.0
    tool_timeout_s: float = 0.3
    pool_crash_p: float = 0.05        # per step: the tool pool is shut down before it
    rollout_raise_p: float = 0.02     # per finished rollout
    groups_per_step: int = 2
    group_size: int = 4
    overprovision_groups: int = 2     # cancelled mid-flight at each step's end
    max_slots: int = 8
    mode: str = "pipelined"
    early_groups: int = 1


def _workload(seed: int) -> WorkloadConfig:
    return WorkloadConfig(num_prompts=16, prompt_len=8, turns_median=2.0, turns_sigma=0.6, max_turns=3,
                          response_median=6.0, response_sigma=0.8, max_response=32, tool_latency_median_s=0.01,
                          tool_latency_sigma=1.0, max_tool_latency_s=0.2, vocab_size=256, seed=seed,
                          difficulty_sigma=0.3, redraw_each_replay=True)


def _child_processes() -> int:
    import psutil
    return len(psutil.Process().children(recursive=True))


def run_fault_soak(cfg: SoakConfig, log=None) -> dict:
    """Runs the soak; raises AssertionError at the first broken invariant, else returns figures."""
    threads0, children0 = threading.active_count(), _child_processes()
    wl = _workload(cfg.seed)
    model_cfg = ModelConfig.preset("tiny-moe", max_seq_len=128)
    params = init_params(model_cfg, make_mesh(devices=jax.devices()[:1]), seed=cfg.seed)
    tool = faulty_workload_tool(wl.tool_name, cfg.tool_crash_p, cfg.tool_hang_p, cfg.tool_hang_s, seed=cfg.seed)
    runner = ToolRunner([tool], ToolRunnerConfig(timeout_s=cfg.tool_timeout_s, thread_workers=8))
    ledger = RolloutLedger(WorkloadAgent(wl, runner=runner), raise_p=cfg.rollout_raise_p, seed=cfg.seed)
    tc = TrainerConfig(mode=cfg.mode, groups_per_step=cfg.groups_per_step, group_size=cfg.group_size,
                       overprovision_groups=cfg.overprovision_groups, max_slots=cfg.max_slots, max_len=128,
                       buckets=(16, 32, 64), seq_bucket=64, underfull_slots=2, early_groups=cfg.early_groups,
                       longest_first=True, seed=cfg.seed)
    trainer = RLTrainer(model_cfg, params, tc, LossConfig(), OptimizerConfig(learning_rate=1e-5), ledger,
                        TaskStream(make_tasks(wl), seed=cfg.seed))
    flaky = FlakyEngineSteps(trainer.engine.steps, cfg.engine_fault_p, seed=cfg.seed)
    trainer.engine.steps = flaky
    rng = random.Random(cfg.seed)
    totals: collections.Counter = collections.Counter()
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        if rng.random() < cfg.pool_crash_p:
            runner._executor.shutdown(wait=False, cancel_futures=True)  # the pool dies between steps
            totals["pool_crashes_injected"] += 1
        m = trainer.step()  # raises on any crash: the soak then fails
        occupancy = trainer.engine.occupancy
        assert occupancy == {"running": 0, "parked": 0, "free": cfg.max_slots, "queued": 0}, (step, occupancy)
        assert not trainer.engine._logs, (step, "token logs left", trainer.engine._logs.keys())
        assert ledger.in_limbo == 0, (step, "rollouts neither returned, raised nor cancelled", ledger.counts)
        assert m["train/trained_tokens"] > 0 and np.isfinite(m["train/loss"]), (step, m)
        for key in ("rollout/failed_samples", "rollout/groups_failed", "rollout/tool_errors",
                    "engine/faults", "engine/restored_slots", "train/trained_tokens"):
            totals[key] += m[key]
        totals["kept_samples"] += cfg.groups_per_step * cfg.group_size
        if log is not None and (step + 1) % max(cfg.steps // 10, 1) == 0:
            log(f"soak step {step + 1}/{cfg.steps}: engine faults {totals['engine/faults']}, "
                f"failed samples {totals['rollout/failed_samples']}")
    wall = time.perf_counter() - t0
    runner.close()
    # Hung tool threads end when their sleep does; then nothing may be left.
    deadline = time.perf_counter() + cfg.tool_hang_s + 5
    while threading.active_count() > threads0 and time.perf_counter() < deadline:
        time.sleep(0.05)
    c = ledger.counts
    return {
        "steps_completed": cfg.steps, "crashes": 0, "wall_s": wall,
        "rollouts_started": c["started"], "rollouts_returned": c["returned"], "rollouts_raised": c["raised"],
        "rollouts_cancelled": c["cancelled"], "rollouts_in_limbo": ledger.in_limbo,
        "samples_trained_in_kept_groups": totals["kept_samples"],
        "failed_samples_counted": totals["rollout/failed_samples"], "groups_failed": totals["rollout/groups_failed"],
        "engine_faults_injected": sum(flaky.injected.values()), "engine_faults_recovered": totals["engine/faults"],
        "engine_slots_restored": totals["engine/restored_slots"],
        "tool_crashes_injected": tool.injected["crash"], "tool_hangs_injected": tool.injected["hang"],
        "tool_errors_observed": totals["rollout/tool_errors"],
        "tool_pool_crashes_injected": totals["pool_crashes_injected"], "tool_pools_replaced": runner.pools_replaced,
        "rollout_raises_injected": c["injected_raises"], "trained_tokens": totals["train/trained_tokens"],
        "leaked_slots": cfg.max_slots - trainer.engine.occupancy["free"],
        "leaked_threads": max(threading.active_count() - threads0, 0),
        "leaked_child_processes": max(_child_processes() - children0, 0),
    }
