"""Which tokens form a sequence, and how per-token losses become one scalar.

A row of a `[batch, seq]` batch holds one sequence, or several packed ones told apart by
`segment_ids` (a new sequence starts wherever the id changes along the row). Every aggregation is
written as `numerator / denominator` where both are *sums over sequences*: a micro-batch adds its
numerator and its denominator count to an accumulator, and the quotient taken once at the end is
exactly the full-batch value, whatever the split (no sequence is ever split across micro-batches).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


class SequenceLayout:
    """Maps every token of a `[batch, seq]` array to the sequence it belongs to.

    segment_ids None: one sequence per row. Otherwise sequences are the maximal runs of equal
    segment id within a row (padding, id 0 by convention, forms runs too; it carries no loss
    tokens, so it never counts).

    Args:
      shape: the `(batch, seq)` shape of the arrays it maps.
      segment_ids: optional `[batch, seq]` int segment ids of packed rows; None: one sequence per row.
    Attributes:
      shape: `(batch, seq)`.
      num_slots: length of the per-sequence arrays (`sum`, `gather`): batch without segment ids, else
        batch * seq (one slot per possible run; unused slots hold 0).
    Raises:
      ValueError: `shape` is not 2-D, or `segment_ids` has another shape.
    """

    def __init__(self, shape: tuple[int, int], segment_ids: jnp.ndarray | None = None):
        if len(shape) != 2:
            raise ValueError(f"SequenceLayout: need a [batch, seq] shape, got {shape}")
        self.shape = tuple(shape)
        b, t = self.shape
        if segment_ids is None:
            self._ids = None
            self.num_slots = b
        else:
            if tuple(segment_ids.shape) != self.shape:
                raise ValueError(f"SequenceLayout: segment_ids shape {tuple(segment_ids.shape)} != {self.shape}")
            starts = jnp.concatenate(
                [jnp.ones((b, 1), jnp.int32), (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)],
                axis=1,
            )
            run = jnp.cumsum(starts, axis=1) - 1  # in [0, seq)
            self._ids = (jnp.arange(b, dtype=jnp.int32)[:, None] * t + run).reshape(-1)
            self.num_slots = b * t

    def sum(self, x: jnp.ndarray) -> jnp.ndarray:
        """Per-sequence sums of a [batch, seq] array -> [num_slots] (unused slots are 0)."""
        if self._ids is None:
            return jnp.sum(x, axis=-1)
        return jax.ops.segment_sum(x.reshape(-1), self._ids, num_segments=self.num_slots)

    def gather(self, per_sequence: jnp.ndarray) -> jnp.ndarray:
        """Broadcasts per-sequence values [num_slots] back to every token -> [batch, seq]."""
        if self._ids is None:
            return jnp.broadcast_to(per_sequence[:, None], self.shape)
        return per_sequence[self._ids].reshape(self.shape)

    def token_counts(self, mask: jnp.ndarray) -> jnp.ndarray:
        """Loss tokens per sequence, [num_slots] float32."""
        return self.sum(mask.astype(jnp.float32))

    def mean(self, x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
        """Per-sequence masked mean, [num_slots] (0 for sequences with no loss token)."""
        m = mask.astype(jnp.float32)
        return self.sum(x * m) / jnp.maximum(self.token_counts(m), 1.0)


def aggregation_parts(
    per_token: jnp.ndarray,
    mask: jnp.ndarray,
    layout: SequenceLayout,
    mode: str,
    norm_length: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(numerator, denominator) of the aggregation over this (micro-)batch; both are sums.

    The loss is sum(numerators) / max(sum(denominators), 1) over the micro-batches:
      token_mean               sum(l * m)                           / #loss tokens
      seq_mean_token_sum       sum(l * m)                           / #sequences
      seq_mean_token_sum_norm  sum(l * m) / norm_length             / #sequences
      seq_mean_token_mean      sum_s (sum_{t in s} l m / n_s)       / #sequences
    A sequence counts only if it has at least one loss token (filtered or padding rows don't).

    Args:
      per_token: `[batch, seq]` per-token losses l (any float dtype; computed in float32).
      mask: `[batch, seq]` 0/1 loss mask m.
      layout: the `SequenceLayout` of this `[batch, seq]` batch (unused by 'token_mean').
      mode: one of the aggregations above (`LossConfig.aggregation`).
      norm_length: the fixed length of 'seq_mean_token_sum_norm' (e.g. the max response length); ignored
        by the other modes.
    Returns:
      `(numerator, denominator)`, float32 scalars; the numerator is differentiable in `per_token`.
    Raises:
      ValueError: unknown `mode`, or 'seq_mean_token_sum_norm' with `norm_length` None.
    """
    m = mask.astype(jnp.float32)
    lm = per_token.astype(jnp.float32) * m
    if mode == "token_mean":
        return jnp.sum(lm), jnp.sum(m)
    counts = layout.token_counts(m)
    num_seqs = jnp.sum((counts > 0).astype(jnp.float32))
    if mode == "seq_mean_token_sum":
        return jnp.sum(lm), num_seqs
    if mode == "seq_mean_token_sum_norm":
        if norm_length is None:
            raise ValueError("aggregation 'seq_mean_token_sum_norm' needs norm_length")
        return jnp.sum(lm) / float(norm_length), num_seqs
    if mode == "seq_mean_token_mean":
        return jnp.sum(layout.sum(lm) / jnp.maximum(counts, 1.0)), num_seqs
    raise ValueError(
        f"unknown aggregation {mode!r}; valid: ['token_mean', 'seq_mean_token_sum', "
        "'seq_mean_token_mean', 'seq_mean_token_sum_norm']"
    )


def aggregate(
    per_token: jnp.ndarray,
    mask: jnp.ndarray,
    layout: SequenceLayout,
    mode: str,
    norm_length: int | None = None,
) -> jnp.ndarray:
    """The aggregated scalar over one whole batch (0 if it holds no loss token).

    numerator / max(denominator, 1) of `aggregation_parts`, which describes the modes.

    Args:
      per_token: `[batch, seq]` per-token losses (any float dtype; computed in float32).
      mask: `[batch, seq]` 0/1 loss mask.
      layout: the `SequenceLayout` of this `[batch, seq]` batch.
      mode: 'token_mean', 'seq_mean_token_sum', 'seq_mean_token_mean' or 'seq_mean_token_sum_norm'.
      norm_length: the fixed length of 'seq_mean_token_sum_norm'; ignored by the other modes.
    Returns:
      The loss, a float32 scalar.
    Raises:
      ValueError: unknown `mode`, or 'seq_mean_token_sum_norm' with `norm_length` None.
    """
    num, den = aggregation_parts(per_token, mask, layout, mode, norm_length)
    return num / jnp.maximum(den, 1.0)
