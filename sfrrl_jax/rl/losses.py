"""Policy-gradient and SFT objectives over `[batch, seq]` per-token log-probs.

All inputs here are *target-aligned*: entry [b, t] belongs to one predicted token (its log-prob,
its loss-mask bit, its advantage, its rollout log-prob). The objective is returned as the parts of
an exact accumulation (see `rl.aggregation`): a numerator and a denominator that are sums over
sequences, and metric sums/maxima/minima, so micro-batches add up to the full batch.

These are the built-in objectives; `rl.loss_fn` wraps them as `Loss` values (`policy_loss`,
`sft_loss`), and a new loss returns the same `ObjectiveParts`.

Metric keys say how they are normalised at the end:
  'agg/<name>'  divided by the aggregation denominator (loss components)
  'tok/<name>'  divided by the number of loss tokens (per-token means and fractions)
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sfrrl_jax.rl.aggregation import SequenceLayout, aggregation_parts
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.importance import mismatch_weights
from sfrrl_jax.rl.kl import kl_estimate

# The log-ratio is clamped before exp() so one far off-policy token cannot overflow the loss.
LOG_RATIO_CLAMP = 20.0


class ObjectiveParts(NamedTuple):
    """One micro-batch's objective as the parts of an exact accumulation (sums over sequences).

    Micro-batches add their parts; the loss is sum(numerators) / max(sum(denominators), 1), and
    `finalize_metrics` turns the summed metrics into means.

    Attributes:
      numerator: scalar: the differentiated sum; loss = numerator / denominator.
      denominator: scalar: loss tokens or sequences in this batch (a count, per the aggregation).
      num_tokens: scalar: loss tokens.
      num_seqs: scalar: sequences with at least one loss token.
      sums: dict of 'agg/..' and 'tok/..' metric sums (no gradient).
      maxes: dict of metric maxima over loss tokens (-inf if none; no gradient).
      mins: dict of metric minima over loss tokens (+inf if none; no gradient).
      advantage_term: the part of `numerator` that carries the advantages (the clipped policy term;
        differentiable). With behavior='current' the ratio is exactly 1, so it is linear in the advantages
        and the rest of the numerator (KL, entropy) does not depend on them: see `learner.deferred`. A
        `rl.Loss` declaring `linear_in_advantages` must fill it the same way. Default 0.0.
    """

    numerator: jnp.ndarray    # scalar: the differentiated sum; loss = numerator / denominator
    denominator: jnp.ndarray  # scalar: loss tokens or sequences in this batch (a count)
    num_tokens: jnp.ndarray   # scalar: loss tokens
    num_seqs: jnp.ndarray     # scalar: sequences with at least one loss token
    sums: dict                # 'agg/..' and 'tok/..' metric sums (no gradient)
    maxes: dict               # metric maxima over loss tokens (-inf if none)
    mins: dict                # metric minima over loss tokens (+inf if none)
    advantage_term: jnp.ndarray | float = 0.0


def ppo_clip_loss(
    log_ratio: jnp.ndarray,
    advantages: jnp.ndarray,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Per-token clipped surrogate loss (to minimise). All arrays `[batch, seq]`.

    With r = exp(log_ratio) (log_ratio clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] first):
    loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and with dual clip (c > 1), for
    A < 0: min(loss, -c A). Not masked: the caller multiplies by the loss mask.

    Args:
      log_ratio: `[batch, seq]` float log(pi / pi_behavior) per token (differentiable).
      advantages: `[batch, seq]` float per-token advantages A.
      clip_low: r is clipped below at 1 - clip_low.
      clip_high: r is clipped above at 1 + clip_high.
      dual_clip: None (off), or c > 1: the dual-clip cap for negative advantages.
    Returns:
      `(loss, clipped, dual_clipped)`, each `[batch, seq]`: the per-token loss, and float32 0/1
        indicators of the token's gradient being cut by the clip and by the dual clip (exclusive).
    """
    ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped_term = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped_term)
    clipped = (clipped_term > unclipped).astype(jnp.float32)
    dual = jnp.zeros_like(clipped)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        use_dual = (advantages < 0) & (cap < loss)
        loss = jnp.where(use_dual, cap, loss)
        dual = use_dual.astype(jnp.float32)
        clipped = clipped * (1.0 - dual)
    return loss, clipped, dual


