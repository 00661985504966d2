"""Micro-steps of finished groups: pure host work, from trajectories to `MicroStepUnit`s.

A micro-batch of finished groups is laid out in rows (`TrainerConfig.pack_rows`: several
trajectories per row, `trainer.batching.pack_rows`; else one per row), then split into micro-steps
of at most `microbatch_rows` rows (`make_units`). A `MicroStepUnit` names whose tokens it holds:
whole `Group`s when it holds all of theirs, else one `TokenShare` per trajectory in its rows (a
packed row may hold samples of several groups), so the trained and on-policy token counts are
exact whatever the layout. Early samples train as one-row micro-steps (`early_micro_step`).

Forward-only micro-steps (`TrainerConfig.skip_zero_advantage_backward`, where the train step's
loss allows it: `TrainStep.forward_only_refusal`): trajectories whose advantage is exactly 0 add
exactly nothing to the gradient, so `make_units` packs them apart (the same packing, the same
`microbatch_rows` split) into micro-steps marked `forward_only`, which run
`TrainStep.stats_microstep` (their loss, counts and metrics accumulate; no backward). Early
samples and the micro-step that merges their buffers stay gradient micro-steps.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from sfrrl_jax.rl.microbatch import MicroBatch
from sfrrl_jax.trainer.batching import (
    Group, RowLayout, RowShapes, TokenShare, group_advantage_slopes, group_advantages, microbatch_from_layout,
    microbatch_from_trajectories, pack_rows, row_shapes,
)
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.early_samples import EarlyUnit, GroupProgress


@dataclasses.dataclass
class MicroStepUnit:
    """One gradient micro-step: its batch and whose tokens it holds (Groups or TokenShares).

    early: set for a sample trained into its unfinished group's buffer; merges: (group progress,
    advantage slope, reference advantage) of group buffers to add at their final advantages.
    forward_only: every row's advantage is exactly 0, so the step may run it forward only
    (`TrainStep.stats_microstep`; module doc). Never set with `early` or `merges`.
    """

    groups: list
    batch: MicroBatch
    early: EarlyUnit | None = None
    merges: list = dataclasses.field(default_factory=list)
    forward_only: bool = False


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


def split_rows(batch: MicroBatch, row_owners: list[list], microbatch_rows: int,
               whole: list | None = None) -> list[MicroStepUnit]:
    """Micro-steps of at most `microbatch_rows` rows of `batch` (0: no limit). row_owners: per row,
    the (group, sample) of each trajectory in it (none for an all-padding row). whole: the Groups
    a single micro-step holds entirely (else its trajectories count as `TokenShare`s)."""
    rows, step = len(row_owners), microbatch_rows
    shares = lambda part: [token_share(g, i) for row in part for g, i in row]  # noqa: E731
    if not step or rows <= step:
        return [MicroStepUnit(whole if whole is not None else shares(row_owners), batch)]
    return [MicroStepUnit(shares(row_owners[a:a + step]), batch.row_slice(a, a + step))
            for a in range(0, rows, step)]


def token_share(group: Group, sample: int) -> TokenShare:
    return TokenShare(group.group_id, group.params_version, int(np.sum(group.trajectories[sample].loss_mask)))


def early_micro_step(unit: EarlyUnit, cfg: TrainerConfig, fields: Sequence[str] | None = None,
                     route_dims: tuple[int, int] | None = None) -> MicroStepUnit:
    """The one-row micro-step of an early sample (advantage 1: its buffer is merged at the end)."""
    traj = unit.progress.finished[unit.sample]
    batch = microbatch_from_trajectories([traj], [0.0], cfg.seq_bucket, cfg.max_len, fields, route_dims)
    return MicroStepUnit([], batch, early=unit)
