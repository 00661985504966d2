"""Sample filters, returned as masks plus counts (the caller decides what to drop).

- Dynamic sampling (DAPO): a group whose G rewards are all equal has zero advantage under every
  group-baselined estimator; it adds no signal but does count in loss normalisers. Drop it.
- Overlong handling (DAPO): truncated responses either leave the loss ('mask') or are penalised in
  proportion to how far they run into the last `buffer` tokens of the budget ('soft').
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from sfrrl_jax.rl.config import OverlongConfig


class GroupFilter(NamedTuple):
    """Result of `zero_variance_groups`.

    Attributes:
      keep_groups: `[groups]` bool, True for the groups to keep.
      keep_samples: `[groups, G]` bool, the group's bit repeated over its samples.
      num_kept: int32 scalar, groups kept.
      num_dropped: int32 scalar, groups dropped.
    """

    keep_groups: jnp.ndarray   # [groups] bool
    keep_samples: jnp.ndarray  # [groups, G] bool (the group's bit repeated)
    num_kept: jnp.ndarray      # scalar int32: groups kept
    num_dropped: jnp.ndarray   # scalar int32: groups dropped


def zero_variance_groups(rewards: jnp.ndarray, atol: float = 0.0) -> GroupFilter:
    """Dynamic sampling: keep groups whose rewards are not all equal (max - min > atol).

    A group of a single sample has no variance and is dropped (for `atol` >= 0).

    Args:
      rewards: `[groups, G]` rewards; row i holds the G samples of prompt i.
      atol: a group is kept when its reward spread max - min exceeds this.
    Returns:
      A `GroupFilter`: the kept groups and samples as bool masks, and the kept/dropped group counts.
    Raises:
      ValueError: `rewards` is not 2-D.
    """
    if rewards.ndim != 2:
        raise ValueError(f"zero_variance_groups: rewards must be [groups, G], got {tuple(rewards.shape)}")
    spread = jnp.max(rewards, axis=-1) - jnp.min(rewards, axis=-1)
    keep = spread > atol
    kept = jnp.sum(keep.astype(jnp.int32))
    return GroupFilter(keep, jnp.broadcast_to(keep[:, None], rewards.shape), kept,
                       jnp.int32(rewards.shape[0]) - kept)


class OverlongResult(NamedTuple):
    """Result of `overlong_filter`.

    Attributes:
      rewards: `[batch]` rewards after the soft penalty (unchanged in 'mask' mode).
      keep_samples: `[batch]` bool, the samples that stay in the loss (all True in 'soft' mode).
      num_overlong: int32 scalar, samples masked ('mask') or penalised ('soft').
    """

    rewards: jnp.ndarray       # [batch] rewards after the soft penalty (unchanged in 'mask' mode)
    keep_samples: jnp.ndarray  # [batch] bool: samples that stay in the loss
    num_overlong: jnp.ndarray  # scalar int32: samples masked ('mask') or penalised ('soft')


def overlong_filter(
    rewards: jnp.ndarray,
    lengths: jnp.ndarray,
    cfg: OverlongConfig,
    truncated: jnp.ndarray | None = None,
) -> OverlongResult:
    """Overlong masking ('mask') or soft punishment ('soft'), as `cfg.mode` says.

    'mask' drops the truncated samples from the loss. In 'soft' mode the penalty depends on the length
    only: penalty = cfg.penalty * clip((length - (max_length - buffer)) / buffer, 0, 1) is subtracted from
    the reward (with `buffer` 0: the full penalty for length > max_length, else none).

    Args:
      rewards: `[batch]` float rewards.
      lengths: `[batch]` response lengths in tokens (int or float).
      cfg: the mode, `max_length` (response budget), `buffer` and `penalty`.
      truncated: optional `[batch]` bool, used in 'mask' mode only: the sample hit the budget without
        finishing; defaults to lengths >= cfg.max_length.
    Returns:
      An `OverlongResult`: the (penalised) rewards, the `[batch]` bool samples to keep, and the number
        of samples masked or penalised.
    Raises:
      ValueError: `rewards` and `lengths` are not both `[batch]` (1-D, same shape).
    """
    if rewards.shape != lengths.shape or rewards.ndim != 1:
        raise ValueError(f"overlong_filter: rewards {tuple(rewards.shape)} and lengths "
                         f"{tuple(lengths.shape)} must both be [batch]")
    lengths = lengths.astype(jnp.float32)
    if cfg.mode == "mask":
        trunc = lengths >= cfg.max_length if truncated is None else truncated.astype(bool)
        return OverlongResult(rewards, ~trunc, jnp.sum(trunc.astype(jnp.int32)))
    start = cfg.max_length - cfg.buffer
    if cfg.buffer == 0:
        frac = (lengths > cfg.max_length).astype(jnp.float32)
    else:
        frac = jnp.clip((lengths - start) / cfg.buffer, 0.0, 1.0)
    penalised = frac > 0
    return OverlongResult(rewards - cfg.penalty * frac, jnp.ones(rewards.shape, bool),
                          jnp.sum(penalised.astype(jnp.int32)))


def apply_sample_mask(loss_mask: jnp.ndarray, keep_samples: jnp.ndarray) -> jnp.ndarray:
    """Zeroes the loss mask of dropped samples.

    Args:
      loss_mask: `[batch, seq]` 0/1 loss mask.
      keep_samples: `[batch]` or `[groups, G]` bool, True for the samples to keep (flattened row-major
        to `[groups * G]` = batch).
    Returns:
      `[batch, seq]` loss mask, the dtype of `loss_mask`, with the rows of dropped samples zeroed.
    Raises:
      ValueError: the number of keep bits differs from the batch size of `loss_mask`.
    """
    keep = jnp.reshape(keep_samples, (-1,))
    if keep.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"apply_sample_mask: {keep.shape[0]} keep bits for loss_mask {tuple(loss_mask.shape)}")
    return loss_mask * keep[:, None].astype(loss_mask.dtype)
