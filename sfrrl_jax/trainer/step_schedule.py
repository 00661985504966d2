"""One RL step's schedule, as an object: `await RLStep(inputs, rules).run()` -> `StepResult`
(DESIGN.md section 3).

`RLTrainer.step_async` builds one `RLStep` per step from explicit inputs (`StepInputs`: configs,
parts, and the params / optimizer state / version / step index it starts from) and applies the
`StepResult` it returns. The step holds everything that lives for one step (the gradient
accumulator, the groups in flight and kept, the micro-steps ready to run, the counters) as
attributes; its phases, in the order `run` calls them:

  begin            the engine gets the params, a fresh accumulator, the idle-work hooks
  rollout          (the rules) launch the step's prompts, collect groups as they finish (drop /
                   refill / keep them; kept groups become micro-steps, `pipelined`: queued for the
                   engine's idle time), stop surplus groups, free the KV cache
  train_remaining  (the rules) the micro-steps the rollout did not hide (all of them in `sync`,
                   in draw order)
  finish           the one optimizer update; the step's metrics; the `StepResult`

What differs between one process and N processes in lockstep is a strategy, `StepRules`, passed
in as a value (`trainer.step_rules`): `OneProcessRules` or `trainer.process_step.LockstepRules` (which groups are
this process's, rounds agreed across processes, replicated events, global micro-batches, metrics
summed over processes). The step calls its rules at fixed points (`StepRules`' methods) and is
never subclassed.

The engine pops work through the rules' `idle_work` (micro-steps of finished groups first, then
early samples) and runs it on its driver thread with `RLStep.microstep`. Everything else runs on
the event loop. Micro-steps are formed by `trainer.microsteps.make_units` (pure host work).
`train/padding_share` is the share of the micro-steps' [rows, width] positions that held no token.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, Sequence

import jax
import numpy as np

from sfrrl_jax.agents.protocols import EngineError, Task
from sfrrl_jax.agents.tasks.reward_fns import reward_component_means
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.engine import Engine
from sfrrl_jax.learner import TrainStep
from sfrrl_jax.learner.optimizer import OptState
from sfrrl_jax.trainer.batching import Group, RowShapes
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.early_samples import EarlySamples, GroupProgress
from sfrrl_jax.trainer.microsteps import MicroStepUnit, make_units
from sfrrl_jax.trainer.rollout_fn import RolloutFn, call_rollout
from sfrrl_jax.trainer.scheduling import LongestFirst
from sfrrl_jax.trainer.step_rules import FailedGroup, OneProcessRules, StepRules
from sfrrl_jax.trainer.timeline import Timeline, WaitingWork

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything one RL step reads, passed in explicitly (`RLTrainer.step_inputs` builds it).

    The run's services are shared with the step and advance through it: the engine (decodes, runs
    the idle micro-steps), the task stream (draws), `longest_first` (observes group durations) and
    the timeline (records spans). The state the step starts from is values: it never writes them
    back, it returns the next state in its `StepResult`.

    Attributes:
      cfg: the `TrainerConfig`.
      engine: the rollout engine (`Engine`, or a `LockstepEngine` on N processes).
      train_step: the `learner.TrainStep` (loss and optimizer).
      rollout_fn: the rollout function (`trainer.rollout_fn`).
      tasks: the task stream (`.next() -> Task`).
      longest_first: the launch-order model (`trainer.scheduling.LongestFirst`).
      timeline: the run's `trainer.timeline.Timeline`.
      params: the param pytree the step rolls out and trains on.
      opt_state: the optimizer state (`learner.OptState`).
      params_version: the number of updates applied to `params`.
      step_index: this step's index in the run.
      carry_over: `one_step_off`: the previous step's micro-steps, trained first.
      batch_fields: the fields of the step's micro-batches (`batching.batch_fields(loss)`).
      route_dims: (moe layers, top_k) under routing replay, else None.
      row_shapes: the packing menu (None: `batching.row_shapes(cfg)`).
      forward_only: zero-advantage micro-steps run forward only (`RLTrainer.zero_advantage_forward_only`).
    """

    cfg: TrainerConfig
    engine: Engine
    train_step: TrainStep
    rollout_fn: RolloutFn
    tasks: object   # `rl_trainer.TaskStream` (or anything with `.next() -> Task`)
    longest_first: LongestFirst
    timeline: Timeline
    params: Any
    opt_state: OptState
    params_version: int
    step_index: int
    carry_over: tuple = ()
    batch_fields: tuple[str, ...] | None = None
    route_dims: tuple[int, int] | None = None
    row_shapes: RowShapes | None = None
    forward_only: bool = False


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one RL step returns; the trainer applies it (`RLTrainer.apply_step_result`).

    Attributes:
      params: the params after the step's update (the inputs' params when nothing trained).
      opt_state: the optimizer state after it.
      params_version: the inputs' version, + 1 where the update was applied.
      step_index: the next step's index.
      carry_over: `one_step_off`: this step's micro-steps, for the next step (else empty).
      kept: the groups the step trained, in the order they were kept.
      metrics: the step's metrics (`time/`, `perf/`, `reward/`, `rollout/`, `train/` ...).
    """

    params: Any
    opt_state: OptState
    params_version: int
    step_index: int
    carry_over: tuple[MicroStepUnit, ...]
    kept: tuple[Group, ...]
    metrics: dict


class RLStep:
    """The schedule and state of one RL step (see the module doc): `await RLStep(inputs).run()`
    returns a `StepResult`; `rules` (default `OneProcessRules()`) is where N processes differ."""

    def __init__(self, inputs: StepInputs, rules: StepRules | None = None):
        """inputs: the step's explicit inputs (`StepInputs`). rules: a fresh `StepRules` for this step."""
        self.inputs, self.cfg, self.engine = inputs, inputs.cfg, inputs.engine
        self.rules = rules if rules is not None else OneProcessRules()
        self.train_step, self.timeline = inputs.train_step, inputs.timeline
        self.params, self.opt_state, self.params_version = inputs.params, inputs.opt_state, inputs.params_version
        cfg = self.cfg
        self.n_launch = cfg.groups_per_step + cfg.overprovision_groups
        self.early = (EarlySamples(cfg.early_groups, cfg.group_size, active=self.n_launch <= cfg.early_groups)
                      if cfg.early_groups else None)
        # zero-advantage trajectories train forward only (trainer.microsteps): where the switch is on,
        # the train step allows it, and on one process (every process must run the same micro-step)
        self.forward_only = inputs.forward_only
        # launch index -> progress of a finished group with early samples
        self.claimed: dict[int, GroupProgress] = {}
        self.ready: collections.deque[MicroStepUnit] = collections.deque()  # micro-steps the engine may run
        self.kept: list[Group] = []       # groups this step trains
        self.pending: list[Group] = []    # kept, not yet a micro-batch (fewer than groups_per_microbatch)
        self.units: list[MicroStepUnit] = []  # the micro-steps of this step's groups (one_step_off carries them)
        self.counts = collections.Counter()
        self.tool_queue_s: list[float] = []  # each remote tool call's wait for a free worker (Ray)
        self.failures: list[str] = []
        self.waiting = WaitingWork()
        self.in_flight: set[asyncio.Future] = set()
        self.draw_position: dict[int, int] = {}  # launch index -> position in draw order
        self.launched = 0
        self.refills = 0
        self.acc = None
        self.train_device_s = 0.0
        self.trained_during_rollout = 0.0
        self.trained = {"tokens": 0, "on_policy_tokens": 0, "microsteps": 0, "early_microsteps": 0,
                        "forward_only_microsteps": 0, "forward_only_tokens": 0, "positions": 0,
                        "padding_positions": 0}
        self.t_start = self.t_rollout = 0.0
        self.stats0 = None
        self.rules.bind(self)

    async def run(self) -> StepResult:
        """The whole step (module doc): begin, the rules' rollout and remaining training, finish."""
        self.begin()
        await self.rules.rollout(self)
        await self.rules.train_remaining(self)
        return self.finish()

    # -- phases -------------------------------------------------------------------------------
    def begin(self) -> None:
        """The engine gets the params; a fresh accumulator; `one_step_off`'s carried micro-steps queue first."""
        self.t_start = time.perf_counter()
        self.timeline.begin_step(self.inputs.step_index, self.t_start)
        self.stats0 = dataclasses.replace(self.engine.stats)
        self.engine.set_params(self.params)
        self.acc = jax.block_until_ready(self.train_step.init_accumulator(self.params))  # one in flight
        if self.cfg.mode == "one_step_off":
            self.ready.extend(self.inputs.carry_over)
        self.note_waiting()
        self.rules.begin(self)

    def finish(self) -> StepResult:
        """The optimizer update (if anything trained) and the step's metrics, as a `StepResult`."""
        metrics = {}
        if self.trained["microsteps"]:
            t0 = time.perf_counter()
            # params and opt_state are donated: from here on only the new ones exist
            self.params, self.opt_state, train_metrics = self.train_step.apply(self.params, self.opt_state, self.acc)
            self.params_version += 1
            train_metrics = jax.device_get(train_metrics)
            self.timeline.add("apply", "train", t0, time.perf_counter())
            self.train_device_s += time.perf_counter() - t0
            metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
        self.engine.set_params(self.params)
        wall = time.perf_counter() - self.t_start
        self.waiting.update(0, self.t_start + wall)
        idle = self.timeline.idle_split(self.t_start, self.t_start + wall, self.waiting.intervals)
        metrics.update(self.metrics(wall))
        metrics.update({"time/idle_s": idle["idle_s"], "time/idle_starved_s": idle["starved_s"],
                        "perf/busy_ceiling_on_policy": 1.0 - idle["starved_s"] / wall})
        self.timeline.end_step(time.perf_counter())
        return StepResult(params=self.params, opt_state=self.opt_state, params_version=self.params_version,
                          step_index=self.inputs.step_index + 1,
                          carry_over=tuple(self.units) if self.cfg.mode == "one_step_off" else (),
                          kept=tuple(self.kept), metrics=metrics)

    # -- groups ---------------------------------------------------------------------------------
    def launch(self, task: Task) -> asyncio.Future:
        self.launched += 1
        return asyncio.ensure_future(self.run_group(task, self.launched - 1))

    async def run_group(self, task: Task, index: int) -> Group | FailedGroup:
        # The samples of a group run to their end even if one raises: each releases its slot.
        trajs = await asyncio.gather(*(self.run_sample(task, index, i) for i in range(self.cfg.group_size)),
                                     return_exceptions=True)
        errors = [t for t in trajs if isinstance(t, BaseException)]
        for e in errors:
            if isinstance(e, EngineError) or not isinstance(e, Exception):
                raise e  # the engine is gone (or a cancellation): not this group's fault
        if errors:
            return FailedGroup(task.task_id, index, [f"{type(e).__name__}: {e}" for e in errors])
        return Group(task.task_id, list(trajs), self.inputs.params_version, index)

    async def run_sample(self, task: Task, index: int, sample: int) -> Trajectory:
        traj = await call_rollout(self.inputs.rollout_fn, self.engine, task, sample)
        self.rules.sample_finished(self, index, sample, traj)
        return traj

    def count_failed(self, group: FailedGroup) -> None:
        """Counts a group lost to its rollout function raising (the rules decide what follows)."""
        self.counts["groups_failed"] += 1
        self.counts["failed_samples"] += len(group.errors)
        self.failures.append(f"{group.group_id}: {group.errors[0]}")
        _log.warning("group %s dropped: its rollout raised %s", group.group_id, group.errors)

    def count_finished(self, group: Group) -> None:
        """Counts a finished group's failed samples and tool errors; its durations teach the launch order."""
        counts = self.counts
        counts["failed_samples"] += sum(t.error is not None for t in group.trajectories)
        self.inputs.longest_first.observe(group.group_id, group.trajectories)
        counts["tool_errors"] += sum(t.metadata.get("tool_errors", t.num_tool_errors) for t in group.trajectories)
        # tool calls that ignored cancellation and were left running at their timeout
        counts["orphaned_tool_calls"] += sum(t.metadata.get("orphaned_tool_calls", 0) for t in group.trajectories)
        self.tool_queue_s.extend(q for t in group.trajectories for q in t.metadata.get("tool_queue_s", ()))

    # -- training ---------------------------------------------------------------------------------
    def note_waiting(self) -> None:
        """Work this step could train on the current params right now: finished, untrained groups,
        and samples queued to train early."""
        mode = self.cfg.mode
        self.waiting.update(len(self.ready) + (len(self.pending) if mode == "pipelined" else 0)
                            + (len(self.kept) if mode == "sync" else 0)
                            + (len(self.early) if self.early is not None else 0))

    def microstep(self, unit: MicroStepUnit) -> None:
        """Blocking: one micro-step on the current params (runs on the driver thread): a gradient
        one, or forward only for a `forward_only` unit where this step allows it (module doc). The
        batch that runs is the rules' `global_batch` of the unit's rows."""
        batch = self.rules.global_batch(self, unit.batch)   # one process: the unit's own rows
        t0 = time.perf_counter()
        ts, params = self.train_step, self.params
        if unit.early is not None:  # into the group's buffer; its tokens count at the merge
            prog = unit.early.progress
            if prog.buffer is None:
                prog.buffer = ts.init_deferred(params)
            prog.buffer = ts.deferred_microstep(params, prog.buffer, batch, unit.early.centred_reward)
            jax.block_until_ready(prog.buffer.pg1)
            name = "grad_microstep_early"
            self.trained["early_microsteps"] += 1
        else:
            if unit.forward_only and self.forward_only:  # advantage 0 throughout: no gradient to add
                self.acc = ts.stats_microstep(params, self.acc, batch)
                name = "stats_microstep"
                self.trained["forward_only_microsteps"] += 1
            else:
                self.acc = ts.grad_microstep(params, self.acc, batch)
                name = "grad_microstep"
            for prog, slope, reference_advantage in unit.merges:
                self.acc = ts.merge_deferred(params, self.acc, prog.buffer, slope, reference_advantage)
                prog.buffer = None
            jax.block_until_ready(self.acc.scalars.numerator)
            for g in unit.groups:
                n = g.num_generated
                self.trained["tokens"] += n
                self.trained["on_policy_tokens"] += n if g.params_version == self.params_version else 0
        t1 = time.perf_counter()
        self.timeline.add(name, "train", t0, t1)
        self.train_device_s += t1 - t0
        self.trained["microsteps"] += 1
        positions, padding = self.rules.positions(self, unit.batch, batch)
        self.trained["positions"] += positions
        self.trained["padding_positions"] += padding
        if name == "stats_microstep":   # computed forward only: a third of a gradient step's FLOPs
            self.trained["forward_only_tokens"] += positions - padding

    def metrics(self, wall: float) -> dict:
        """The step's metrics over `wall` seconds, as the rules reduce them (N processes: summed)."""
        return self.rules.metrics(self, wall, self.own_metrics(wall))

    def own_metrics(self, wall: float) -> dict:
        """This process's metrics of the step."""
        s, s0, counts, groups = self.engine.stats, self.stats0, self.counts, self.kept
        decode_s = s.device_seconds - s0.device_seconds
        slot_total = s.slot_steps_total - s0.slot_steps_total
        rewards = np.concatenate([g.rewards for g in groups]) if groups else np.zeros(0)
        # reward/<name>: each reward function's mean over the kept trajectories that recorded it
        components = reward_component_means(t for g in groups for t in g.trajectories)
        generated = sum(g.num_generated for g in groups)
        trained, train_s = self.trained["tokens"], self.train_device_s
        compiles = sum(self.engine.steps.compile_counts().values())
        compiles += self.train_step.compile_count()
        return {
            **components,  # first: the trainer's own reward/mean and reward/success_rate win
            "step": self.inputs.step_index,
            "time/wall_s": wall,
            "time/rollout_s": self.t_rollout - self.t_start,
            "time/train_s": train_s,
            "time/train_exposed_s": train_s - self.trained_during_rollout,
            "time/hidden_train_share": self.trained_during_rollout / train_s if train_s else 0.0,
            "perf/device_busy": min((decode_s + train_s) / wall, 1.0),
            "perf/slot_occupancy": (s.slot_steps_active - s0.slot_steps_active) / slot_total if slot_total else 0.0,
            "perf/generated_tokens_per_s": generated / wall,
            "perf/trained_tokens_per_s": trained / wall,
            "perf/samples_per_s": sum(len(g.trajectories) for g in groups) / wall,
            "perf/compile_count": compiles,
            "policy/on_policy_fraction": self.trained["on_policy_tokens"] / trained if trained else 1.0,
            "reward/mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward/success_rate": float(np.mean(rewards >= 1.0)) if rewards.size else 0.0,
            "rollout/generated_tokens": generated,
            "rollout/tool_errors": counts["tool_errors"],
            "rollout/orphaned_tool_calls": counts["orphaned_tool_calls"],
            # remote tool calls' waits for a free Ray actor slot (never part of their timeout)
            **tool_queue_metrics(self.tool_queue_s),
            "rollout/groups_dropped": counts["groups_dropped"],
            "rollout/groups_surplus": counts["groups_surplus"],
            "rollout/groups_failed": counts["groups_failed"],
            "rollout/failed_samples": counts["failed_samples"],
            # groups trained, and those of them whose rewards were all equal (advantage 0 throughout)
            "rollout/kept_groups": len(groups),
            "rollout/zero_variance_groups": sum(int(np.ptp(g.rewards) == 0) for g in groups),
            "engine/faults": s.faults - s0.faults,
            "engine/restored_slots": s.restored_slots - s0.restored_slots,
            # tokens run through the model to fill caches (prompts, appends, restores), and the share
            # of cache-filling tokens served without compute (a group's shared prompt)
            "engine/prefill_tokens": s.prefill_tokens - s0.prefill_tokens,
            "engine/prefix_hit_rate": dataclasses.replace(
                s, prefill_tokens=s.prefill_tokens - s0.prefill_tokens,
                prefix_hit_tokens=s.prefix_hit_tokens - s0.prefix_hit_tokens).prefix_hit_rate,
            # swap_cache: the KV cache's trips to host memory around micro-steps, and their time
            "engine/cache_swaps": s.cache_swaps - s0.cache_swaps,
            "time/cache_swap_s": s.swap_seconds - s0.swap_seconds,
            "train/trained_tokens": trained,
            "train/microsteps": self.trained["microsteps"],
            # share of the micro-steps' [rows, width] positions that were padding (0 = perfect packing)
            "train/padding_share": (self.trained["padding_positions"] / self.trained["positions"]
                                    if self.trained["positions"] else 0.0),
            # the positions the micro-steps computed (rows x width, prompts and padding included):
            # what the train step's FLOPs scale with, where train/trained_tokens counts loss tokens
            "train/positions": self.trained["positions"],
            "train/early_microsteps": self.trained["early_microsteps"],
            # micro-steps of zero-advantage trajectories run forward only (skip_zero_advantage_backward)
            "train/forward_only_microsteps": self.trained["forward_only_microsteps"],
            # their non-padding positions (the rest of train/positions' non-padding ran forward and backward)
            "train/forward_only_tokens": self.trained["forward_only_tokens"],
        }

    # -- internals --------------------------------------------------------------------------------
    def make_units(self, groups: list[Group]) -> list[MicroStepUnit]:
        """The micro-steps of these finished groups of this step (`make_units` with the step's layout)."""
        i = self.inputs
        return make_units(groups, self.cfg, self.claimed, i.batch_fields, i.route_dims, i.row_shapes,
                          forward_only=self.forward_only)

    async def stop_in_flight(self) -> None:
        """Cancels every group still running and waits for them to release their slots."""
        for fut in self.in_flight:
            fut.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)


def tool_queue_metrics(queue_s: Sequence[float]) -> dict:
    """`tools/queue_s_p50`, `tools/queue_s_p99` (seconds; 0 when no call queued) and
    `tools/remote_calls` (how many) of the remote tool calls' waits for a free worker."""
    q = np.asarray(queue_s, dtype=np.float64)
    return {"tools/queue_s_p50": float(np.percentile(q, 50)) if q.size else 0.0,
            "tools/queue_s_p99": float(np.percentile(q, 99)) if q.size else 0.0,
            "tools/remote_calls": int(q.size)}
