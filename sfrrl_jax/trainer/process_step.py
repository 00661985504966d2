"""One RL step on N processes (multi-host), each rolling out and training its share of the groups.

`RLTrainer` runs its `RLStep` with `LockstepRules` (a `step_schedule.StepRules` strategy) instead
of `OneProcessRules` when its engine is a `LockstepEngine` (the default when `jax.process_count() >
1`). Every process runs the same step; what differs is only which trajectories it owns
(docs/multihost.md):

  draws      every process draws the same prompts from its own copy of the task stream (same
             seed, same calls); the group of launch index i belongs to process `i % P`. The
             others' groups are counted as visits (`visited_elsewhere`) so per-visit seeds match
             a one-process run.
  rollout    inside `engine.session()`, each process runs its own groups' agent loops and tools;
             the engine's device steps are global, in lockstep. A round ends when every process's
             groups are done; then the processes agree (a host-side all-gather of small JSON)
             on the groups kept and lost, and draw the same refills for lost ones in a next
             round (dynamic sampling, failed rollouts), or stop.
  training   every micro-step is global: each process contributes the rows of its own groups
             (`learner.process_rows.global_microbatch`, a micro-batch with no rows of its own
             when it has none). `pipelined`: a micro-step runs as an engine tick event when any
             process has one ready and the engine would idle; `sync`: after the rollout, micro-
             step j holds the j-th `groups_per_microbatch` groups of the global draw order, as on
             one process; the remaining counts are agreed, so every process runs the same number.
  surplus    (`overprovision_groups`) each process publishes its groups' ends through the
             engine's ticks; the first `groups_per_step` kept ends in tick order are the step's
             groups, the same on every process; once they are in, each process stops its own
             groups still running (surplus).
  early      (`early_groups`) the early-sample bookkeeping is replicated: each process
             `publish`es its samples' finishes (with rewards) and its groups' ends through the
             engine's ticks, and every process applies them at the same tick to its copy, so the
             queue of early micro-steps, their group buffers and the buffers' merges are the same
             everywhere; they run as the engine's shared idle work (the owner contributes the
             sample's row, the others an empty share).
  finish     one optimizer update on every process; the metrics are the all-gathered sums.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time

import jax
import numpy as np

from sfrrl_jax.agents.tasks.reward_fns import REWARDS_KEY
from sfrrl_jax.learner.process_rows import global_microbatch
from sfrrl_jax.models.api import mesh_of
from sfrrl_jax.trainer.batching import Group, group_advantage_slopes, group_advantages, zero_microbatch
from sfrrl_jax.rl.microbatch import MicroBatch
from sfrrl_jax.trainer.microsteps import MicroStepUnit, early_micro_step
from sfrrl_jax.trainer.step_rules import FailedGroup, StepRules
from sfrrl_jax.trainer.step_schedule import RLStep, tool_queue_metrics

_log = logging.getLogger(__name__)

class _FinishedElsewhere:
    """A finished sample of another process's group, as this process's replica holds it."""

    __slots__ = ("reward",)

    def __init__(self, reward: float):
        self.reward = reward


@dataclasses.dataclass
class _GroupRewards:
    """A group as every replica sees it: its rewards (all `group_advantages` reads)."""

    rewards: np.ndarray


class Agreement:
    """All-gather of one JSON value per process, in process order, over an `engine.lockstep`
    `Exchange` (host side: the coordination service's key-value store). Every process must make
    the same calls in the same order."""

    def __init__(self, exchange):
        self.exchange = exchange
        self.calls = 0

    def allgather(self, value) -> list:
        out = self.exchange.allgather(self.calls, json.dumps(value).encode())
        self.calls += 1
        return [json.loads(raw) for raw in out]

    async def allgather_async(self, value) -> list:
        """`allgather` on a worker thread: the event loop keeps serving tools and engine ticks."""
        return await asyncio.to_thread(self.allgather, value)


class LockstepRules(StepRules):
    """The rules of one RL step on N processes in lockstep (module doc); a fresh one per step.

    agreement: the run's `Agreement` (its call count runs across steps: every process makes the same calls).
    """

    def __init__(self, agreement: Agreement):
        self.agreement = agreement
        self.step: RLStep | None = None

    def bind(self, step: RLStep) -> None:
        self.step = step
        ex = step.engine.exchange
        self.me, self.processes = ex.process_index, ex.process_count
        self.mesh = mesh_of(step.params)
        # pipelined micro-steps hold this process's groups only: the global micro-batch is about
        # as large as one process's groups_per_microbatch groups
        self.local_gpm = max(1, step.cfg.groups_per_microbatch // self.processes)
        self.global_kept: list[int] = []     # launch indices of every process's kept groups, sorted
        self.ticks0 = self.exchange_s0 = 0
        # early samples, replicated by events (see the module doc)
        self.sample_rewards: dict[int, dict[int, float]] = collections.defaultdict(dict)
        self.own_trajs: dict[tuple[int, int], object] = {}
        self.own_done: dict[int, Group] = {}          # own kept groups until their end event applies
        self.shared_merges: collections.deque = collections.deque()
        self.announced = step.n_launch                # groups launched, as the events say
        self.settled = 0                              # groups ended (kept, dropped or failed)
        # group ends go through events when their order matters to every process: early samples,
        # or over-provisioning (the first groups_per_step ends in tick order are kept)
        self.events = step.early is not None or step.cfg.overprovision_groups > 0
        self.kept_count = 0                           # replicated: groups kept so far, in tick order
        self.enough = asyncio.Event()                 # kept_count reached groups_per_step
        self.unapplied_ends = 0                       # own end events not yet applied
        self.ends_applied = asyncio.Event()
        self.flight_index: dict[asyncio.Future, int] = {}
        if step.early is not None:
            step.early.active = False                 # activated by the replicated count below

    # -- the step -------------------------------------------------------------------------------
    async def rollout(self, step: RLStep) -> None:
        try:
            async with step.engine.session():
                self.launch_round(step.n_launch)
                try:
                    await self.collect_groups()
                except BaseException:
                    await step.stop_in_flight()
                    raise
            # leaving the session waited for every driver to stop: every agreed idle micro-step ran
        finally:
            step.engine.set_idle_work(None)
            step.engine.set_event_handler(None)
        await self.end_rollout()

    def begin(self, step: RLStep) -> None:
        self.ticks0, self.exchange_s0 = step.engine.ticks, step.engine.exchange_seconds
        step.engine.set_idle_work(self.idle_work, underfull_slots=step.cfg.underfull_slots,
                                  has_work=self.has_idle_work, filler=self.filler_job,
                                  shared_work=self.shared_work, has_shared_work=self.has_shared_work)
        step.engine.set_event_handler(self.on_event if self.events else None)
        self._maybe_activate()

    def launch_round(self, n: int) -> None:
        """Draws n prompts (the same on every process) and launches this process's groups."""
        step = self.step
        tr = step.inputs
        drawn = [(step.launched + k, tr.tasks.next()) for k in range(n)]
        step.launched += n
        mine = [(i, task) for i, task in drawn if i % self.processes == self.me]
        visited_elsewhere = getattr(tr.rollout_fn, "visited_elsewhere", None)
        if visited_elsewhere is not None:
            for i, task in drawn:
                if i % self.processes != self.me:
                    for sample in range(step.cfg.group_size):
                        visited_elsewhere(task, sample)
        order = tr.longest_first.order([t for _, t in mine]) if step.cfg.longest_first else range(len(mine))
        for i, _ in drawn:
            step.draw_position[i] = i
        for k in order:
            fut = asyncio.ensure_future(step.run_group(mine[k][1], mine[k][0]))
            self.flight_index[fut] = mine[k][0]
            step.in_flight.add(fut)

    async def collect_groups(self) -> None:
        """Rounds: every own group finishes, the processes agree on what survived, refills are drawn."""
        step = self.step
        cfg = step.cfg
        while True:
            enough = asyncio.ensure_future(self.enough.wait())
            try:
                while step.in_flight and not self.enough.is_set():
                    done, _ = await asyncio.wait(step.in_flight | {enough}, return_when=asyncio.FIRST_COMPLETED)
                    for fut in done - {enough}:
                        step.in_flight.discard(fut)
                        self.group_done(step, fut.result())
            finally:
                enough.cancel()
            if step.in_flight:   # enough groups kept (over-provisioning): the rest are surplus
                cancelled = [self.flight_index[f] for f in step.in_flight]
                await step.stop_in_flight()
                step.in_flight = set()
                for launch_index in cancelled:
                    step.counts["groups_surplus"] += 1
                    self._publish_end(launch_index, keep=False)
            await self._own_ends_applied()   # what this process reports is decided at the ticks
            views = await self.agreement.allgather_async({
                "kept": [g.launch_index for g in step.kept], "failed": step.counts["groups_failed"],
                "dropped": step.counts["groups_dropped"], "errors": step.failures[:3]})
            kept = sorted(i for v in views for i in v["kept"])
            failed = sum(v["failed"] for v in views)
            dropped = sum(v["dropped"] for v in views)
            if len(kept) >= cfg.groups_per_step:
                self.global_kept = kept
                return
            if failed > cfg.failed_groups_limit:
                errors = [e for v in views for e in v["errors"]][:3]
                raise RuntimeError(f"the rollout function raised in {failed} groups this step (more than the "
                                   f"{cfg.failed_groups_limit} it launches, all processes); first errors: {errors}")
            if dropped > cfg.max_refill_groups:
                raise RuntimeError(f"only {len(kept)} of {cfg.groups_per_step} groups survived dynamic sampling "
                                   f"after {step.refills} refills; raise TrainerConfig.max_refill_groups")
            need = cfg.groups_per_step - len(kept)
            step.refills += need
            if self.events:
                step.engine.publish({"e": "round", "n": need})   # process 0's counts, at one tick
            self.launch_round(need)

    def group_done(self, step: RLStep, group: Group | FailedGroup) -> None:
        """Local bookkeeping only: whether the step goes on is decided by the round's agreement.
        With early samples, a group's end is an event: its micro-steps form when it applies."""
        cfg, counts = step.cfg, step.counts
        if isinstance(group, FailedGroup):
            step.count_failed(group)
            self._publish_end(group.launch_index, keep=False)
            return
        step.count_finished(group)
        if cfg.dynamic_sampling and np.ptp(group.rewards) == 0:
            counts["groups_dropped"] += 1
            self._publish_end(group.launch_index, keep=False)
            return
        if self.events:   # kept or surplus: decided when its end applies (`on_event`)
            self.own_done[group.launch_index] = group
            self._publish_end(group.launch_index, keep=True)
            return
        step.kept.append(group)
        if cfg.mode != "sync":
            self._add_pending(group)
        step.note_waiting()

    def _add_pending(self, group: Group) -> None:
        step = self.step
        step.pending.append(group)
        if len(step.pending) == self.local_gpm:
            self.form_units(step, step.pending)
            step.pending = []
            if step.cfg.mode == "pipelined":
                step.engine.notify_idle_work()

    def form_units(self, step: RLStep, groups: list[Group]) -> list[MicroStepUnit]:
        new_units = step.make_units(groups)
        for unit in new_units:
            unit.merges = []   # every process merges the buffers (shared work), not the owner alone
        step.units.extend(new_units)
        if step.cfg.mode == "pipelined":
            step.ready.extend(new_units)
        return new_units

    # -- early samples: replicated through the engine's ticks -------------------------------------
    def sample_finished(self, step: RLStep, index: int, sample: int, traj) -> None:
        if step.early is not None:
            self.own_trajs[(index, sample)] = traj
            reward = float(traj.reward) if traj.reward is not None else 0.0   # as Group.rewards
            step.engine.publish({"e": "sample", "li": index, "s": sample, "r": reward})

    def _publish_end(self, launch_index: int, keep: bool) -> None:
        if self.events:
            self.unapplied_ends += 1
            self.ends_applied.clear()
            self.step.engine.publish({"e": "end", "li": launch_index, "keep": keep})

    async def _own_ends_applied(self) -> None:
        if self.unapplied_ends:
            await self.ends_applied.wait()

    def on_event(self, owner: int, event: dict) -> None:
        """Applied on every process at the same tick, in process order (engine.lockstep)."""
        step = self.step
        early, kind = step.early, event["e"]
        if kind == "round":
            if owner == 0:
                self.announced += event["n"]
        elif kind == "sample":
            li, sample, reward = event["li"], event["s"], event["r"]
            self.sample_rewards[li][sample] = reward
            if early is not None:
                traj = self.own_trajs[(li, sample)] if owner == self.me else _FinishedElsewhere(reward)
                early.sample_finished(li, sample, traj)
        elif kind == "end":
            li = event["li"]
            self.settled += 1
            mine = owner == self.me
            keep = event["keep"] and self.kept_count < step.cfg.groups_per_step
            if event["keep"] and not keep and mine:   # finished after enough others: surplus
                self.own_done.pop(li)
                step.counts["groups_surplus"] += 1
            if not keep:
                if early is not None:
                    early.discard(li)
            else:
                self.kept_count += 1
                prog = early.group_complete(li) if early is not None else None
                if prog is not None:   # its buffer is merged at the final advantages, on every process
                    rewards = self.sample_rewards[li]
                    group = _GroupRewards(np.array([rewards[i] for i in range(step.cfg.group_size)], np.float32))
                    slope = group_advantage_slopes([group], step.cfg.advantage)[0]
                    advantages = group_advantages([group], step.cfg.advantage)[0]
                    self.shared_merges.append((prog, float(slope), float(advantages[prog.reference])))
                if mine:
                    if prog is not None:
                        step.claimed[li] = prog
                    group = self.own_done.pop(li)
                    step.kept.append(group)
                    if step.cfg.mode != "sync":
                        self._add_pending(group)
                if self.kept_count == step.cfg.groups_per_step:
                    self.enough.set()
            self.sample_rewards.pop(li, None)
            if mine:
                self.unapplied_ends -= 1
                if not self.unapplied_ends:
                    self.ends_applied.set()
        self._maybe_activate()
        step.note_waiting()
        step.engine.notify_idle_work()

    def _maybe_activate(self) -> None:
        """The rollout's tail: at most `early_groups` groups unfinished (by the replicated count)."""
        step = self.step
        if step.early is not None and self.announced - self.settled <= step.cfg.early_groups:
            step.early.activate()

    def has_shared_work(self) -> bool:
        early = self.step.early
        return bool(self.shared_merges) or (early is not None and len(early) > 0)

    def shared_work(self):
        """The next early micro-step or buffer merge: the same on every process (replicated)."""
        step = self.step
        if self.shared_merges:
            merge = self.shared_merges.popleft()
            return lambda: self.merge_buffer(*merge)
        if step.early is not None and len(step.early):
            unit = step.early.pop()
            if unit.progress.launch_index % self.processes == self.me:
                job = early_micro_step(unit, step.cfg, step.inputs.batch_fields, step.inputs.route_dims)
            else:
                job = dataclasses.replace(self.filler_unit(), early=unit)
            return lambda: step.microstep(job)
        return None

    def merge_buffer(self, progress, slope: float, reference_advantage: float) -> None:
        """Adds an early group's buffer to the gradient sums at its final advantages."""
        step = self.step
        t0 = time.perf_counter()
        step.acc = step.train_step.merge_deferred(step.params, step.acc, progress.buffer, slope, reference_advantage)
        progress.buffer = None
        jax.block_until_ready(step.acc.scalars.numerator)
        step.timeline.add("merge_deferred", "train", t0, time.perf_counter())
        step.train_device_s += time.perf_counter() - t0

    async def end_rollout(self) -> None:
        step = self.step
        if step.pending:
            self.form_units(step, step.pending)
            step.pending = []
        await step.engine.wait_idle()
        step.t_rollout = time.perf_counter()
        step.engine.release_memory()
        step.trained_during_rollout = step.train_device_s

    async def train_remaining(self, step: RLStep) -> None:
        """The micro-steps the rollout did not run, the same number on every process (fillers
        where a process has fewer). sync: segment j = this process's groups among the j-th
        `groups_per_microbatch` of the global draw order."""
        cfg = step.cfg
        if cfg.mode == "sync":
            mine = {g.launch_index: g for g in step.kept}
            gpm = cfg.groups_per_microbatch
            segments = []
            for a in range(0, len(self.global_kept), gpm):
                own = [mine[i] for i in self.global_kept[a:a + gpm] if i in mine]
                segments.append(step.make_units(own) if own else [])
            step.units = [u for s in segments for u in s]
        else:
            segments = [list(step.ready)]
            step.ready.clear()
        counts = self.agreement.allgather([len(s) for s in segments])
        for j, seg in enumerate(segments):
            for k in range(max(c[j] for c in counts)):
                step.microstep(seg[k] if k < len(seg) else self.filler_unit())
        while self.shared_merges:   # replicated: the same merges on every process
            self.merge_buffer(*self.shared_merges.popleft())

    # -- idle work across processes -------------------------------------------------------------
    def idle_work(self):
        """This process's next regular micro-step (early ones are shared work)."""
        step = self.step
        if step.cfg.mode == "sync" or not step.ready:
            return None
        unit = step.ready.popleft()
        step.note_waiting()
        return lambda: step.microstep(unit)

    def has_idle_work(self) -> bool:
        step = self.step
        return step.cfg.mode != "sync" and bool(step.ready)  # as idle_work: sync trains after

    def filler_unit(self) -> MicroStepUnit:
        """This process's share of a micro-step in which it has no rows."""
        step = self.step
        return MicroStepUnit([], zero_microbatch(step.inputs.batch_fields, rows=0, width=0,
                                                 route_dims=step.inputs.route_dims))

    def filler_job(self):
        unit = self.filler_unit()
        return lambda: self.step.microstep(unit)

    def global_batch(self, step: RLStep, batch: MicroBatch) -> MicroBatch:
        """One global micro-batch of every process's rows (every process calls it together)."""
        return global_microbatch(batch, self.mesh)

    def positions(self, step: RLStep, local: MicroBatch, run: MicroBatch) -> tuple[int, int]:
        # this process's share of the global [rows, width]; padding: those not its tokens
        share = int(np.prod(run.tokens.shape)) // self.processes
        seg = local.segment_ids
        own = int(np.count_nonzero(seg)) if seg is not None else 0
        return share, share - own

    # -- metrics: the sums of every process --------------------------------------------------------
    def metrics(self, step: RLStep, wall: float, out: dict) -> dict:
        trajs = [t for g in step.kept for t in g.trajectories]
        components = collections.defaultdict(lambda: [0.0, 0])
        for t in trajs:
            if t.error is None:
                for name, value in t.metadata.get(REWARDS_KEY, {}).items():
                    components[name][0] += float(value)
                    components[name][1] += 1
        mine = {
            "rewards": [float(r) for g in step.kept for r in g.rewards],
            "components": dict(components),
            "generated": sum(g.num_generated for g in step.kept),
            "samples": len(trajs),
            "trained": step.trained["tokens"], "on_policy": step.trained["on_policy_tokens"],
            "positions": step.trained["positions"], "padding": step.trained["padding_positions"],
            "counts": {k: step.counts[k] for k in ("tool_errors", "groups_dropped", "groups_failed",
                                                   "failed_samples", "groups_surplus", "orphaned_tool_calls")},
            "kept_groups": len(step.kept),
            "tool_queue_s": list(step.tool_queue_s),
            "zero_variance_groups": sum(int(np.ptp(g.rewards) == 0) for g in step.kept),
        }
        views = self.agreement.allgather(mine)
        rewards = np.array([r for v in views for r in v["rewards"]])
        summed = {k: sum(v[k] for v in views) for k in ("generated", "samples", "trained", "on_policy",
                                                        "positions", "padding")}
        names = sorted({n for v in views for n in v["components"]})
        for name in names:
            s = sum(v["components"].get(name, [0.0, 0])[0] for v in views)
            n = sum(v["components"].get(name, [0.0, 0])[1] for v in views)
            out[f"reward/{name}"] = s / n
        trained = summed["trained"]
        out.update({
            "reward/mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward/success_rate": float(np.mean(rewards >= 1.0)) if rewards.size else 0.0,
            "rollout/generated_tokens": summed["generated"],
            "perf/generated_tokens_per_s": summed["generated"] / wall,
            "perf/trained_tokens_per_s": trained / wall,
            "perf/samples_per_s": summed["samples"] / wall,
            "policy/on_policy_fraction": summed["on_policy"] / trained if trained else 1.0,
            "train/trained_tokens": trained,
            "train/padding_share": summed["padding"] / summed["positions"] if summed["positions"] else 0.0,
            "train/positions": summed["positions"],
            # the lockstep's cost: engine ticks this step and the wall time inside their exchanges
            "perf/engine_ticks": step.engine.ticks - self.ticks0,   # timing-dependent: a perf/ key
            "time/tick_exchange_s": step.engine.exchange_seconds - self.exchange_s0,
            **{f"rollout/{k}": sum(v["counts"][k] for v in views)
               for k in ("tool_errors", "groups_dropped", "groups_failed", "failed_samples", "groups_surplus",
                         "orphaned_tool_calls")},
            **{f"rollout/{k}": sum(v[k] for v in views) for k in ("kept_groups", "zero_variance_groups")},
            **tool_queue_metrics([q for v in views for q in v["tool_queue_s"]]),
        })
        return out
