"""Finished groups of trajectories -> advantages -> train micro-batches.

Row layouts. A micro-batch is a `rl.MicroBatch` of host arrays [rows, width]; where each trajectory
lies in them is a `RowLayout`:
  packed (`pack_rows`, the trainer's default): several trajectories share a row, one after the
    other from column 0, with segment ids 1, 2, 3, ... along the row (0 = the padding after the
    last one) and positions restarting at 0 at each (the forward derives them from the segment
    changes: `models.transformer.default_positions_and_segments`). Attention stays within a
    segment, a target predicted across a segment boundary is dropped (`learner.objective
    .target_mask`) and the per-sequence aggregations find the sequences from the segment changes
    (`rl.aggregation.SequenceLayout`): a packed micro-batch has the loss and gradient of the
    same trajectories one per row, up to float summation order (tests/trainer/test_packing.py).
    Packing is first-fit decreasing (longest first, ties by input order; in a row the
    trajectories keep their input order): a pure function of the lengths, so a step repeats
    bitwise. The [rows, width] is the smallest area a `RowShapes` menu offers that the packing
    fits (ties: the narrower); the menu is a fixed, bounded set of shapes, so the micro-step
    compiles a bounded number of times (`RowShapes.shapes`).
  one per row (`microbatch_from_trajectories`, early samples, `pack_rows=False`): each
    trajectory in its own row, right-padded to the longest rounded up to `seq_bucket`.
Widths are multiples of `seq_bucket` capped at `max_len` (`bucket_widths`); a trajectory longer
than `max_len` (the engine never makes one) gets a width of its own length.

Arrays are aligned to the token they belong to, as the train step expects: `rollout_logprobs[t]`
is the engine's log-prob of `tokens[t]`; `loss_mask` is 1 exactly on policy-generated tokens;
`advantages` [rows, width] holds each trajectory's advantage on its loss tokens (0 elsewhere).

A trajectory supplies the fields in `TRAJECTORY_FIELDS`; a micro-batch carries those the train
step's loss reads (`batch_fields(loss)`: its required fields, the optional ones trajectories
supply, and `segment_ids`). A loss that requires anything else cannot train on trajectories:
`batch_fields` raises naming the field.

Routing replay (`Loss.routing_replay='r3'`): the batch also carries 'routes' [rows, width, moe
layers, top_k] int16 (the engine's experts, `Trajectory.routes`, at the trajectory's columns) and
'routes_mask' [rows, width] int32 (1 where the engine recorded them); `route_dims` = (moe layers,
top_k) gives the shape of rows without routes. A trajectory with loss tokens but no routes raises,
naming it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.rl.advantages import advantage_slopes, compute_advantages
from sfrrl_jax.rl.config import AdvantageConfig
from sfrrl_jax.rl.loss_fn import Loss
from sfrrl_jax.rl.microbatch import MicroBatch

# What a micro-batch built from trajectories can carry, with each field's dtype (all [rows, T]).
TRAJECTORY_FIELDS = {"tokens": np.int32, "loss_mask": np.float32, "advantages": np.float32,
                     "rollout_logprobs": np.float32, "segment_ids": np.int32}
# Under routing replay: 'routes' [rows, T, moe layers, top_k], 'routes_mask' [rows, T].
ROUTE_FIELDS = {"routes": np.int16, "routes_mask": np.int32}


@dataclasses.dataclass
class Group:
    """The G trajectories of one prompt, with the params version that generated them."""

    group_id: str
    trajectories: list[Trajectory]
    params_version: int
    launch_index: int = 0  # order of launch within its step (longest expected first)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([t.reward if t.reward is not None else 0.0 for t in self.trajectories], np.float32)

    @property
    def num_generated(self) -> int:
        return sum(int(np.sum(t.loss_mask)) for t in self.trajectories)


@dataclasses.dataclass(frozen=True)
class TokenShare:
    """The generated tokens of some rows of a group (a micro-batch that splits a group)."""

    group_id: str
    params_version: int
    num_generated: int


def group_advantages(groups: Sequence[Group], cfg: AdvantageConfig) -> np.ndarray:
    """[groups, G] per-sample advantages of these groups: `rl.compute_advantages` (the one
    definition), returned as host numpy.

    This is called on the event-loop thread while the engine's driver thread may be running
    multi-device steps: the few element-wise ops run on one host CPU device, never as a
    multi-device program of the mesh (see `_host_device`).
    """
    rewards = np.stack([g.rewards for g in groups]).astype(np.float32)
    with jax.default_device(_host_device()):
        return np.asarray(compute_advantages(jnp.asarray(rewards), cfg))


@functools.lru_cache(maxsize=1)
def _host_device():
    """A CPU device for host-side arithmetic (with GPUs: the CPU backend, apart from them)."""
    try:
        return jax.local_devices(backend="cpu")[0]  # this process's own (multi-host: not process 0's)
    except RuntimeError:  # no CPU backend initialised (jax_platforms without cpu)
        return jax.local_devices()[0]


def group_advantage_slopes(groups: Sequence[Group], cfg: AdvantageConfig) -> np.ndarray:
    """[groups] d advantage / d reward of each group (`rl.advantage_slopes`, the estimator's own):
    `learner.deferred` finishes an early sample's gradient with it."""
    return advantage_slopes(np.stack([g.rewards for g in groups]).astype(np.float32), cfg)


def batch_fields(loss: Loss) -> tuple[str, ...]:
    """The fields of the micro-batches built for `loss` (a `rl.Loss`, e.g. `TrainStep.loss`): its
    required fields, the optional ones a trajectory supplies, and 'segment_ids' (rows are padded),
    in `TRAJECTORY_FIELDS` order. Raises ValueError naming any required field that trajectories
    do not supply (they supply exactly `TRAJECTORY_FIELDS`)."""
    missing = [k for k in loss.required_fields if k not in TRAJECTORY_FIELDS]
    if missing:
        raise ValueError(f"the loss {loss.name!r} requires {missing} (Loss.required_fields="
                         f"{list(loss.required_fields)}), which micro-batches built from trajectories do not "
                         f"carry: they carry {list(TRAJECTORY_FIELDS)}")
    wanted = set(loss.fields) | {"segment_ids"}
    replay = tuple(ROUTE_FIELDS) if loss.routing_replay == "r3" else ()
    return tuple(k for k in TRAJECTORY_FIELDS if k in wanted) + replay


def zero_microbatch(fields: Sequence[str], rows: int, width: int,
                    route_dims: tuple[int, int] | None = None) -> MicroBatch:
    """A compile warm-up micro-batch: the fields, shapes and dtypes real micro-batches of `fields` have.

    Args:
      fields: the fields to carry (`batch_fields(loss)`); must hold 'tokens'.
      rows: the row count.
      width: the row width in tokens.
      route_dims: (moe layers, top_k) of 'routes' (needed when `fields` holds it).
    Returns:
      A `MicroBatch` of all-zero host arrays `[rows, width]` (dtypes of `TRAJECTORY_FIELDS`; 'routes'
      `[rows, width, *route_dims]` int16), None for the fields not in `fields`.
    Raises:
      ValueError: a field trajectories do not carry, or 'routes' without `route_dims`.
      KeyError: `fields` has no 'tokens'.
    """
    _check_fields(fields, route_dims)
    dtypes = {**TRAJECTORY_FIELDS, **ROUTE_FIELDS}
    return MicroBatch.from_mapping(
        {k: np.zeros((rows, width) + (tuple(route_dims) if k == "routes" else ()), dtypes[k]) for k in fields})


def _check_fields(fields: Sequence[str], route_dims=None) -> None:
    unknown = [k for k in fields if k not in TRAJECTORY_FIELDS and k not in ROUTE_FIELDS]
    if unknown:
        raise ValueError(f"micro-batch fields {unknown} cannot be built from trajectories; they carry "
                         f"{list(TRAJECTORY_FIELDS) + list(ROUTE_FIELDS)}")
    if "routes" in fields and (route_dims is None or len(route_dims) != 2):
        raise ValueError(f"micro-batch field 'routes' needs route_dims=(moe layers, top_k), got {route_dims!r}")


def bucket_widths(seq_bucket: int, max_len: int) -> tuple[int, ...]:
    """The micro-batch widths: multiples of `seq_bucket` up to `max_len`, the last one capped at
    `max_len` (e.g. seq_bucket 32, max_len 80 -> (32, 64, 80)), ascending."""
    return tuple(sorted({min(k * seq_bucket, max_len) for k in range(1, -(-max_len // seq_bucket) + 1)}))


def _bucket(length: int, seq_bucket: int, max_len: int) -> int:
    """The narrowest width that holds `length` tokens (a longer-than-max_len length: itself)."""
    return min(max(seq_bucket, -(-length // seq_bucket) * seq_bucket), max(max_len, length))


@dataclasses.dataclass(frozen=True)
class RowShapes:
    """A fixed menu of [rows, width] micro-batch shapes that packing chooses from.

    widths: the allowed widths, ascending (`bucket_widths`). max_rows: the most rows a micro-batch
    takes (its trajectories, one per row, rounded up to `row_multiple`). row_multiple: row counts
    are multiples of it (the mesh's data-parallel size: rows that do not split over the `data`
    axis would be computed on every data shard alike). ladder: False = every multiple of
    row_multiple up to max_rows at every width; True = at every width the row counts
    row_multiple x {1, 2, 3, 4, 6, 8, 12, ...} (rungs 2^k and 3 x 2^(k-1): each at most 1.5x the
    one below) and max_rows, and every multiple at the widest width only (what a batch whose
    longest trajectory pins the width needs). The ladder bounds the menu to about len(widths) x
    2 log2(max_rows) + max_rows shapes with little padding lost: the width is then free to take
    up what the coarse row counts leave (8 trajectories of the real-model bench's lengths,
    simulated: 12.6 % padding on a 2x ladder, 9.7 % on this one, 9.5 % on every row count).
    """

    widths: tuple[int, ...]
    max_rows: int
    row_multiple: int = 1
    ladder: bool = False

    def __post_init__(self):
        if not self.widths or list(self.widths) != sorted(set(self.widths)) or self.widths[0] < 1:
            raise ValueError(f"RowShapes.widths must be ascending distinct ints >= 1, got {self.widths!r}")
        if self.row_multiple < 1 or self.max_rows < 1:
            raise ValueError(f"RowShapes: max_rows={self.max_rows} and row_multiple={self.row_multiple} must be >= 1")
        object.__setattr__(self, "max_rows", -(-self.max_rows // self.row_multiple) * self.row_multiple)

    def rows_at(self, width: int) -> tuple[int, ...]:
        """The row counts the menu allows at `width`, ascending: every multiple of row_multiple, or on a
        ladder (below the widest width) the rungs m x 2^k and m x 3 x 2^(k-1) and max_rows."""
        m, top = self.row_multiple, self.max_rows
        if not self.ladder or width == self.widths[-1]:
            return tuple(range(m, top + 1, m))
        rungs = {m << k for k in range(top.bit_length())} | {3 * m << k for k in range(top.bit_length())}
        return tuple(sorted({r for r in rungs if r <= top} | {top}))

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every (rows, width) of the menu: what a micro-step of packed rows can be."""
        return tuple((r, w) for w in self.widths for r in self.rows_at(w))


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where the trajectories of a micro-batch lie: `rows[j]` holds the indices (into the list
    the layout was made for) of the trajectories in row j, in column order, from column 0; a
    row may be empty (all padding). Every row is `width` wide."""

    width: int
    rows: tuple[tuple[int, ...], ...]

    @classmethod
    def one_per_row(cls, lengths: Sequence[int], seq_bucket: int, max_len: int) -> "RowLayout":
        """Trajectory i alone in row i; width: the longest rounded up to `seq_bucket` (capped at max_len)."""
        if not len(lengths):
            raise ValueError("a micro-batch needs at least one trajectory")
        return cls(_bucket(max(lengths), seq_bucket, max_len), tuple((i,) for i in range(len(lengths))))


def row_shapes(cfg, row_multiple: int = 1) -> RowShapes:
    """The packing menu of a `TrainerConfig` (`pack_rows`): every width of `bucket_widths`, up to
    one row per trajectory of a micro-batch (groups_per_microbatch x group_size). Without a row
    split (`microbatch_rows` 0) and without early samples it is a ladder (`RowShapes`), counts
    multiples of `row_multiple`; with either, the micro-step compiles every row count up to the
    micro-batch's already, so the menu holds them all (and a split ignores `row_multiple`: its
    micro-steps take `microbatch_rows` rows whatever the packing gave)."""
    split = bool(cfg.microbatch_rows)
    return RowShapes(bucket_widths(cfg.seq_bucket, cfg.max_len), cfg.groups_per_microbatch * cfg.group_size,
                     row_multiple=1 if split else row_multiple, ladder=not (split or cfg.early_groups))


def first_fit_decreasing(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Bins of at most `width` tokens: each trajectory, longest first (ties: lower index first),
    goes into the first bin it fits, else a new one. Returns per bin the indices, ascending."""
    used, bins = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, u in enumerate(used):
            if u + lengths[i] <= width:
                used[b] += lengths[i]
                bins[b].append(i)
                break
        else:
            used.append(lengths[i])
            bins.append([i])
    return [sorted(b) for b in bins]


def pack_rows(lengths: Sequence[int], shapes: RowShapes) -> RowLayout:
    """The packed layout of trajectories of these lengths: for each menu width that holds the
    longest, first-fit decreasing into rows of that width, row count rounded up to the menu's;
    the smallest rows x width wins (ties: the narrower width). Deterministic (module doc).

    A batch the menu cannot hold (more trajectories than `shapes.max_rows`, or one longer than the
    widest width) gets the shape it needs, off the menu (compiled when first met)."""
    if not len(lengths):
        raise ValueError("a micro-batch needs at least one trajectory")
    lengths = [int(n) for n in lengths]
    longest = max(lengths)
    widths = [w for w in shapes.widths if w >= longest] or [longest]
    best = None
    for w in widths:
        bins = first_fit_decreasing(lengths, w)
        counts = [r for r in shapes.rows_at(w) if r >= len(bins)] if w in shapes.widths else []
        # off the menu: the fewest rows that hold the bins (a multiple of row_multiple)
        rows = counts[0] if counts else -(-len(bins) // shapes.row_multiple) * shapes.row_multiple
        key = (rows * w, w)
        if best is None or key < best[0]:
            best = (key, w, bins, rows)
    _, width, bins, rows = best
    return RowLayout(width, tuple(tuple(b) for b in bins) + ((),) * (rows - len(bins)))


def microbatch_from_trajectories(trajs: Sequence[Trajectory], advantages: np.ndarray, seq_bucket: int,
                                 max_len: int, fields: Sequence[str] | None = None,
                                 route_dims: tuple[int, int] | None = None) -> MicroBatch:
    """A `MicroBatch` of host arrays [rows, width] for `grad_microstep`, one row per trajectory
    (`RowLayout.one_per_row`: rows = len(trajs), width = the longest rounded up to `seq_bucket`,
    capped at `max_len`). See `microbatch_from_layout` for the arguments and the fields."""
    layout = RowLayout.one_per_row([len(t.tokens) for t in trajs], seq_bucket, max_len) if trajs else None
    return microbatch_from_layout(trajs, advantages, layout, fields, route_dims)


def microbatch_from_layout(trajs: Sequence[Trajectory], advantages: np.ndarray, layout: RowLayout | None,
                           fields: Sequence[str] | None = None,
                           route_dims: tuple[int, int] | None = None) -> MicroBatch:
    """The micro-batch for `grad_microstep` of these trajectories, placed as `layout` says
    (`pack_rows` or `RowLayout.one_per_row`), each row's trajectories with segment ids 1, 2, ...
    and 0 after them.

    Args:
      trajs: the trajectories.
      advantages: one value per trajectory, [len(trajs)] (spread over its loss tokens).
      layout: where each trajectory lies (every one exactly once).
      fields: the fields to fill (`batch_fields(loss)`; must hold 'tokens'; a field trajectories do
        not carry raises ValueError naming it); None: every field in `TRAJECTORY_FIELDS`.
      route_dims: (moe layers, top_k) of 'routes' (needed when fields hold it; see the module doc).
    Returns:
      A `MicroBatch` of host arrays, rows = len(layout.rows), width = layout.width: 'tokens'
      [rows, width] int32, 'loss_mask' / 'advantages' (per token, 0 off the loss mask) /
      'rollout_logprobs' [rows, width] float32, 'segment_ids' [rows, width] int32, under routing
      replay 'routes' [rows, width, moe layers, top_k] int16 and 'routes_mask' [rows, width] int32;
      the fields not in `fields` are None.
    Raises:
      ValueError: the layout does not place every trajectory exactly once within its width, there
        is no trajectory, the advantages do not match them, or a field cannot be built.
      KeyError: `fields` has no 'tokens'.
    """
    fields = tuple(TRAJECTORY_FIELDS) if fields is None else tuple(fields)
    _check_fields(fields, route_dims)
    adv = np.asarray(advantages, np.float32).reshape(-1)
    if len(adv) != len(trajs):
        raise ValueError(f"{len(adv)} advantages for {len(trajs)} trajectories")
    if layout is None or not trajs:
        raise ValueError("a micro-batch needs at least one trajectory")
    placed = sorted(i for row in layout.rows for i in row)
    if placed != list(range(len(trajs))):
        raise ValueError(f"the row layout places trajectories {placed}, not each of 0..{len(trajs) - 1} once")
    shape = (len(layout.rows), layout.width)
    tokens = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.float32)
    logp = np.zeros(shape, np.float32)
    adv_tok = np.zeros(shape, np.float32)
    seg = np.zeros(shape, np.int32)
    replay = "routes" in fields or "routes_mask" in fields
    if replay:
        routes = np.zeros(shape + tuple(route_dims), ROUTE_FIELDS["routes"])
        held = np.zeros(shape, ROUTE_FIELDS["routes_mask"])
    for r, row in enumerate(layout.rows):
        col = 0
        for s, i in enumerate(row, start=1):
            t = trajs[i]
            n = len(t.tokens)
            if col + n > layout.width:
                raise ValueError(f"row {r} of the layout holds {col + n} tokens, more than its width {layout.width}")
            span = slice(col, col + n)
            tokens[r, span] = t.tokens
            mask[r, span] = t.loss_mask
            logp[r, span] = t.rollout_logprobs
            adv_tok[r, span] = adv[i] * mask[r, span]
            seg[r, span] = s
            if replay:
                _place_routes(t, routes[r, span], held[r, span], route_dims)
            col += n
    out = {"tokens": tokens, "loss_mask": mask, "advantages": adv_tok, "rollout_logprobs": logp, "segment_ids": seg}
    if replay:
        out["routes"], out["routes_mask"] = routes, held
    return MicroBatch.from_mapping({k: out[k] for k in fields})


def _place_routes(t: Trajectory, routes: np.ndarray, held: np.ndarray, route_dims) -> None:
    """Writes a trajectory's routes into its columns: routes [n, *route_dims], held [n] (views)."""
    if t.routes is None:
        if any(t.loss_mask):  # (a failed trajectory's mask is all zeros)
            raise ValueError(f"trajectory {t.task_id}/{t.sample_index} has no routes but routing replay "
                             "trains on them: the engine must record them (Engine(record_routes=True)) and the rollout "
                             "keep them (TrajectoryBuilder.append_completion)")
        return
    if t.routes.shape[1:] != tuple(route_dims):
        raise ValueError(f"trajectory {t.task_id}/{t.sample_index}: routes {t.routes.shape} are not "
                         f"[tokens, {route_dims[0]} moe layers, top_k {route_dims[1]}]")
    # routes cover at most the trajectory's own tokens (`Trajectory.check`): never the next segment's
    n = min(len(t.routes), len(routes))
    routes[:n] = t.routes[:n]
    held[:n] = 1
