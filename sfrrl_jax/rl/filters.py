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
    keep_groups: jnp.ndarray   # [groups] bool
    keep_samples: jnp.ndarray  # [groups, G] bool (the group's bit repeated)
    num_kept: jnp.ndarray      # scalar int32: groups kept
    num_dropped: jnp.ndarray   # scalar int32: groups dropped


def zero_variance_groups(rewards: jnp.ndarray, atol: float = 0.0) -> GroupFilter:
    """Dynamic sampling: keep groups whose rewards are not all equal (max - min > atol).

    rewards: [groups, G]. A group of a single sample has no variance and is dropped.
    """
    if rewards.ndim != 2:
        raise ValueError(f"zero_variance_groups: rewards must be [groups, G], got {tuple(rewards.shape)}")
    spread = jnp.max(rewards, axis=-1) - jnp.min(rewards, axis=-1)
    keep = spread > atol
    kept = jnp.sum(keep.astype(jnp.int32))
    return GroupFilter(keep, jnp.broadcast_to(keep[:, None], rewards.shape), kept,
                       jnp.int32(rewards.shape[0]) - kept)


class OverlongResult(NamedTuple):
    rewards: jnp.ndarray       # [batch] rewards after the soft penalty (unchanged in 'mask' mode)
    keep_samples: jnp.ndarray  # [batch] bool: samples that stay in the loss
    num_overlong: jnp.ndarray  # scalar int32: samples masked ('mask') or penalised ('soft')


def overlong_filter(
    rewards: jnp.ndarray,
    lengths: jnp.ndarray,
    cfg: OverlongConfig,
    truncated: jnp.ndarray | None = None,
) -> OverlongResult:
    """Overlong masking or soft punishment. rewards, lengths: [batch] (response lengths in tokens).

    truncated (optional [batch] bool): the sample hit the budget without finishing; defaults to
    lengths >= cfg.max_length. In 'soft' mode the penalty depends on the length only:
    penalty = cfg.penalty * clip((length - (max_length - buffer)) / buffer, 0, 1).
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
    """Zeroes the loss mask of dropped samples. loss_mask [batch, seq], keep_samples [batch] or
    [groups, G] (flattened row-major)."""
    keep = jnp.reshape(keep_samples, (-1,))
    if keep.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"apply_sample_mask: {keep.shape[0]} keep bits for loss_mask {tuple(loss_mask.shape)}")
    return loss_mask * keep[:, None].astype(loss_mask.dtype)