def gspo_log_ratio(
    logp: jnp.ndarray, behavior_logp: jnp.ndarray, mask: jnp.ndarray, layout: SequenceLayout
) -> jnp.ndarray:
    """GSPO-token log-ratio, `[batch, seq]`: in value every token carries its sequence's
    mean log-ratio; in gradient token t carries d logp_t (so d s_i,t = s_i * d logp_t).
    With 'seq_mean_token_mean' aggregation this is exactly GSPO's sequence-level objective.

    Computed as stop_gradient(seq_mean(logp - behavior_logp)) + logp - stop_gradient(logp), the mean
    taken over each sequence's loss tokens.

    Args:
      logp: `[batch, seq]` float current log-probs of the predicted tokens (differentiable).
      behavior_logp: `[batch, seq]` float log-probs of the same tokens under the behaviour policy.
      mask: `[batch, seq]` 0/1 loss mask (which tokens enter the sequence mean).
      layout: the `SequenceLayout` of the batch.
    Returns:
      `[batch, seq]` log-ratios (in value, every token of a sequence holds the same one).
    """
    seq_lr = layout.gather(layout.mean(logp - behavior_logp, mask))
    return jax.lax.stop_gradient(seq_lr) + logp - jax.lax.stop_gradient(logp)


def _masked_extreme(x: jnp.ndarray, mask: jnp.ndarray, fn) -> jnp.ndarray:
    fill = -jnp.inf if fn is jnp.max else jnp.inf
    return fn(jnp.where(mask > 0, x, fill))


