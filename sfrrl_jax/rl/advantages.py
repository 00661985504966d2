"""Advantage estimators of the GRPO family, from outcome rewards of grouped samples.

Rewards come as `[groups, G]`: the G samples of one prompt form a group. Every estimator returns
advantages of the same shape; `broadcast_to_tokens` turns per-sample advantages into the per-token
`[batch, seq]` layout the loss takes. Groups with no contrast (G = 1, or all rewards equal) get
advantage 0 from the group-baselined estimators: they carry no learning signal.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from sfrrl_jax.rl.config import AdvantageConfig
from sfrrl_jax.rl.kl import kl_estimate


def _check_grouped(rewards: jnp.ndarray, fn: str) -> None:
    if rewards.ndim != 2:
        raise ValueError(f"{fn}: rewards must be [groups, G], got shape {tuple(rewards.shape)}")


def _group_std(rewards: jnp.ndarray, ddof: int) -> jnp.ndarray:
    """Per-group std, [groups, 1]; 0 where the group is too small for the requested ddof."""
    g = rewards.shape[-1]
    if g - ddof <= 0:
        return jnp.zeros(rewards.shape[:-1] + (1,), rewards.dtype)
    return jnp.std(rewards, axis=-1, keepdims=True, ddof=ddof)


def grpo_advantages(rewards: jnp.ndarray, eps: float = 1e-6, std_ddof: int = 0) -> jnp.ndarray:
    """GRPO advantages: (r - group mean) / (group std + eps), per group.

    Branches only on static shapes, so it traces under `jax.jit`. A group with no contrast gets 0: its
    centred rewards are 0, and where G - std_ddof <= 0 (e.g. G = 1 with `std_ddof=1`) the std is taken as 0.

    Args:
      rewards: `[groups, G]` float rewards; row i holds the G samples of prompt i.
      eps: added to the group std in the denominator (avoids division by 0 for constant groups).
      std_ddof: delta degrees of freedom of the group std: 0 = population std (divide by G), 1 = unbiased
        (divide by G - 1).
    Returns:
      `[groups, G]` advantages, the dtype of `rewards`.
    Raises:
      ValueError: `rewards` is not 2-D.
    """
    _check_grouped(rewards, "grpo_advantages")
    centred = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
    return centred / (_group_std(rewards, std_ddof) + eps)


def dr_grpo_advantages(rewards: jnp.ndarray) -> jnp.ndarray:
    """Dr. GRPO advantages: r - group mean (no std normalisation).

    Args:
      rewards: `[groups, G]` float rewards; row i holds the G samples of prompt i.
    Returns:
      `[groups, G]` advantages, the dtype of `rewards`; each row sums to 0.
    Raises:
      ValueError: `rewards` is not 2-D.
    """
    _check_grouped(rewards, "dr_grpo_advantages")
    return rewards - jnp.mean(rewards, axis=-1, keepdims=True)


def rloo_advantages(rewards: jnp.ndarray) -> jnp.ndarray:
    """RLOO advantages: r_i - mean_{j != i} r_j = G/(G-1) * (r_i - group mean).

    A group of one sample has no leave-one-out baseline: its advantage is 0.

    Args:
      rewards: `[groups, G]` float rewards; row i holds the G samples of prompt i.
    Returns:
      `[groups, G]` advantages (zeros when G = 1).
    Raises:
      ValueError: `rewards` is not 2-D.
    """
    _check_grouped(rewards, "rloo_advantages")
    g = rewards.shape[-1]
    if g == 1:
        return jnp.zeros_like(rewards)
    return (g / (g - 1)) * (rewards - jnp.mean(rewards, axis=-1, keepdims=True))


def _masked_whiten(x: jnp.ndarray, mask: jnp.ndarray | None, eps: float, ddof: int) -> jnp.ndarray:
    """(x - mean) / (std + eps) over the entries where mask is set; masked-out entries give 0."""
    m = jnp.ones_like(x) if mask is None else mask.astype(x.dtype)
    n = jnp.sum(m)
    mean = jnp.sum(x * m) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.square(x - mean) * m) / jnp.maximum(n - ddof, 1.0)
    var = jnp.where(n - ddof > 0, var, 0.0)
    return (x - mean) / (jnp.sqrt(var) + eps) * m


def reinforce_pp_advantages(
    rewards: jnp.ndarray,
    mask: jnp.ndarray | None = None,
    eps: float = 1e-6,
    std_ddof: int = 0,
    group_baseline: bool = False,
) -> jnp.ndarray:
    """REINFORCE++ advantages: rewards whitened over the whole batch (global mean and std).

    With n = sum(mask): mean = sum(x * mask) / n, var = sum((x - mean)^2 * mask) / (n - std_ddof)
    (0 when n - std_ddof <= 0), and the advantage is (x - mean) / (sqrt(var) + eps) * mask.
    `group_baseline=True` (REINFORCE++-baseline) first replaces x by x - group mean (the mean of all G
    samples of the group, masked or not).

    Args:
      rewards: `[groups, G]` float rewards (or any shape when `group_baseline` is False).
      mask: optional 0/1 array of the shape of `rewards`: the samples that count in the batch statistics
        (e.g. those that survived filtering); masked-out samples get advantage 0. None: every sample counts.
      eps: added to the batch std in the denominator.
      std_ddof: delta degrees of freedom of the batch std (0 = population, 1 = unbiased).
      group_baseline: subtract each group's mean before whitening (needs `[groups, G]` rewards).
    Returns:
      Advantages of the shape of `rewards`, 0 where `mask` is 0.
    Raises:
      ValueError: `group_baseline` is True and `rewards` is not 2-D.
    """
    x = rewards
    if group_baseline:
        _check_grouped(rewards, "reinforce_pp_advantages(group_baseline=True)")
        x = dr_grpo_advantages(rewards)
    return _masked_whiten(x, mask, eps, std_ddof)


# -- slopes: d advantage / d reward within a group ------------------------------------------------
# The group estimators are affine in the rewards of a group: A_i = slope * (r_i - r_j) + A_j for any
# two samples i, j. A gradient back-propagated before the group's advantages exist
# (`learner.deferred`) is finished with its slope. Host-side numpy, [groups, G] -> [groups] float32.
def _grpo_slopes(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    g = rewards.shape[-1]
    std = rewards.std(axis=-1, ddof=cfg.std_ddof) if g - cfg.std_ddof > 0 else np.zeros(len(rewards))
    return (1.0 / (std + np.float32(cfg.eps))).astype(np.float32)


def _dr_grpo_slopes(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    return np.ones(len(rewards), np.float32)


def _rloo_slopes(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    g = rewards.shape[-1]
    return np.full(len(rewards), 0.0 if g == 1 else g / (g - 1), np.float32)


@dataclasses.dataclass(frozen=True)
class Estimator:
    """An advantage estimator: its advantages and, where it has one, its per-group slope.

    Attributes:
      advantages: `(rewards [groups, G], cfg, mask [groups, G] | None) -> [groups, G]` advantages (traceable).
      slope: `(rewards [groups, G] numpy, cfg) -> [groups]` float32 d advantage / d reward within each group,
        for estimators affine in a group's rewards (host-side); None where the advantages depend on
        other groups (batch-normalised estimators), so no per-group slope exists.
    """

    advantages: Callable[..., jnp.ndarray]
    slope: Callable[[np.ndarray, AdvantageConfig], np.ndarray] | None = None


# `AdvantageConfig.estimator` -> the estimator: one entry per estimator, its advantages beside its slope.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(lambda r, cfg, mask: grpo_advantages(r, cfg.eps, cfg.std_ddof), _grpo_slopes),
    "dr_grpo": Estimator(lambda r, cfg, mask: dr_grpo_advantages(r), _dr_grpo_slopes),
    "rloo": Estimator(lambda r, cfg, mask: rloo_advantages(r), _rloo_slopes),
    "reinforce_pp": Estimator(lambda r, cfg, mask: reinforce_pp_advantages(r, mask, cfg.eps, cfg.std_ddof)),
    "reinforce_pp_baseline": Estimator(
        lambda r, cfg, mask: reinforce_pp_advantages(r, mask, cfg.eps, cfg.std_ddof, group_baseline=True)),
}


def _estimator(cfg: AdvantageConfig, fn: str) -> Estimator:
    if cfg.estimator not in ESTIMATORS:
        raise ValueError(f"{fn}: unknown estimator {cfg.estimator!r}; valid: {sorted(ESTIMATORS)}")
    return ESTIMATORS[cfg.estimator]


def compute_advantages(
    rewards: jnp.ndarray, cfg: AdvantageConfig, mask: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Advantages by the estimator `cfg.estimator` names (see `AdvantageConfig`; `ESTIMATORS`).

    'grpo' -> `grpo_advantages(rewards, cfg.eps, cfg.std_ddof)`, 'dr_grpo' -> `dr_grpo_advantages`,
    'rloo' -> `rloo_advantages`, 'reinforce_pp' / 'reinforce_pp_baseline' -> `reinforce_pp_advantages`
    (with `group_baseline` for the latter). `cfg` is hashable, so it can be a static argument of `jax.jit`.

    Args:
      rewards: `[groups, G]` float rewards; row i holds the G samples of prompt i.
      cfg: the estimator and its `eps` / `std_ddof`.
      mask: optional 0/1 `[groups, G]` samples that count. Only used by the batch-normalised estimators
        (REINFORCE++), whose statistics span groups; group estimators are unaffected by other groups by
        construction.
    Returns:
      `[groups, G]` advantages.
    Raises:
      ValueError: unknown `cfg.estimator`, or `rewards` not 2-D (where the estimator needs groups).
    """
    return _estimator(cfg, "compute_advantages").advantages(rewards, cfg, mask)


