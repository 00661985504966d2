"""The RL trainer: rollout and training on one mesh over the same params (DESIGN.md section 3).

One `step()`:
  1. launch `groups_per_step` groups (G samples of one prompt each) on the engine, longest
     expected first (`trainer.scheduling`); tool calls run on the event loop while other slots
     decode;
  2. as each group finishes, its advantages are final: it becomes a gradient micro-batch;
  3. `pipelined`: the engine runs those micro-steps whenever it would idle (every slot parked on a
     tool, or at most `underfull_slots` decoding), on the same params that generated them;
     `sync`: they run after the rollout; `one_step_off`: step k trains step k-1's groups;
  4. the KV cache is freed, the remaining micro-steps run, then exactly one optimizer update.
Gradient sums accumulate, so the update equals the full-batch one whatever ran when.
With `early_groups`, pipelined also trains finished samples of unfinished groups
(`trainer.early_samples`, `train.deferred`): a straggler then holds back only itself.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from typing import Awaitable, Callable, Sequence

import jax
import numpy as np

from sfrrl_jax.agents.protocols import EngineError, Task
from sfrrl_jax.aio import run_sync
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine import Engine
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.deferred import advantage_free_terms, check_deferrable
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.batching import (
    Group, TokenShare, group_advantage_slopes, group_advantages, microbatch_from_trajectories,
)
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.early_samples import EarlySamples, EarlyUnit
from sfrrl_jax.trainer.scheduling import LongestFirst
from sfrrl_jax.trainer.timeline import Timeline, WaitingWork

RolloutFn = Callable[[Engine, Task, int], Awaitable[Trajectory]]
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _FailedGroup:
    """A group some of whose samples' rollout function raised (not an `EngineError`)."""

    group_id: str
    launch_index: int
    errors: list[str]


@functools.lru_cache(maxsize=16)
def shared_train_step(model_cfg: ModelConfig, loss_cfg: LossConfig, optimizer_cfg: OptimizerConfig):
    """One TrainStep per configuration, so trainers built alike share compilations."""
    return make_train_step(model_cfg, loss_cfg, optimizer_cfg)


class TaskStream:
    """Endless, seeded, resumable stream of tasks: a fresh permutation each epoch."""

    def __init__(self, tasks: Sequence[Task], seed: int = 0, epoch: int = 0, index: int = 0):
        if not tasks:
            raise ValueError("TaskStream needs at least one task")
        self.tasks, self.seed, self.epoch, self.index = list(tasks), seed, epoch, index

    def _order(self):
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.tasks))

    def next(self) -> Task:
        if self.index >= len(self.tasks):
            self.epoch, self.index = self.epoch + 1, 0
        task = self.tasks[int(self._order()[self.index])]
        self.index += 1
        return task

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}


@dataclasses.dataclass
class MicroStepUnit:
    """One gradient micro-step: its batch and whose tokens it holds (Groups or TokenShares).

    early: set for a sample trained into its unfinished group's buffer; merges: (group progress,
    advantage slope, reference advantage) of group buffers to add at their final advantages.
    """

    groups: list
    batch: dict
    early: EarlyUnit | None = None
    merges: list = dataclasses.field(default_factory=list)


