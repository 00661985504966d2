"""What one RL step does differently on one process and on N processes: the `StepRules` strategy.

An `RLStep` (`trainer.step_schedule`) holds the step's state and its shared phases (begin, the
micro-step, finish) and calls its rules at fixed points: `begin` (install the engine's hooks),
`rollout` (launch and collect the groups, free the cache), `sample_finished` / `group_done`,
`form_units`, `train_remaining`, `global_batch` / `positions` (what a micro-step runs and counts),
`metrics` (the reduction). `OneProcessRules` (here) is the default: every group is this
process's. `trainer.process_step.LockstepRules` is the N-process one. A rules object serves one
step (`bind`); the step is never subclassed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

import numpy as np

from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.rl.microbatch import MicroBatch
from sfrrl_jax.trainer.batching import Group
from sfrrl_jax.trainer.microsteps import MicroStepUnit, early_micro_step

# `RLStep` (trainer.step_schedule) appears in annotations only: that module imports this one.


@dataclasses.dataclass
class FailedGroup:
    """A group some of whose samples' rollout function raised (not an `EngineError`)."""

    group_id: str
    launch_index: int
    errors: list[str]


class StepRules:
    """The rules one RL step follows where one process and N processes differ (module doc): the
    step calls these at fixed points. The base class is the protocol; `OneProcessRules` and
    `trainer.process_step.LockstepRules` implement it. A rules object serves one step (`bind`).
    """

    def bind(self, step: "RLStep") -> None:
        """Called once by the step's constructor: per-step state of the rules."""

    def begin(self, step: "RLStep") -> None:
        """After the step's own `begin` (params set, accumulator made): install the engine's hooks."""
        raise NotImplementedError

    async def rollout(self, step: "RLStep") -> None:
        """Launch and collect the step's groups until `groups_per_step` are kept; stop the rest; form
        their micro-steps; free the KV cache. On failure, leave the engine without hooks into the step."""
        raise NotImplementedError

    def sample_finished(self, step: "RLStep", index: int, sample: int, traj: Trajectory) -> None:
        """A sample's rollout finished (early samples may train it)."""
        raise NotImplementedError

    def group_done(self, step: "RLStep", group: "Group | FailedGroup") -> None:
        """A group's rollout finished (kept, dropped, failed or surplus)."""
        raise NotImplementedError

    def form_units(self, step: "RLStep", groups: list[Group]) -> list[MicroStepUnit]:
        """The micro-steps of these kept groups, recorded in `step.units` (and queued where the mode trains them
        during the rollout)."""
        raise NotImplementedError

    async def train_remaining(self, step: "RLStep") -> None:
        """The micro-steps the rollout did not run."""
        raise NotImplementedError

    def global_batch(self, step: "RLStep", batch: MicroBatch) -> MicroBatch:
        """The micro-batch the train step runs for this process's rows (one process: the rows)."""
        return batch

    def positions(self, step: "RLStep", local: MicroBatch, run: MicroBatch) -> tuple[int, int]:
        """(positions, padding positions) this process counts for a micro-step: `local` is its rows, `run`
        the batch that ran."""
        raise NotImplementedError

    def metrics(self, step: "RLStep", wall: float, out: dict) -> dict:
        """The step's metrics from this process's `out` (N processes: summed over them)."""
        return out


