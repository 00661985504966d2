"""Which finished samples of unfinished groups train early, and into which group buffer.

Pipelined mode trains a group once all of its G samples are in: a group whose last sample waits
on a slow tool holds back its finished siblings, and at the end of a rollout the device idles
beside them. With `TrainerConfig.early_groups > 0` a sample that finishes before its group
becomes an *early* micro-step into its group's buffer (`learner.deferred`, advantage 1, centred on
the group's reference reward). When the group completes, its other rows train as usual with the
final advantages and the buffer is merged at those advantages: the same update as training the
whole group then.

At most `early_groups` unfinished groups hold a buffer; a finished group's buffer goes at its
next micro-step. A sample finishing while every buffer is taken waits for its group, unless a
buffer frees first (then it is queued too). Buffers are handed out only once the trainer calls
`activate()`, which it does when at most `early_groups` groups of the step are unfinished (the
rollout's tail): before that, whole groups finish often enough to fill the idle time, and
one-sample micro-steps would add per-step overhead and make returning tools wait (a micro-step is
not preempted). Every method runs on the trainer's event loop, where
the engine's driver also pops its idle work; the micro-steps themselves run on the driver's
worker thread, one at a time, in the order they were popped.
"""
from __future__ import annotations

import collections
import dataclasses

from sfrrl_jax.agents.trajectory import Trajectory


@dataclasses.dataclass
class GroupProgress:
    """The samples of one in-flight group (by launch index) and its early-training state."""

    launch_index: int
    finished: dict[int, Trajectory] = dataclasses.field(default_factory=dict)  # sample -> trajectory
    queued: set[int] = dataclasses.field(default_factory=set)   # early units not yet popped
    claimed: list[int] = dataclasses.field(default_factory=list)  # popped: trained into `buffer`
    reference: int | None = None  # sample whose reward centres the buffer (first one queued)
    holds_buffer: bool = False
    buffer: dict | None = None    # device buffer, created by the first early micro-step


@dataclasses.dataclass
class EarlyUnit:
    """One early micro-step: a finished sample of an unfinished group."""

    progress: GroupProgress
    sample: int
    centred_reward: float  # its reward minus the reward of the group's reference sample


def _reward(t: Trajectory) -> float:
    return float(t.reward) if t.reward is not None else 0.0  # as `Group.rewards`


class EarlySamples:
    """Per-step bookkeeping of early samples (see the module doc)."""

    def __init__(self, max_groups: int, group_size: int, active: bool = True):
        self.max_groups, self.group_size, self.active = max_groups, group_size, active
        self.groups: dict[int, GroupProgress] = {}
        self.queue: collections.deque[EarlyUnit] = collections.deque()

    def __len__(self) -> int:
        """Early units waiting to be popped."""
        return len(self.queue)

    @property
    def buffers_held(self) -> int:
        return sum(p.holds_buffer for p in self.groups.values())

    def sample_finished(self, launch_index: int, sample: int, traj: Trajectory) -> bool:
        """Records a finished sample; True if it was queued for early training."""
        prog = self.groups.setdefault(launch_index, GroupProgress(launch_index))
        prog.finished[sample] = traj
        if len(prog.finished) == self.group_size or self.max_groups == 0 or not self.active:
            return False  # complete groups train whole, with their final advantages
        if not prog.holds_buffer:
            if self.buffers_held >= self.max_groups:
                return False
            prog.holds_buffer = True
        self._queue_waiting(prog)
        return True

    def activate(self) -> bool:
        """Starts handing out buffers (to samples that finished already, too); True if any got queued."""
        if self.active:
            return False
        self.active = True
        before = len(self.queue)
        self._refill()
        return len(self.queue) > before

    def pop(self) -> EarlyUnit | None:
        """The next early unit, now claimed: it will be in its group's buffer."""
        if not self.queue:
            return None
        unit = self.queue.popleft()
        unit.progress.queued.discard(unit.sample)
        unit.progress.claimed.append(unit.sample)
        return unit

    def group_complete(self, launch_index: int) -> GroupProgress | None:
        """The group's samples are all in: unqueue its early units (they train with the group),
        free its buffer slot, queue waiting samples of other groups. Returns its progress if some
        samples were claimed (their buffer must be merged), else None."""
        prog = self.groups.pop(launch_index, None)
        if prog is None:
            return None
        self._unqueue(prog)
        freed = prog.holds_buffer
        prog.holds_buffer = False
        if freed:
            self._refill()
        return prog if prog.claimed else None

    def discard(self, launch_index: int) -> None:
        """The group will not be trained (dropped by dynamic sampling, surplus, cancelled)."""
        prog = self.groups.pop(launch_index, None)
        if prog is not None:
            self._unqueue(prog)
            prog.holds_buffer, prog.buffer = False, None
            self._refill()

    def clear(self) -> None:
        for launch_index in list(self.groups):
            self.discard(launch_index)

    # -- internals ----------------------------------------------------------------------------
    def _queue(self, prog: GroupProgress, sample: int) -> None:
        if prog.reference is None:
            prog.reference = sample
        ref = _reward(prog.finished[prog.reference])
        prog.queued.add(sample)
        self.queue.append(EarlyUnit(prog, sample, _reward(prog.finished[sample]) - ref))

    def _unqueue(self, prog: GroupProgress) -> None:
        if prog.queued:
            self.queue = collections.deque(u for u in self.queue if u.progress is not prog)
            prog.queued.clear()

    def _refill(self) -> None:
        """Gives free buffer slots to unfinished groups with finished, waiting samples (oldest first)."""
        for prog in sorted(self.groups.values(), key=lambda p: p.launch_index):
            if self.buffers_held >= self.max_groups or not self.active:
                return
            if prog.holds_buffer or not self._waiting(prog) or len(prog.finished) == self.group_size:
                continue
            prog.holds_buffer = True
            self._queue_waiting(prog)

    def _waiting(self, prog: GroupProgress) -> list[int]:
        return sorted(s for s in prog.finished if s not in prog.queued and s not in prog.claimed)

    def _queue_waiting(self, prog: GroupProgress) -> None:
        for s in self._waiting(prog):
            self._queue(prog, s)