def policy_objective(
    logp: jnp.ndarray,
    entropy: jnp.ndarray,
    mask: jnp.ndarray,
    advantages: jnp.ndarray,
    rollout_logp: jnp.ndarray | None,
    layout: SequenceLayout,
    cfg: LossConfig,
    old_logp: jnp.ndarray | None = None,
    ref_logp: jnp.ndarray | None = None,
) -> ObjectiveParts:
    """Clipped policy gradient (+ KL, entropy, mismatch correction) as accumulation parts.

    The behaviour log-probs are stop_gradient(logp), `rollout_logp` or `old_logp` (`cfg.behavior`); the
    log-ratio is logp - behavior (PPO) or `gspo_log_ratio` (GSPO), and the per-token loss
    `ppo_clip_loss`. When `rollout_logp` is given, that loss is multiplied by the stop-gradient weight
    of `mismatch_weights` (`cfg.is_correction`, `cfg.is_level`; 'none' weighs every loss token 1).
    numerator = agg(pg) + kl_coef * agg(kl_estimate(logp, ref_logp)) - entropy_coef * agg(entropy),
    each agg an `aggregation_parts` numerator under `cfg.aggregation`; `advantage_term` = agg(pg).

    Metrics: sums 'agg/pg_loss', 'tok/clip_frac', 'tok/dual_clip_frac', 'tok/approx_kl' (k3 of
    behavior vs. logp), 'tok/entropy', 'tok/ratio'; 'agg/kl_loss', 'tok/kl_ref' with KL;
    'agg/entropy_bonus' with the entropy bonus; 'tok/is_weight', 'tok/is_rejected_frac',
    'tok/mismatch' with `rollout_logp`. Maxima/minima 'ratio_max' / 'ratio_min', and 'is_weight_max' /
    'is_weight_min' with `rollout_logp`.

    Args:
      logp: `[batch, seq]` float log-probs of the predicted tokens from the current params
        (differentiable).
      entropy: `[batch, seq]` float their predictive entropies (differentiable).
      mask: `[batch, seq]` 0/1 loss mask.
      advantages: `[batch, seq]` float per-token advantages.
      rollout_logp: `[batch, seq]` float engine log-probs, or None; needed for behavior='rollout' and
        for is_correction != 'none'.
      layout: the `SequenceLayout` of the batch.
      cfg: the loss config (objective 'policy').
      old_logp: `[batch, seq]` float log-probs of the sampling weights; needed for behavior='old'.
      ref_logp: `[batch, seq]` float reference log-probs; needed for kl_coef > 0.
    Returns:
      The `ObjectiveParts`.
    Raises:
      ValueError: a log-prob input the config needs is None, or (from `aggregation_parts`)
        'seq_mean_token_sum_norm' without `cfg.norm_length`.
    """
    m = mask.astype(jnp.float32)
    logp = logp.astype(jnp.float32)
    if cfg.behavior == "current":
        behavior = jax.lax.stop_gradient(logp)
    elif cfg.behavior == "rollout":
        if rollout_logp is None:
            raise ValueError("LossConfig.behavior='rollout' needs 'rollout_logprobs' in the batch")
        behavior = rollout_logp.astype(jnp.float32)
    else:
        if old_logp is None:
            raise ValueError("LossConfig.behavior='old' needs 'old_logprobs' in the batch")
        behavior = old_logp.astype(jnp.float32)

    if cfg.policy_loss == "gspo":
        log_ratio = gspo_log_ratio(logp, behavior, m, layout)
    else:
        log_ratio = logp - behavior
    pg, clipped, dual = ppo_clip_loss(log_ratio, advantages.astype(jnp.float32), cfg.clip_low,
                                      cfg.clip_high, cfg.dual_clip)

    sums, maxes, mins = {}, {}, {}
    if cfg.is_correction != "none" or rollout_logp is not None:
        if rollout_logp is None:
            raise ValueError(f"LossConfig.is_correction={cfg.is_correction!r} needs 'rollout_logprobs' in the batch")
        isw = mismatch_weights(behavior, rollout_logp.astype(jnp.float32), m, layout, cfg.is_correction,
                               cfg.is_level, cfg.is_cap, cfg.is_low, cfg.is_high)
        pg = pg * jax.lax.stop_gradient(isw.weight)
        sums["tok/is_weight"] = jnp.sum(isw.raw * m)
        sums["tok/is_rejected_frac"] = jnp.sum(isw.rejected)
        sums["tok/mismatch"] = jnp.sum(jnp.abs(rollout_logp.astype(jnp.float32) - jax.lax.stop_gradient(logp)) * m)
        maxes["is_weight_max"] = _masked_extreme(isw.raw, m, jnp.max)
        mins["is_weight_min"] = _masked_extreme(isw.raw, m, jnp.min)

    pg_num, den = aggregation_parts(pg, m, layout, cfg.aggregation, cfg.norm_length)
    numerator = pg_num
    sums["agg/pg_loss"] = pg_num

    if cfg.kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("LossConfig.kl_coef > 0 needs 'ref_logprobs' in the batch")
        kl = kl_estimate(logp, ref_logp.astype(jnp.float32), cfg.kl_estimator)
        kl_num, _ = aggregation_parts(kl, m, layout, cfg.aggregation, cfg.norm_length)
        numerator = numerator + cfg.kl_coef * kl_num
        sums["agg/kl_loss"] = kl_num
        sums["tok/kl_ref"] = jnp.sum(kl * m)
    if cfg.entropy_coef > 0.0:
        ent_num, _ = aggregation_parts(entropy, m, layout, cfg.aggregation, cfg.norm_length)
        numerator = numerator - cfg.entropy_coef * ent_num
        sums["agg/entropy_bonus"] = ent_num

    ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    sums["tok/clip_frac"] = jnp.sum(clipped * m)
    sums["tok/dual_clip_frac"] = jnp.sum(dual * m)
    sums["tok/approx_kl"] = jnp.sum(kl_estimate(behavior, logp, "k3") * m)
    sums["tok/entropy"] = jnp.sum(entropy.astype(jnp.float32) * m)
    sums["tok/ratio"] = jnp.sum(ratio * m)
    maxes["ratio_max"] = _masked_extreme(ratio, m, jnp.max)
    mins["ratio_min"] = _masked_extreme(ratio, m, jnp.min)
    return _finish(numerator, den, m, layout, sums, maxes, mins, advantage_term=pg_num)


