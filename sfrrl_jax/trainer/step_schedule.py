"""One RL step's schedule, as an object: `RLStep(trainer).run()` (DESIGN.md section 3).

`RLTrainer.step_async` builds one `RLStep` per step; the step holds everything that lives for one
step (the gradient accumulator, the groups in flight and kept, the micro-steps ready to run, the
counters) as attributes, and its methods are the phases, in the order `run` calls them:

  begin            the engine gets the current params, a fresh accumulator, the idle-work hook
  launch_groups    draw `groups_per_step + overprovision_groups` prompts, launch them longest first
  collect_groups   as groups finish: drop / refill / keep them; kept groups become micro-steps
                   (`pipelined`: queued for the engine's idle time; `sync`: held for after the
                   rollout); the rollout's tail activates early samples
  cancel_leftovers on failure: stop every group still running so their slots are released
                   (on any failure of the rollout the engine's idle-work hook is removed)
  end_rollout      stop surplus groups, form the last micro-steps, wait for the driver's last
                   micro-step, free the KV cache
  train_remaining  the micro-steps the rollout did not hide (all of them in `sync`, in draw order)
  finish           the one optimizer update; the step's metrics

The engine pops work through `idle_work` (micro-steps of finished groups first, then early
samples) and runs it on its driver thread with `microstep`. Everything else runs on the event loop.

Micro-steps (`make_units`, pure host work): a micro-batch of finished groups is laid out in rows
(`TrainerConfig.pack_rows`: several trajectories per row, `trainer.batching.pack_rows`; else one
per row), then split into micro-steps of at most `microbatch_rows` rows. A `MicroStepUnit` names
whose tokens it holds: whole `Group`s when it holds all of theirs, else one `TokenShare` per
trajectory in its rows (a packed row may hold samples of several groups), so the trained and
on-policy token counts are exact whatever the layout. Early samples train as one-row micro-steps.
`train/padding_share` is the share of the micro-steps' [rows, width] positions that held no token.

Forward-only micro-steps (`TrainerConfig.skip_zero_advantage_backward`, where the train step's
loss allows it: `TrainStep.forward_only_refusal`): trajectories whose advantage is exactly 0 add
exactly nothing to the gradient, so `make_units` packs them apart (the same packing, the same
`microbatch_rows` split) into micro-steps marked `forward_only`, which run
`TrainStep.stats_microstep` (their loss, counts and metrics accumulate; no backward). They count
in the trained tokens, positions and padding like any micro-step, and in
`train/forward_only_microsteps`. Early samples and the micro-step that merges their buffers stay
gradient micro-steps; a multi-process step (`trainer.process_step`) runs none.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from typing import Callable, Sequence

import jax
import numpy as np

from sfrrl_jax.agents.protocols import EngineError, Task
from sfrrl_jax.agents.tasks.reward_fns import reward_component_means
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.trainer.batching import (
    Group, RowLayout, RowShapes, TokenShare, group_advantage_slopes, group_advantages, microbatch_from_layout,
    microbatch_from_trajectories, pack_rows, row_shapes,
)
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rollout_fn import call_rollout
from sfrrl_jax.trainer.early_samples import EarlySamples, EarlyUnit, GroupProgress
from sfrrl_jax.trainer.timeline import WaitingWork

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class FailedGroup:
    """A group some of whose samples' rollout function raised (not an `EngineError`)."""

    group_id: str
    launch_index: int
    errors: list[str]


@dataclasses.dataclass
class MicroStepUnit:
    """One gradient micro-step: its batch and whose tokens it holds (Groups or TokenShares).

    early: set for a sample trained into its unfinished group's buffer; merges: (group progress,
    advantage slope, reference advantage) of group buffers to add at their final advantages.
    forward_only: every row's advantage is exactly 0, so the step may run it forward only
    (`TrainStep.stats_microstep`; module doc). Never set with `early` or `merges`.
    """

    groups: list
    batch: dict
    early: EarlyUnit | None = None
    merges: list = dataclasses.field(default_factory=list)
    forward_only: bool = False