class OneProcessRules(StepRules):
    """The rules of a step on one process: every group is this process's (module doc)."""

    def begin(self, step: "RLStep") -> None:
        step.engine.set_idle_work(lambda: self.idle_work(step), underfull_slots=step.cfg.underfull_slots)

    async def rollout(self, step: "RLStep") -> None:
        try:
            self.launch_groups(step)
            try:
                await self.collect_groups(step)
            except BaseException:
                await self.cancel_leftovers(step)
                await self.free_cache_after_failure(step)
                raise
            try:
                await self.end_rollout(step)
            except BaseException:
                await self.free_cache_after_failure(step)
                raise
        finally:
            # Whatever ends the rollout (an error included: too few groups survived dynamic
            # sampling, an EngineError), the engine must not keep calling into this step.
            step.engine.set_idle_work(None)

    def launch_groups(self, step: "RLStep") -> None:
        """Draws the step's prompts and launches their groups, longest expected first."""
        n = step.n_launch
        drawn = [step.inputs.tasks.next() for _ in range(n)]
        order = step.inputs.longest_first.order(drawn) if step.cfg.longest_first else range(n)
        # sync trains in draw order: the launch order follows measured durations, draws do not
        step.draw_position = {launch_index: i for launch_index, i in enumerate(order)}
        step.in_flight = {step.launch(drawn[i]) for i in order}

    async def collect_groups(self, step: "RLStep") -> None:
        """Until `groups_per_step` groups are kept (or none is left running)."""
        cfg, early = step.cfg, step.early
        while step.in_flight and len(step.kept) < cfg.groups_per_step:
            done, step.in_flight = await asyncio.wait(step.in_flight, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                self.group_done(step, fut.result())
            if early is not None and len(step.in_flight) <= cfg.early_groups and early.activate():
                step.note_waiting()  # the tail: finished samples of the last groups may train now
                step.engine.notify_idle_work()

    async def cancel_leftovers(self, step: "RLStep") -> None:
        """The step fails (an EngineError, a rollout function that keeps raising): stop every group
        still running, so their slots are released before the error leaves the step."""
        await step.stop_in_flight()
        step.engine.set_idle_work(None)

    async def free_cache_after_failure(self, step: "RLStep") -> None:
        """A failed step frees the KV cache as a finished rollout does, so whatever the caller does
        next (evaluate, save, retry the step) has the memory. Only when no request is left: a
        slot still held means the failure is the engine's own, and its recovery owns the state."""
        step.engine.set_idle_work(None)
        await step.engine.wait_idle()
        occ = step.engine.occupancy
        if not (occ["running"] or occ["parked"] or occ["queued"]):
            step.engine.release_memory()

    async def end_rollout(self, step: "RLStep") -> None:
        """Stop surplus groups, form the last micro-steps, wait for the driver's last micro-step, free the cache."""
        cfg = step.cfg
        await step.stop_in_flight()  # over-provisioned groups not needed
        if step.early is not None:
            step.early.clear()  # samples of cancelled groups
        if len(step.kept) < cfg.groups_per_step:
            raise RuntimeError(f"only {len(step.kept)} of {cfg.groups_per_step} groups survived dynamic sampling "
                               f"after {step.refills} refills; raise TrainerConfig.max_refill_groups")
        if step.pending:
            self.form_units(step, step.pending)
            step.pending = []
        step.engine.set_idle_work(None)
        await step.engine.wait_idle()  # a micro-step may still be running on the driver thread
        step.t_rollout = time.perf_counter()
        step.engine.release_memory()  # the cache goes before the update needs the memory
        step.trained_during_rollout = step.train_device_s

    async def train_remaining(self, step: "RLStep") -> None:
        cfg = step.cfg
        if cfg.mode == "sync":
            # Draw order, not finish order: the gradient sum is then bitwise repeatable.
            ordered = sorted(step.kept, key=lambda g: step.draw_position[g.launch_index])
            gpm = cfg.groups_per_microbatch
            step.units = [u for i in range(0, len(ordered), gpm) for u in step.make_units(ordered[i:i + gpm])]
            step.ready.extend(step.units)
        while step.ready:
            step.microstep(step.ready.popleft())

    def sample_finished(self, step: "RLStep", index: int, sample: int, traj: Trajectory) -> None:
        if step.early is not None and step.early.sample_finished(index, sample, traj):
            step.note_waiting()
            step.engine.notify_idle_work()

    def group_done(self, step: "RLStep", group: "Group | FailedGroup") -> None:
        """A group finished: lost (refilled), dropped by dynamic sampling (refilled while refills
        last), surplus, or kept; a kept one becomes micro-steps once `groups_per_microbatch` are in."""
        cfg, early, counts = step.cfg, step.early, step.counts
        if isinstance(group, FailedGroup):
            # A rollout function raised for some sample: that group is lost, not the step.
            # Another prompt takes its place; a function that keeps failing stops the run.
            step.count_failed(group)
            if early is not None:
                early.discard(group.launch_index)
            if counts["groups_failed"] > cfg.failed_groups_limit:
                raise RuntimeError(
                    f"the rollout function raised in {counts['groups_failed']} groups this step (more than the "
                    f"{cfg.failed_groups_limit} it launches: groups_per_step + overprovision_groups); first "
                    f"errors: {step.failures[:3]}")
            self.refill(step)
            return
        step.count_finished(group)
        if cfg.dynamic_sampling and np.ptp(group.rewards) == 0:
            counts["groups_dropped"] += 1
            if early is not None:
                early.discard(group.launch_index)
            if step.refills < cfg.max_refill_groups:
                step.refills += 1
                self.refill(step)
            return
        if len(step.kept) == cfg.groups_per_step:
            counts["groups_surplus"] += 1
            if early is not None:
                early.discard(group.launch_index)
            return
        step.kept.append(group)
        if early is not None:
            progress = early.group_complete(group.launch_index)
            if progress is not None:
                step.claimed[group.launch_index] = progress
            if len(early):  # its freed buffer went to samples of other groups
                step.engine.notify_idle_work()
        if cfg.mode == "sync":
            step.note_waiting()
            return  # micro-batches are formed after the rollout, in launch order
        step.pending.append(group)
        if len(step.pending) == cfg.groups_per_microbatch:
            self.form_units(step, step.pending)
            step.pending = []
            if cfg.mode == "pipelined":
                step.engine.notify_idle_work()
        step.note_waiting()

    def refill(self, step: "RLStep") -> None:
        """Launches one more prompt in place of a lost or dropped group (numbered in draw order)."""
        step.draw_position[step.launched] = step.n_launch + step.refills + step.counts["groups_failed"] - 1
        step.in_flight.add(step.launch(step.inputs.tasks.next()))

    def form_units(self, step: "RLStep", groups: list[Group]) -> list[MicroStepUnit]:
        """Micro-steps of kept groups during the rollout; `pipelined` queues them for idle time."""
        new_units = step.make_units(groups)
        step.units.extend(new_units)
        if step.cfg.mode == "pipelined":
            step.ready.extend(new_units)
        return new_units

    def idle_work(self, step: "RLStep") -> Callable[[], None] | None:
        """The engine's idle hook: the next micro-step to run on its driver thread, or None."""
        if step.cfg.mode == "sync":
            return None
        if step.ready:
            unit = step.ready.popleft()
        elif step.early is not None and len(step.early):
            unit = early_micro_step(step.early.pop(), step.cfg, step.inputs.batch_fields, step.inputs.route_dims)
        else:
            return None
        step.note_waiting()
        return lambda: step.microstep(unit)

    def positions(self, step: "RLStep", local: MicroBatch, run: MicroBatch) -> tuple[int, int]:
        # Packing efficiency: positions the micro-step computed vs those holding padding (segment 0).
        seg = local.segment_ids
        if isinstance(seg, np.ndarray):  # host batches (built by trainer.batching)
            return int(np.size(seg)), int(np.sum(seg == 0))
        return 0, 0