def sft_objective(
    logp: jnp.ndarray,
    entropy: jnp.ndarray,
    mask: jnp.ndarray,
    layout: SequenceLayout,
    cfg: LossConfig,
    rollout_logp: jnp.ndarray | None = None,
) -> ObjectiveParts:
    """Masked negative log-likelihood of the loss tokens, aggregated like the policy loss.

    numerator = agg(-logp) - entropy_coef * agg(entropy), each agg an `aggregation_parts` numerator
    under `cfg.aggregation`. Metrics: sums 'agg/nll', 'tok/entropy', 'agg/entropy_bonus' (entropy_coef
    > 0) and 'tok/mismatch' (with `rollout_logp`); no maxima/minima; `advantage_term` is 0.

    Args:
      logp: `[batch, seq]` float log-probs of the target tokens from the current params
        (differentiable).
      entropy: `[batch, seq]` float their predictive entropies (differentiable).
      mask: `[batch, seq]` 0/1 loss mask.
      layout: the `SequenceLayout` of the batch.
      cfg: the loss config (`aggregation`, `norm_length`, `entropy_coef`).
      rollout_logp: optional `[batch, seq]` float engine log-probs, only for the 'tok/mismatch'
        metric (mean |rollout_logp - logp| over loss tokens).
    Returns:
      The `ObjectiveParts`.
    Raises:
      ValueError: (from `aggregation_parts`) 'seq_mean_token_sum_norm' without `cfg.norm_length`.
    """
    m = mask.astype(jnp.float32)
    nll = -logp.astype(jnp.float32)
    num, den = aggregation_parts(nll, m, layout, cfg.aggregation, cfg.norm_length)
    sums = {"agg/nll": num, "tok/entropy": jnp.sum(entropy.astype(jnp.float32) * m)}
    if cfg.entropy_coef > 0.0:
        ent_num, _ = aggregation_parts(entropy, m, layout, cfg.aggregation, cfg.norm_length)
        num = num - cfg.entropy_coef * ent_num
        sums["agg/entropy_bonus"] = ent_num
    if rollout_logp is not None:
        sums["tok/mismatch"] = jnp.sum(jnp.abs(rollout_logp.astype(jnp.float32) - jax.lax.stop_gradient(logp)) * m)
    return _finish(num, den, m, layout, sums, {}, {})


def _finish(numerator, den, m, layout, sums, maxes, mins, advantage_term=0.0) -> ObjectiveParts:
    counts = layout.token_counts(m)
    stop = lambda d: {k: jax.lax.stop_gradient(v) for k, v in d.items()}
    return ObjectiveParts(
        numerator=numerator,
        denominator=den,
        num_tokens=jnp.sum(m),
        num_seqs=jnp.sum((counts > 0).astype(jnp.float32)),
        sums=stop(sums),
        maxes=stop(maxes),
        mins=stop(mins),
        advantage_term=jnp.asarray(advantage_term, jnp.float32),
    )


def finalize_metrics(sums: dict, maxes: dict, mins: dict, denominator, num_tokens) -> dict:
    """Turns accumulated metric sums into means ('agg/..' / denominator, 'tok/..' / tokens)."""
    out = {}
    den = jnp.maximum(denominator, 1.0)
    ntok = jnp.maximum(num_tokens, 1.0)
    for k, v in sums.items():
        kind, name = k.split("/", 1)
        out[name] = v / (den if kind == "agg" else ntok)
    has = num_tokens > 0
    for k, v in {**maxes, **mins}.items():
        out[k] = jnp.where(has, v, 0.0)
    return out