# -- forming micro-steps (pure: host arrays only) ------------------------------------------------
def make_units(groups: list[Group], cfg: TrainerConfig, claimed: dict[int, GroupProgress],
               fields: Sequence[str] | None = None, route_dims: tuple[int, int] | None = None,
               shapes: RowShapes | None = None, forward_only: bool = False) -> list[MicroStepUnit]:
    """Micro-steps of these finished groups (module doc). Samples already in a group buffer
    (trained early) are left out; the last micro-step merges those buffers at the final advantages.
    claimed: launch index -> progress of groups with early samples (their entries are popped).
    fields: the batch fields (`batching.batch_fields(loss)`; None: all a trajectory supplies);
    route_dims: (moe layers, top_k) under routing replay; shapes: the packing menu (None:
    `batching.row_shapes(cfg)`; the trainer passes its mesh's row multiple).
    forward_only: pack the trajectories whose advantage is exactly 0 apart, into micro-steps marked
    `forward_only` that come first (the caller has checked that its train step allows it:
    `RLStep.forward_only`); the rest, and the merges, follow in gradient micro-steps."""
    adv = group_advantages(groups, cfg.advantage)
    progress = [claimed.pop(g.launch_index, None) for g in groups]
    slopes = group_advantage_slopes(groups, cfg.advantage) if any(progress) else [None] * len(groups)
    owners, row_adv, merges, merged = [], [], [], []
    for g, a, prog, slope in zip(groups, adv, progress, slopes):
        done_early = set(prog.claimed) if prog else set()
        for i in range(len(g.trajectories)):
            if i in done_early:
                merged.append((g, i))
            else:
                owners.append((g, i))
                row_adv.append(a[i])
        if prog:
            merges.append((prog, float(slope), float(a[prog.reference])))
    pack = functools.partial(_packed_units, cfg=cfg, fields=fields, route_dims=route_dims, shapes=shapes)
    zero = [k for k, a in enumerate(row_adv) if a == 0.0] if forward_only else []
    if not zero:
        units = pack(owners, row_adv, whole=None if merged else list(groups))
    else:
        rest = [k for k, a in enumerate(row_adv) if a != 0.0]
        units = pack([owners[k] for k in zero], [row_adv[k] for k in zero],
                     whole=None if merged or rest else list(groups))
        for u in units:
            u.forward_only = True
        if rest:
            units += pack([owners[k] for k in rest], [row_adv[k] for k in rest], whole=None)
    if merges:
        units[-1].forward_only = False  # the merges' micro-step stays a gradient one
    units[-1].merges = merges
    units[-1].groups += [token_share(g, i) for g, i in merged]
    return units


def _packed_units(owners: list, row_adv: list, whole: list | None, cfg: TrainerConfig, fields, route_dims,
                  shapes: RowShapes | None) -> list[MicroStepUnit]:
    """The micro-steps of these trajectories ((group, sample) each, with its advantage): laid out in
    rows (packed or one per row, per `cfg`), split by `microbatch_rows` (`split_rows`)."""
    trajs = [g.trajectories[i] for g, i in owners]
    lengths = [len(t.tokens) for t in trajs]
    layout = (pack_rows(lengths, shapes if shapes is not None else row_shapes(cfg)) if cfg.pack_rows
              else RowLayout.one_per_row(lengths, cfg.seq_bucket, cfg.max_len))
    batch = microbatch_from_layout(trajs, row_adv, layout, fields, route_dims)
    row_owners = [[owners[i] for i in row] for row in layout.rows]
    return split_rows(batch, row_owners, cfg.microbatch_rows, whole=whole)


def split_rows(batch: dict, row_owners: list[list], microbatch_rows: int,
               whole: list | None = None) -> list[MicroStepUnit]:
    """Micro-steps of at most `microbatch_rows` rows of `batch` (0: no limit). row_owners: per row,
    the (group, sample) of each trajectory in it (none for an all-padding row). whole: the Groups
    a single micro-step holds entirely (else its trajectories count as `TokenShare`s)."""
    rows, step = len(row_owners), microbatch_rows
    shares = lambda part: [token_share(g, i) for row in part for g, i in row]  # noqa: E731
    if not step or rows <= step:
        return [MicroStepUnit(whole if whole is not None else shares(row_owners), batch)]
    return [MicroStepUnit(shares(row_owners[a:a + step]), {k: v[a:a + step] for k, v in batch.items()})
            for a in range(0, rows, step)]