def advantage_slopes(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    """d advantage / d reward within each group, for the estimator `cfg.estimator` names (`Estimator.slope`).

    The group estimators are affine in a group's rewards: A_i = slope * (r_i - r_j) + A_j for any two
    samples i, j, which lets a gradient taken before the group finished be completed later
    (`learner.deferred`). Host-side (numpy).

    Args:
      rewards: `[groups, G]` float rewards.
      cfg: the estimator and its `eps` / `std_ddof`.
    Returns:
      `[groups]` float32 slopes (GRPO: 1 / (group std + eps); Dr. GRPO: 1; RLOO: G / (G - 1), 0 for G = 1).
    Raises:
      ValueError: the estimator has no per-group slope (REINFORCE++ normalises over the batch), or is unknown.
    """
    est = _estimator(cfg, "advantage_slopes")
    if est.slope is None:
        with_slope = sorted(k for k, e in ESTIMATORS.items() if e.slope is not None)
        raise ValueError(f"advantage estimator {cfg.estimator!r} is not a per-group affine function of the "
                         f"reward; advantage-deferred gradients need one of {', '.join(with_slope)}")
    rewards = np.asarray(rewards, np.float32)
    _check_grouped(rewards, "advantage_slopes")
    return est.slope(rewards, cfg)


def broadcast_to_tokens(advantages: jnp.ndarray, loss_mask: jnp.ndarray) -> jnp.ndarray:
    """Per-sample advantages -> per-token `[batch, seq]`, zero where `loss_mask` is 0.

    Args:
      advantages: `[batch]` or `[groups, G]` per-sample advantages (flattened row-major to
        `[groups * G]` = batch).
      loss_mask: `[batch, seq]` 0/1 loss mask.
    Returns:
      `[batch, seq]` token advantages `advantages[b] * loss_mask[b, t]`, the dtype of `advantages`.
    Raises:
      ValueError: `loss_mask` is not 2-D, or its batch size differs from the number of advantages.
    """
    adv = jnp.reshape(advantages, (-1,))
    if loss_mask.ndim != 2 or adv.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"broadcast_to_tokens: advantages {tuple(advantages.shape)} hold {adv.shape[0]} samples "
            f"but loss_mask is {tuple(loss_mask.shape)} (need [batch, seq] with batch = samples)"
        )
    return adv[:, None] * loss_mask.astype(adv.dtype)