def check_memory_fits(engine_cache_bytes: int, params, device=None, param_copies: float = 3.0) -> None:
    """Up-front check that the KV cache fits next to the params (before any compile).

    param_copies: param-sized arrays alive beside the cache (params, gradient sums, optimizer
    moments; early-sample group buffers add more)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        limit = stats["bytes_limit"]
        n_dev = len(jax.devices())
    else:  # CPU: host memory, shared by every (fake) device
        import psutil
        limit, n_dev = psutil.virtual_memory().available, 1
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) / n_dev
    per_device_cache = engine_cache_bytes / (len(jax.devices()) if n_dev > 1 else 1)
    if per_device_cache + param_copies * param_bytes > limit:
        raise ValueError(
            f"KV cache of {engine_cache_bytes / 2**30:.2f} GiB (max_slots x max_len) plus params/optimizer "
            f"(~{param_copies * param_bytes / 2**30:.2f} GiB per device) exceed the {limit / 2**30:.2f} GiB "
            "available: lower TrainerConfig.max_slots or max_len (or early_groups)")


class RLTrainer:
    def __init__(self, model_cfg: ModelConfig, params, trainer_cfg: TrainerConfig, loss_cfg: LossConfig,
                 optimizer_cfg: OptimizerConfig, rollout_fn: RolloutFn, tasks: TaskStream,
                 expected_length: Callable[[Task], float] | None = None, opt_state=None):
        if trainer_cfg.max_len > model_cfg.max_seq_len:
            raise ValueError(f"TrainerConfig.max_len={trainer_cfg.max_len} > ModelConfig.max_seq_len="
                             f"{model_cfg.max_seq_len}")
        self.cfg, self.model_cfg, self.loss_cfg = trainer_cfg, model_cfg, loss_cfg
        self.rollout_fn, self.tasks = rollout_fn, tasks
        self.engine = Engine(model_cfg, params, max_slots=trainer_cfg.max_slots, max_len=trainer_cfg.max_len,
                             buckets=trainer_cfg.buckets, decode_steps=trainer_cfg.decode_steps)
        self.train_step = shared_train_step(model_cfg, loss_cfg, optimizer_cfg)
        copies = 3.0
        if trainer_cfg.early_groups:
            check_deferrable(loss_cfg)
            # float32 buffers per early group: h1, hc (+ k), relative to the params' own dtype
            per_group = 3 if advantage_free_terms(self.train_step) else 2
            itemsize = max(jax.tree.leaves(params)[0].dtype.itemsize, 1)
            copies += trainer_cfg.early_groups * per_group * 4 / itemsize
        check_memory_fits(self.engine.steps.cache_bytes(), params, param_copies=copies)
        self.params = params
        self.opt_state = opt_state if opt_state is not None else self.train_step.init_opt_state(params)
        self.params_version = 0
        self.step_index = 0
        # expected_length: optional prior `fn(task) -> tokens` for prompts not seen yet
        self.longest_first = LongestFirst(expected_tokens=expected_length)
        self.carry_over: list[MicroStepUnit] = []   # one_step_off: last step's groups
        self.timeline = Timeline()
        self.engine.trace = self.timeline

    # -- public -------------------------------------------------------------------------------
    def step(self) -> dict:
        """One RL step (rollout + one optimizer update); returns its metrics."""
        return run_sync(self.step_async())

    async def step_async(self) -> dict:
        cfg = self.cfg
        t_start = time.perf_counter()
        self.timeline.begin_step(self.step_index, t_start)
        stats0 = dataclasses.replace(self.engine.stats)
        self.engine.set_params(self.params)
        self._acc = jax.block_until_ready(self.train_step.init_accumulator(self.params))  # one in flight
        self._train_device_s = 0.0
        self._trained = {"tokens": 0, "on_policy_tokens": 0, "microsteps": 0, "early_microsteps": 0}
        n_launch = cfg.groups_per_step + cfg.overprovision_groups
        early = (EarlySamples(cfg.early_groups, cfg.group_size, active=n_launch <= cfg.early_groups)
                 if cfg.early_groups else None)
        self._claimed = {}  # launch index -> GroupProgress of a finished group with early samples
        ready: collections.deque[MicroStepUnit] = collections.deque(self.carry_over if cfg.mode == "one_step_off" else [])
        self.carry_over = []
        kept: list[Group] = []
        pending: list[Group] = []
        units: list[MicroStepUnit] = []
        counts = collections.Counter()
        failures: list[str] = []
        waiting = WaitingWork()

        def note_waiting():
            """Work this step could train on the current params right now: finished, untrained
            groups, and samples queued to train early."""
            waiting.update(len(ready) + (len(pending) if cfg.mode == "pipelined" else 0)
                           + (len(kept) if cfg.mode == "sync" else 0)
                           + (len(early) if early is not None else 0))

        def idle_work():
            if cfg.mode == "sync":
                return None
            if ready:
                unit = ready.popleft()
            elif early is not None and len(early):
                unit = self._early_unit(early.pop())
            else:
                return None
            note_waiting()
            return lambda: self._microstep(unit)

        note_waiting()

        self.engine.idle_work = idle_work
        self.engine.underfull_slots = cfg.underfull_slots

        launched = 0

        async def run_sample(task: Task, index: int, sample: int) -> Trajectory:
            traj = await self.rollout_fn(self.engine, task, sample)
            if early is not None and early.sample_finished(index, sample, traj):
                note_waiting()
                self.engine.notify_idle_work()
            return traj

        async def run_group(task: Task, index: int) -> Group | _FailedGroup:
            # The samples of a group run to their end even if one raises: each releases its slot.
            trajs = await asyncio.gather(*(run_sample(task, index, i) for i in range(cfg.group_size)),
                                         return_exceptions=True)
            errors = [t for t in trajs if isinstance(t, BaseException)]
            for e in errors:
                if isinstance(e, EngineError) or not isinstance(e, Exception):
                    raise e  # the engine is gone (or a cancellation): not this group's fault
            if errors:
                return _FailedGroup(task.task_id, index, [f"{type(e).__name__}: {e}" for e in errors])
            return Group(task.task_id, list(trajs), self.params_version, index)

        def launch(task):
            nonlocal launched
            launched += 1
            return asyncio.ensure_future(run_group(task, launched - 1))

        drawn = [self.tasks.next() for _ in range(n_launch)]
        order = self.longest_first.order(drawn) if cfg.longest_first else range(n_launch)
        # sync trains in draw order: the launch order follows measured durations, draws do not
        draw_position = {launch_index: i for launch_index, i in enumerate(order)}
        in_flight = {launch(drawn[i]) for i in order}
        refills = 0
        try:
            while in_flight and len(kept) < cfg.groups_per_step:
                done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    group = fut.result()
                    if isinstance(group, _FailedGroup):
                        # A rollout function raised for some sample: that group is lost, not the step.
                        # Another prompt takes its place; a function that keeps failing stops the run.
                        counts["groups_failed"] += 1
                        counts["failed_samples"] += len(group.errors)
                        failures.append(f"{group.group_id}: {group.errors[0]}")
                        _log.warning("group %s dropped: its rollout raised %s", group.group_id, group.errors)
                        if early is not None:
                            early.discard(group.launch_index)
                        if counts["groups_failed"] > cfg.groups_per_step:
                            raise RuntimeError(
                                f"the rollout function raised in {counts['groups_failed']} groups this step "
                                f"(more than groups_per_step={cfg.groups_per_step}); first errors: {failures[:3]}")
                        draw_position[launched] = n_launch + refills + counts["groups_failed"] - 1
                        in_flight.add(launch(self.tasks.next()))  # (extra draws numbered in draw order)
                        continue
                    counts["failed_samples"] += sum(t.error is not None for t in group.trajectories)
                    self.longest_first.observe(group.group_id, group.trajectories)
                    counts["tool_errors"] += sum(t.metadata.get("tool_errors", t.num_tool_errors)
                                                 for t in group.trajectories)
                    if cfg.dynamic_sampling and np.ptp(group.rewards) == 0:
                        counts["groups_dropped"] += 1
                        if early is not None:
                            early.discard(group.launch_index)
                        if refills < cfg.max_refill_groups:
                            refills += 1
                            draw_position[launched] = n_launch + refills + counts["groups_failed"] - 1
                            in_flight.add(launch(self.tasks.next()))
                        continue
                    if len(kept) == cfg.groups_per_step:
                        counts["groups_surplus"] += 1
                        if early is not None:
                            early.discard(group.launch_index)
                        continue
                    kept.append(group)
                    if early is not None:
                        progress = early.group_complete(group.launch_index)
                        if progress is not None:
                            self._claimed[group.launch_index] = progress
                        if len(early):  # its freed buffer went to samples of other groups
                            self.engine.notify_idle_work()
                    if cfg.mode == "sync":
                        note_waiting()
                        continue  # micro-batches are formed after the rollout, in launch order
                    pending.append(group)
                    if len(pending) == cfg.groups_per_microbatch:
                        new_units = self._make_units(pending)
                        pending = []
                        units.extend(new_units)
                        if cfg.mode == "pipelined":
                            ready.extend(new_units)
                            self.engine.notify_idle_work()
                    note_waiting()
                if early is not None and len(in_flight) <= cfg.early_groups and early.activate():
                    note_waiting()  # the tail: finished samples of the last groups may train now
                    self.engine.notify_idle_work()
        except BaseException:
            # The step fails (an EngineError, a rollout function that keeps raising): stop every
            # group still running, so their slots are released before the error leaves the step.
            for fut in in_flight:
                fut.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            self.engine.idle_work = None
            raise
        for fut in in_flight:  # over-provisioned groups not needed: stop them
            fut.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
        if early is not None:
            early.clear()  # samples of cancelled groups
        if len(kept) < cfg.groups_per_step:
            raise RuntimeError(f"only {len(kept)} of {cfg.groups_per_step} groups survived dynamic sampling "
                               f"after {refills} refills; raise TrainerConfig.max_refill_groups")
        if pending:
            new_units = self._make_units(pending)
            units.extend(new_units)
            if cfg.mode == "pipelined":
                ready.extend(new_units)
        self.engine.idle_work = None
        await self.engine.wait_idle()  # a micro-step may still be running on the driver thread
        t_rollout = time.perf_counter()
        self.engine.release_memory()  # the cache goes before the update needs the memory
        trained_during_rollout = self._train_device_s
        if cfg.mode == "sync":
            # Draw order, not finish order: the gradient sum is then bitwise repeatable.
            ordered = sorted(kept, key=lambda g: draw_position[g.launch_index])
            gpm = cfg.groups_per_microbatch
            units = [u for i in range(0, len(ordered), gpm) for u in self._make_units(ordered[i:i + gpm])]
            ready.extend(units)
        while ready:
            self._microstep(ready.popleft())
        metrics = {}
        if self._trained["microsteps"]:
            t0 = time.perf_counter()
            self.params, self.opt_state, train_metrics = self.train_step.apply(self.params, self.opt_state, self._acc)
            train_metrics = jax.device_get(train_metrics)
            self.timeline.add("apply", "train", t0, time.perf_counter())
            self._train_device_s += time.perf_counter() - t0
            self.params_version += 1
            metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
        if cfg.mode == "one_step_off":
            self.carry_over = units
        self.engine.set_params(self.params)
        wall = time.perf_counter() - t_start
        waiting.update(0, t_start + wall)
        idle = self.timeline.idle_split(t_start, t_start + wall, waiting.intervals)
        metrics.update(self._step_metrics(kept, stats0, wall, t_rollout - t_start,
                                          trained_during_rollout, counts))
        metrics.update({"time/idle_s": idle["idle_s"], "time/idle_starved_s": idle["starved_s"],
                        "perf/busy_ceiling_on_policy": 1.0 - idle["starved_s"] / wall})
        self.timeline.end_step(time.perf_counter())
        self.step_index += 1
        return metrics

    def compile_train_shapes(self) -> int:
        """Compiles the gradient micro-steps for every [rows, width] a step can form (and the
        early-sample functions), on zero batches, so that no compile stalls a rollout later.
        Returns the number of shapes. Widths: multiples of `seq_bucket` capped at `max_len`;
        rows: up to `microbatch_rows` (else a whole micro-batch of groups; fewer with early samples).
        """
        cfg = self.cfg
        widths = sorted({min(k * cfg.seq_bucket, cfg.max_len) for k in range(1, -(-cfg.max_len // cfg.seq_bucket) + 1)})
        full = cfg.groups_per_microbatch * cfg.group_size
        most = min(cfg.microbatch_rows, full) if cfg.microbatch_rows else full
        rows = range(1, most + 1) if (cfg.early_groups or cfg.microbatch_rows) else [full]
        ts, acc = self.train_step, self.train_step.init_accumulator(self.params)
        shapes = 0
        for width in widths:
            zero = lambda n: {"tokens": np.zeros((n, width), np.int32), "loss_mask": np.zeros((n, width), np.float32),
                              "advantages": np.zeros((n, width), np.float32),
                              "rollout_logprobs": np.zeros((n, width), np.float32),
                              "segment_ids": np.zeros((n, width), np.int32)}
            for n in rows:
                acc = jax.block_until_ready(ts.grad_microstep(self.params, acc, zero(n)))  # one in flight
                shapes += 1
            if cfg.early_groups:
                buf = ts.deferred_microstep(self.params, ts.init_deferred(self.params), zero(1), 0.0)
                acc = jax.block_until_ready(ts.merge_deferred(self.params, acc, buf, 1.0, 0.0))
        return shapes

    # -- internals ----------------------------------------------------------------------------
    def _make_units(self, groups: list[Group]) -> list[MicroStepUnit]:
        """Micro-steps of these finished groups. Samples already in a group buffer (trained early)
        are left out; the last micro-step merges those buffers at the final advantages."""
        adv = group_advantages(groups, self.cfg.advantage)
        progress = [self._claimed.pop(g.launch_index, None) for g in groups]
        slopes = group_advantage_slopes(groups, self.cfg.advantage) if any(progress) else [None] * len(groups)
        owners, row_adv, merges, merged = [], [], [], []
        for g, a, prog, slope in zip(groups, adv, progress, slopes):
            claimed = set(prog.claimed) if prog else set()
            for i in range(len(g.trajectories)):
                if i in claimed:
                    merged.append((g, i))
                else:
                    owners.append((g, i))
                    row_adv.append(a[i])
            if prog:
                merges.append((prog, float(slope), float(a[prog.reference])))
        batch = microbatch_from_trajectories([g.trajectories[i] for g, i in owners], row_adv,
                                             self.cfg.seq_bucket, self.cfg.max_len)
        units = self._split(batch, owners, whole=None if merged else list(groups))
        units[-1].merges = merges
        units[-1].groups += [self._share(g, i) for g, i in merged]
        return units

    def _split(self, batch: dict, owners: list, whole: list | None = None) -> list[MicroStepUnit]:
        """Micro-steps of at most `microbatch_rows` rows; owners: (group, sample) per row."""
        rows, step = len(owners), self.cfg.microbatch_rows
        if not step or rows <= step:
            return [MicroStepUnit(whole if whole is not None else [self._share(g, i) for g, i in owners], batch)]
        return [MicroStepUnit([self._share(g, i) for g, i in owners[a:a + step]],
                      {k: v[a:a + step] for k, v in batch.items()}) for a in range(0, rows, step)]

    @staticmethod
    def _share(group: Group, sample: int) -> TokenShare:
        return TokenShare(group.group_id, group.params_version,
                          int(np.sum(group.trajectories[sample].loss_mask)))

    def _early_unit(self, unit: EarlyUnit) -> MicroStepUnit:
        traj = unit.progress.finished[unit.sample]
        batch = microbatch_from_trajectories([traj], [0.0], self.cfg.seq_bucket, self.cfg.max_len)
        return MicroStepUnit([], batch, early=unit)

    def _microstep(self, unit: MicroStepUnit) -> None:
        """Blocking: one gradient micro-step on the current params (runs on the driver thread)."""
        t0 = time.perf_counter()
        ts = self.train_step
        if unit.early is not None:  # into the group's buffer; its tokens count at the merge
            prog = unit.early.progress
            if prog.buffer is None:
                prog.buffer = ts.init_deferred(self.params)
            prog.buffer = ts.deferred_microstep(self.params, prog.buffer, unit.batch, unit.early.centred_reward)
            jax.block_until_ready(prog.buffer["pg1"])
            name = "grad_microstep_early"
            self._trained["early_microsteps"] += 1
        else:
            self._acc = ts.grad_microstep(self.params, self._acc, unit.batch)
            for prog, slope, reference_advantage in unit.merges:
                self._acc = ts.merge_deferred(self.params, self._acc, prog.buffer, slope, reference_advantage)
                prog.buffer = None
            jax.block_until_ready(self._acc["scalars"]["numerator"])
            name = "grad_microstep"
            for g in unit.groups:
                n = g.num_generated
                self._trained["tokens"] += n
                self._trained["on_policy_tokens"] += n if g.params_version == self.params_version else 0
        t1 = time.perf_counter()
        self.timeline.add(name, "train", t0, t1)
        self._train_device_s += t1 - t0
        self._trained["microsteps"] += 1

    def _step_metrics(self, groups, stats0, wall, rollout_s, trained_during_rollout, counts) -> dict:
        s = self.engine.stats
        decode_s = s.device_seconds - stats0.device_seconds
        slot_total = s.slot_steps_total - stats0.slot_steps_total
        rewards = np.concatenate([g.rewards for g in groups]) if groups else np.zeros(0)
        generated = sum(g.num_generated for g in groups)
        trained = self._trained["tokens"]
        compiles = sum(self.engine.steps.compile_counts().values())
        compiles += self.train_step.compile_count()
        return {
            "step": self.step_index,
            "time/wall_s": wall,
            "time/rollout_s": rollout_s,
            "time/train_s": self._train_device_s,
            "time/train_exposed_s": self._train_device_s - trained_during_rollout,
            "time/hidden_train_share": trained_during_rollout / self._train_device_s if self._train_device_s else 0.0,
            "perf/device_busy": min((decode_s + self._train_device_s) / wall, 1.0),
            "perf/slot_occupancy": (s.slot_steps_active - stats0.slot_steps_active) / slot_total if slot_total else 0.0,
            "perf/generated_tokens_per_s": generated / wall,
            "perf/trained_tokens_per_s": trained / wall,
            "perf/samples_per_s": sum(len(g.trajectories) for g in groups) / wall,
            "perf/compile_count": compiles,
            "policy/on_policy_fraction": self._trained["on_policy_tokens"] / trained if trained else 1.0,
            "reward/mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward/success_rate": float(np.mean(rewards >= 1.0)) if rewards.size else 0.0,
            "rollout/generated_tokens": generated,
            "rollout/tool_errors": counts["tool_errors"],
            "rollout/groups_dropped": counts["groups_dropped"],
            "rollout/groups_surplus": counts["groups_surplus"],
            "rollout/groups_failed": counts["groups_failed"],
            "rollout/failed_samples": counts["failed_samples"],
            "engine/faults": s.faults - stats0.faults,
            "engine/restored_slots": s.restored_slots - stats0.restored_slots,
            "train/trained_tokens": trained,
            "train/microsteps": self._trained["microsteps"],
            "train/early_microsteps": self._trained["early_microsteps"],
        }