def token_share(group: Group, sample: int) -> TokenShare:
    return TokenShare(group.group_id, group.params_version, int(np.sum(group.trajectories[sample].loss_mask)))


def early_micro_step(unit: EarlyUnit, cfg: TrainerConfig, fields: Sequence[str] | None = None,
                     route_dims: tuple[int, int] | None = None) -> MicroStepUnit:
    """The one-row micro-step of an early sample (advantage 1: its buffer is merged at the end)."""
    traj = unit.progress.finished[unit.sample]
    batch = microbatch_from_trajectories([traj], [0.0], cfg.seq_bucket, cfg.max_len, fields, route_dims)
    return MicroStepUnit([], batch, early=unit)


class RLStep:
    """The schedule and state of one RL step of `trainer` (see the module doc)."""

    def __init__(self, trainer):
        """trainer: the `RLTrainer` (not imported here: it imports this module). The step reads its
        configs, engine, train step, rollout fn, task stream and timeline, and updates its params,
        opt_state, params_version, step_index and carry_over."""
        self.trainer, self.cfg, self.engine = trainer, trainer.cfg, trainer.engine
        cfg = self.cfg
        self.n_launch = cfg.groups_per_step + cfg.overprovision_groups
        self.early = (EarlySamples(cfg.early_groups, cfg.group_size, active=self.n_launch <= cfg.early_groups)
                      if cfg.early_groups else None)
        # zero-advantage trajectories train forward only (module doc): where the switch is on, the
        # train step allows it, and on one process (every process must run the same micro-step)
        self.forward_only = trainer.zero_advantage_forward_only
        # launch index -> progress of a finished group with early samples
        self.claimed: dict[int, GroupProgress] = {}
        self.ready: collections.deque[MicroStepUnit] = collections.deque()  # micro-steps the engine may run
        self.kept: list[Group] = []       # groups this step trains
        self.pending: list[Group] = []    # kept, not yet a micro-batch (fewer than groups_per_microbatch)
        self.units: list[MicroStepUnit] = []  # the micro-steps of this step's groups (one_step_off carries them)
        self.counts = collections.Counter()
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
                        "forward_only_microsteps": 0, "positions": 0, "padding_positions": 0}
        self.t_start = self.t_rollout = 0.0
        self.stats0 = None

    async def run(self) -> dict:
        self.begin()
        try:
            self.launch_groups()
            try:
                await self.collect_groups()
            except BaseException:
                await self.cancel_leftovers()
                await self.free_cache_after_failure()
                raise
            try:
                await self.end_rollout()
            except BaseException:
                await self.free_cache_after_failure()
                raise
        finally:
            # Whatever ends the rollout (an error included: too few groups survived dynamic
            # sampling, an EngineError), the engine must not keep calling into this step.
            self.engine.set_idle_work(None)
        self.train_remaining()
        return self.finish()

    # -- phases -------------------------------------------------------------------------------
    def begin(self) -> None:
        tr, cfg = self.trainer, self.cfg
        self.t_start = time.perf_counter()
        tr.timeline.begin_step(tr.step_index, self.t_start)
        self.stats0 = dataclasses.replace(self.engine.stats)
        self.engine.set_params(tr.params)
        self.acc = jax.block_until_ready(tr.train_step.init_accumulator(tr.params))  # one in flight
        if cfg.mode == "one_step_off":
            self.ready.extend(tr.carry_over)
        tr.carry_over = []
        self.note_waiting()
        self.install_idle_work()

    def install_idle_work(self) -> None:
        """Gives the engine this step's idle-work hook."""
        self.engine.set_idle_work(self.idle_work, underfull_slots=self.cfg.underfull_slots)

    def launch_groups(self) -> None:
        """Draws the step's prompts and launches their groups, longest expected first."""
        tr, n = self.trainer, self.n_launch
        drawn = [tr.tasks.next() for _ in range(n)]
        order = tr.longest_first.order(drawn) if self.cfg.longest_first else range(n)
        # sync trains in draw order: the launch order follows measured durations, draws do not
        self.draw_position = {launch_index: i for launch_index, i in enumerate(order)}
        self.in_flight = {self.launch(drawn[i]) for i in order}

    async def collect_groups(self) -> None:
        """Until `groups_per_step` groups are kept (or none is left running)."""
        cfg, early = self.cfg, self.early
        while self.in_flight and len(self.kept) < cfg.groups_per_step:
            done, self.in_flight = await asyncio.wait(self.in_flight, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                self.on_group_done(fut.result())
            if early is not None and len(self.in_flight) <= cfg.early_groups and early.activate():
                self.note_waiting()  # the tail: finished samples of the last groups may train now
                self.engine.notify_idle_work()

    async def cancel_leftovers(self) -> None:
        """The step fails (an EngineError, a rollout function that keeps raising): stop every group
        still running, so their slots are released before the error leaves the step."""
        await self._stop_in_flight()
        self.engine.set_idle_work(None)

    async def free_cache_after_failure(self) -> None:
        """A failed step frees the KV cache as a finished rollout does, so whatever the caller does
        next (evaluate, save, retry the step) has the memory. Only when no request is left: a
        slot still held means the failure is the engine's own, and its recovery owns the state."""
        self.engine.set_idle_work(None)
        await self.engine.wait_idle()
        occ = self.engine.occupancy
        if not (occ["running"] or occ["parked"] or occ["queued"]):
            self.engine.release_memory()

    async def end_rollout(self) -> None:
        cfg = self.cfg
        await self._stop_in_flight()  # over-provisioned groups not needed
        if self.early is not None:
            self.early.clear()  # samples of cancelled groups
        if len(self.kept) < cfg.groups_per_step:
            raise RuntimeError(f"only {len(self.kept)} of {cfg.groups_per_step} groups survived dynamic sampling "
                               f"after {self.refills} refills; raise TrainerConfig.max_refill_groups")
        if self.pending:
            self._form_units(self.pending)
            self.pending = []
        self.engine.set_idle_work(None)
        await self.engine.wait_idle()  # a micro-step may still be running on the driver thread
        self.t_rollout = time.perf_counter()
        self.engine.release_memory()  # the cache goes before the update needs the memory
        self.trained_during_rollout = self.train_device_s

    def train_remaining(self) -> None:
        cfg = self.cfg
        if cfg.mode == "sync":
            # Draw order, not finish order: the gradient sum is then bitwise repeatable.
            ordered = sorted(self.kept, key=lambda g: self.draw_position[g.launch_index])
            gpm = cfg.groups_per_microbatch
            self.units = [u for i in range(0, len(ordered), gpm)
                          for u in self.trainer._make_units(ordered[i:i + gpm])]
            self.ready.extend(self.units)
        while self.ready:
            self.microstep(self.ready.popleft())

    def finish(self) -> dict:
        """The optimizer update (if anything trained) and the step's metrics."""
        tr = self.trainer
        metrics = {}
        if self.trained["microsteps"]:
            t0 = time.perf_counter()
            tr.params, tr.opt_state, train_metrics = tr.train_step.apply(tr.params, tr.opt_state, self.acc)
            train_metrics = jax.device_get(train_metrics)
            tr.timeline.add("apply", "train", t0, time.perf_counter())
            self.train_device_s += time.perf_counter() - t0
            tr.params_version += 1
            metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
        if self.cfg.mode == "one_step_off":
            tr.carry_over = self.units
        self.engine.set_params(tr.params)
        wall = time.perf_counter() - self.t_start
        self.waiting.update(0, self.t_start + wall)
        idle = tr.timeline.idle_split(self.t_start, self.t_start + wall, self.waiting.intervals)
        metrics.update(self.metrics(wall))
        metrics.update({"time/idle_s": idle["idle_s"], "time/idle_starved_s": idle["starved_s"],
                        "perf/busy_ceiling_on_policy": 1.0 - idle["starved_s"] / wall})
        tr.timeline.end_step(time.perf_counter())
        tr.step_index += 1
        return metrics

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
        return Group(task.task_id, list(trajs), self.trainer.params_version, index)

    async def run_sample(self, task: Task, index: int, sample: int) -> Trajectory:
        traj = await call_rollout(self.trainer.rollout_fn, self.engine, task, sample)
        if self.early is not None and self.early.sample_finished(index, sample, traj):
            self.note_waiting()
            self.engine.notify_idle_work()
        return traj

    def on_group_done(self, group: Group | FailedGroup) -> None:
        """A group finished: lost (refilled), dropped by dynamic sampling (refilled while refills
        last), surplus, or kept; a kept one becomes micro-steps once `groups_per_microbatch` are in."""
        cfg, early, counts = self.cfg, self.early, self.counts
        if isinstance(group, FailedGroup):
            # A rollout function raised for some sample: that group is lost, not the step.
            # Another prompt takes its place; a function that keeps failing stops the run.
            counts["groups_failed"] += 1
            counts["failed_samples"] += len(group.errors)
            self.failures.append(f"{group.group_id}: {group.errors[0]}")
            _log.warning("group %s dropped: its rollout raised %s", group.group_id, group.errors)
            if early is not None:
                early.discard(group.launch_index)
            if counts["groups_failed"] > cfg.failed_groups_limit:
                raise RuntimeError(
                    f"the rollout function raised in {counts['groups_failed']} groups this step (more than the "
                    f"{cfg.failed_groups_limit} it launches: groups_per_step + overprovision_groups); first "
                    f"errors: {self.failures[:3]}")
            self.refill()
            return
        counts["failed_samples"] += sum(t.error is not None for t in group.trajectories)
        self.trainer.longest_first.observe(group.group_id, group.trajectories)
        counts["tool_errors"] += sum(t.metadata.get("tool_errors", t.num_tool_errors) for t in group.trajectories)
        # tool calls that ignored cancellation and were left running at their timeout
        counts["orphaned_tool_calls"] += sum(t.metadata.get("orphaned_tool_calls", 0) for t in group.trajectories)
        if cfg.dynamic_sampling and np.ptp(group.rewards) == 0:
            counts["groups_dropped"] += 1
            if early is not None:
                early.discard(group.launch_index)
            if self.refills < cfg.max_refill_groups:
                self.refills += 1
                self.refill()
            return
        if len(self.kept) == cfg.groups_per_step:
            counts["groups_surplus"] += 1
            if early is not None:
                early.discard(group.launch_index)
            return
        self.kept.append(group)
        if early is not None:
            progress = early.group_complete(group.launch_index)
            if progress is not None:
                self.claimed[group.launch_index] = progress
            if len(early):  # its freed buffer went to samples of other groups
                self.engine.notify_idle_work()
        if cfg.mode == "sync":
            self.note_waiting()
            return  # micro-batches are formed after the rollout, in launch order
        self.pending.append(group)
        if len(self.pending) == cfg.groups_per_microbatch:
            self._form_units(self.pending)
            self.pending = []
            if cfg.mode == "pipelined":
                self.engine.notify_idle_work()
        self.note_waiting()

    def refill(self) -> None:
        """Launches one more prompt in place of a lost or dropped group (numbered in draw order)."""
        self.draw_position[self.launched] = self.n_launch + self.refills + self.counts["groups_failed"] - 1
        self.in_flight.add(self.launch(self.trainer.tasks.next()))

    # -- training ---------------------------------------------------------------------------------
    def note_waiting(self) -> None:
        """Work this step could train on the current params right now: finished, untrained groups,
        and samples queued to train early."""
        mode = self.cfg.mode
        self.waiting.update(len(self.ready) + (len(self.pending) if mode == "pipelined" else 0)
                            + (len(self.kept) if mode == "sync" else 0)
                            + (len(self.early) if self.early is not None else 0))

    def idle_work(self) -> Callable[[], None] | None:
        """The engine's idle hook: the next micro-step to run on its driver thread, or None."""
        if self.cfg.mode == "sync":
            return None
        if self.ready:
            unit = self.ready.popleft()
        elif self.early is not None and len(self.early):
            unit = early_micro_step(self.early.pop(), self.cfg, self.trainer.batch_fields, self.trainer.route_dims)
        else:
            return None
        self.note_waiting()
        return lambda: self.microstep(unit)

    def microstep(self, unit: MicroStepUnit) -> None:
        """Blocking: one micro-step on the current params (runs on the driver thread): a gradient
        one, or forward only for a `forward_only` unit where this step allows it (module doc)."""
        tr = self.trainer
        t0 = time.perf_counter()
        ts = tr.train_step
        if unit.early is not None:  # into the group's buffer; its tokens count at the merge
            prog = unit.early.progress
            if prog.buffer is None:
                prog.buffer = ts.init_deferred(tr.params)
            prog.buffer = ts.deferred_microstep(tr.params, prog.buffer, unit.batch, unit.early.centred_reward)
            jax.block_until_ready(prog.buffer.pg1)
            name = "grad_microstep_early"
            self.trained["early_microsteps"] += 1
        else:
            if unit.forward_only and self.forward_only:  # advantage 0 throughout: no gradient to add
                self.acc = ts.stats_microstep(tr.params, self.acc, unit.batch)
                name = "stats_microstep"
                self.trained["forward_only_microsteps"] += 1
            else:
                self.acc = ts.grad_microstep(tr.params, self.acc, unit.batch)
                name = "grad_microstep"
            for prog, slope, reference_advantage in unit.merges:
                self.acc = ts.merge_deferred(tr.params, self.acc, prog.buffer, slope, reference_advantage)
                prog.buffer = None
            jax.block_until_ready(self.acc.scalars.numerator)
            for g in unit.groups:
                n = g.num_generated
                self.trained["tokens"] += n
                self.trained["on_policy_tokens"] += n if g.params_version == tr.params_version else 0
        t1 = time.perf_counter()
        tr.timeline.add(name, "train", t0, t1)
        self.train_device_s += t1 - t0
        self.trained["microsteps"] += 1
        # Packing efficiency: positions the micro-step computed vs those holding padding (segment 0).
        seg = unit.batch.get("segment_ids")
        if isinstance(seg, np.ndarray):  # host batches (built by trainer.batching)
            self.trained["positions"] += int(np.size(seg))
            self.trained["padding_positions"] += int(np.sum(np.asarray(seg) == 0))

    def metrics(self, wall: float) -> dict:
        s, s0, counts, groups = self.engine.stats, self.stats0, self.counts, self.kept
        decode_s = s.device_seconds - s0.device_seconds
        slot_total = s.slot_steps_total - s0.slot_steps_total
        rewards = np.concatenate([g.rewards for g in groups]) if groups else np.zeros(0)
        # reward/<name>: each reward function's mean over the kept trajectories that recorded it
        components = reward_component_means(t for g in groups for t in g.trajectories)
        generated = sum(g.num_generated for g in groups)
        trained, train_s = self.trained["tokens"], self.train_device_s
        compiles = sum(self.engine.steps.compile_counts().values())
        compiles += self.trainer.train_step.compile_count()
        return {
            **components,  # first: the trainer's own reward/mean and reward/success_rate win
            "step": self.trainer.step_index,
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
            "rollout/groups_dropped": counts["groups_dropped"],
            "rollout/groups_surplus": counts["groups_surplus"],
            "rollout/groups_failed": counts["groups_failed"],
            "rollout/failed_samples": counts["failed_samples"],
            # groups trained, and those of them whose rewards were all equal (advantage 0 throughout)
            "rollout/kept_groups": len(groups),
            "rollout/zero_variance_groups": sum(int(np.ptp(g.rewards) == 0) for g in groups),
            "engine/faults": s.faults - s0.faults,
            "engine/restored_slots": s.restored_slots - s0.restored_slots,
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
        }

    # -- internals --------------------------------------------------------------------------------
    def _form_units(self, groups: list[Group]) -> None:
        """Micro-steps of kept groups during the rollout; `pipelined` queues them for idle time."""
        new_units = self.trainer._make_units(groups)
        self.units.extend(new_units)
        if self.cfg.mode == "pipelined":
            self.ready.extend(new_units)

    async def _stop_in_flight(self) -> None:
        for fut in self.in_flight:
            fut.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
