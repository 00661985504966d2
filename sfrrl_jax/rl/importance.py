"""Train/inference mismatch correction: importance weights pi_behavior / pi_rollout.

The engine samples with its own kernels (and maybe another precision); the log-probs it records
(`rollout_logprobs`) differ from the training forward's. The policy gradient is then off-policy by
w = pi_behavior(y) / pi_rollout(y). Two corrections, at token or sequence level:
  TIS (truncated IS):        weight = min(w, cap)
  MIS (masked IS, IcePop):   weight = w if low <= w <= high, else 0 (the token/sequence is masked)
Sequence-level w is the product of the sequence's token ratios ('sequence') or their geometric
mean ('geo_sequence'). Weights carry no gradient.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sfrrl_jax.rl.aggregation import SequenceLayout

# exp() of a log-weight beyond this is clamped (a sequence-level product can be astronomically
# large or small; TIS truncates it anyway and MIS masks it).
LOG_WEIGHT_CLAMP = 30.0


class ISWeights(NamedTuple):
    """Result of `mismatch_weights`; every field is `[batch, seq]` float32, 0 off the loss mask.

    Attributes:
      weight: the weight to multiply the per-token policy loss by (no grad).
      raw: the untruncated w of each token's unit (token or sequence).
      rejected: 1 where TIS truncated / MIS masked, else 0.
    """

    weight: jnp.ndarray   # [batch, seq] weight to multiply the per-token policy loss by (no grad)
    raw: jnp.ndarray      # [batch, seq] the untruncated w of each token's unit (token or sequence)
    rejected: jnp.ndarray  # [batch, seq] 1 where TIS truncated / MIS masked, else 0


def mismatch_weights(
    behavior_logp: jnp.ndarray,
    rollout_logp: jnp.ndarray,
    mask: jnp.ndarray,
    layout: SequenceLayout,
    correction: str,
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> ISWeights:
    """Importance weights for `correction` in {'none', 'tis', 'mis'}; all arrays `[batch, seq]`.

    log w = behavior_logp - rollout_logp per loss token; at sequence level it is summed ('sequence') or
    averaged ('geo_sequence') over the sequence's loss tokens and broadcast back to them. w itself is
    exp(log w) with log w clamped to [-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP]. Then 'none': weight = 1;
    'tis': weight = min(w, cap); 'mis': weight = w where low <= w <= high, else 0.

    Args:
      behavior_logp: `[batch, seq]` float log-probs of the policy the gradient is taken for (detached
        here with `stop_gradient`).
      rollout_logp: `[batch, seq]` float: the engine's log-probs of the same tokens.
      mask: `[batch, seq]` 0/1 loss mask.
      layout: the `SequenceLayout` of the batch (which tokens form a sequence).
      correction: 'none', 'tis' or 'mis'.
      level: 'token' (per-token w), 'sequence' (product of the sequence's token ratios) or
        'geo_sequence' (their geometric mean).
      cap: the TIS truncation threshold.
      low: the lower bound of the MIS keep range.
      high: the upper bound of the MIS keep range.
    Returns:
      `ISWeights` (`weight`, `raw`, `rejected`), each `[batch, seq]` float32 and 0 off the mask.
    Raises:
      ValueError: unknown `level` or `correction`.
    """
    m = mask.astype(jnp.float32)
    log_w = (jax.lax.stop_gradient(behavior_logp) - rollout_logp).astype(jnp.float32) * m
    if level == "sequence":
        log_w = layout.gather(layout.sum(log_w))
    elif level == "geo_sequence":
        log_w = layout.gather(layout.mean(log_w, m))
    elif level != "token":
        raise ValueError(f"mismatch_weights: unknown level {level!r}; valid: ['token', 'sequence', 'geo_sequence']")
    raw = jnp.exp(jnp.clip(log_w, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)) * m
    if correction == "none":
        return ISWeights(m, raw, jnp.zeros_like(m))
    if correction == "tis":
        rejected = (raw > cap).astype(jnp.float32) * m
        return ISWeights(jnp.minimum(raw, cap) * m, raw, rejected)
    if correction == "mis":
        keep = ((raw >= low) & (raw <= high)).astype(jnp.float32) * m
        return ISWeights(raw * keep, raw, m - keep)
    raise ValueError(f"mismatch_weights: unknown correction {correction!r}; valid: ['none', 'tis', 'mis']")