def kl_shaped_rewards(
    rewards: jnp.ndarray,
    logprobs: jnp.ndarray,
    ref_logprobs: jnp.ndarray,
    loss_mask: jnp.ndarray,
    coef: float,
    estimator: str = "k1",
) -> jnp.ndarray:
    """KL as reward shaping: r - coef * sum over the sample's loss tokens of KL(pi || ref).

    Apply it before computing advantages (and keep `LossConfig.kl_coef` = 0 then).

    Args:
      rewards: `[batch]` float per-sample rewards.
      logprobs: `[batch, seq]` float log-probs of the sampled tokens under the sampling policy.
      ref_logprobs: `[batch, seq]` float log-probs of the same tokens under the reference policy.
      loss_mask: `[batch, seq]` 0/1 mask of the tokens whose KL counts.
      coef: KL coefficient (0 leaves the rewards unchanged).
      estimator: per-token KL estimator, 'k1', 'k2' or 'k3' (see `rl.kl.kl_estimate`).
    Returns:
      `[batch]` shaped rewards.
    Raises:
      ValueError: unknown `estimator`.
    """
    kl = kl_estimate(logprobs, ref_logprobs, estimator) * loss_mask
    return rewards - coef * jnp.sum(kl, axis=-1)


def reinforce_pp_token_advantages(
    rewards: jnp.ndarray,
    loss_mask: jnp.ndarray,
    kl: jnp.ndarray | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-6,
) -> jnp.ndarray:
    """REINFORCE++ with per-token KL shaping (gamma = 1), whitened over all loss tokens.

    The return of token t is the outcome reward minus kl_coef times the KL still to come:
    G_t = r - kl_coef * sum_{s >= t} kl_s (loss tokens only). The returns are then whitened over every
    loss token of the batch: (G_t - mean) / (std + eps), population std (ddof 0).

    Args:
      rewards: `[batch]` float per-sample outcome rewards.
      loss_mask: `[batch, seq]` 0/1 loss mask.
      kl: optional `[batch, seq]` float per-token KL estimates (e.g. `rl.kl.kl_estimate`); None: no
        shaping.
      kl_coef: KL coefficient; 0 disables the shaping.
      eps: added to the std in the denominator.
    Returns:
      `[batch, seq]` float32 token advantages (0 off the loss mask).
    """
    m = loss_mask.astype(jnp.float32)
    returns = jnp.broadcast_to(rewards[:, None], m.shape).astype(jnp.float32)
    if kl is not None and kl_coef != 0.0:
        future_kl = jnp.flip(jnp.cumsum(jnp.flip(kl * m, -1), -1), -1)
        returns = returns - kl_coef * future_kl
    return _masked_whiten(returns, m, eps, 0)
