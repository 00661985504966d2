"""Per-token estimators of KL(pi || ref) from log-probs of the sampled tokens (Schulman's k1/k2/k3).

With log_ratio = logp - ref_logp (tokens sampled from pi):
  k1 = log_ratio                        unbiased, high variance, can be negative
  k2 = log_ratio**2 / 2                 biased, low variance, >= 0
  k3 = exp(-log_ratio) - 1 + log_ratio  unbiased, low variance, >= 0
The log-ratio is clamped to [-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP] before k3's exp so one
far-off token cannot overflow the loss.
"""
from __future__ import annotations

import jax.numpy as jnp

KL_LOG_RATIO_CLAMP = 20.0


def kl_estimate(logp: jnp.ndarray, ref_logp: jnp.ndarray, estimator: str) -> jnp.ndarray:
    """Per-token estimate of KL(pi || ref), with log_ratio = logp - ref_logp (see the module doc).

    k1 = log_ratio, k2 = log_ratio**2 / 2, k3 = exp(-log_ratio) - 1 + log_ratio (log_ratio clamped to
    [-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP] first).

    Args:
      logp: `[batch, seq]` float log-probs of the sampled tokens under pi.
      ref_logp: `[batch, seq]` float log-probs of the same tokens under the reference.
      estimator: 'k1', 'k2' or 'k3'.
    Returns:
      The per-token estimate, same shape as the inputs (`[batch, seq]`); not masked.
    Raises:
      ValueError: unknown `estimator`.
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    if estimator == "k3":
        lr = jnp.clip(log_ratio, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        return jnp.exp(-lr) - 1.0 + lr
    raise ValueError(f"kl_estimate: unknown estimator {estimator!r}; valid: ['k1', 'k2', 'k3']")
