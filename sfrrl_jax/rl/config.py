"""Frozen configs of the RL math: advantage estimators, the policy/SFT loss, filters.

`LossConfig` describes the built-in losses; `rl.loss_fn` turns it into a `Loss` value.

Everything here is plain data (hashable, so it can be a static argument of `jax.jit`). Values are
checked in `__post_init__`; a bad value raises naming the field and the valid choices.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from sfrrl_jax.checks import check_int, check_int_fields, check_number, check_number_fields

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
Objective = Literal["policy", "sft"]
PolicyLoss = Literal["ppo", "gspo"]
Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Behavior = Literal["current", "rollout", "old"]
KLEstimator = Literal["k1", "k2", "k3"]
ISCorrection = Literal["none", "tis", "mis"]
ISLevel = Literal["token", "sequence", "geo_sequence"]
RoutingReplay = Literal["off", "r3"]


def _check_choice(owner: str, name: str, value, allowed) -> None:
    if value not in allowed.__args__:
        raise ValueError(f"{owner}.{name}={value!r}; valid: {list(allowed.__args__)}")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """How per-sample advantages are computed from `[groups, G]` rewards (`rl.advantages.compute_advantages`).

    Attributes:
      estimator: the estimator:
        grpo                   (r - group mean) / (group std + eps)
        dr_grpo                r - group mean (Dr. GRPO: no std, and no length normalisation, which
                               is the loss aggregation's job: use 'seq_mean_token_sum_norm')
        rloo                   r - mean of the *other* G-1 samples of the group
        reinforce_pp           (r - batch mean) / (batch std + eps)   (REINFORCE++)
        reinforce_pp_baseline  group mean subtracted first, then batch-std normalised
      eps: added to the std in the denominator (>= 0).
      std_ddof: 0 = population std, 1 = unbiased (groups of one sample then have std 0).
    Raises:
      ValueError: a field outside its choices or range (the message names the field).
    """

    estimator: AdvantageEstimator = "grpo"
    eps: float = 1e-6
    std_ddof: int = 0

    def __post_init__(self):
        _check_choice("AdvantageConfig", "estimator", self.estimator, AdvantageEstimator)
        check_int("AdvantageConfig.std_ddof", self.std_ddof, 0, 1)
        check_number("AdvantageConfig.eps", self.eps, 0)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The train-step objective of the built-in losses (gin binds it at the experiment edge).

    It maps to a loss value: `rl.loss_fn.loss_from_config(cfg)` -> `policy_loss(cfg)` or
    `sft_loss(cfg)` (a `rl.Loss`, which the train step takes directly; a new loss is a new `Loss`,
    not a new option here).

    Attributes:
      objective: 'policy' (clipped policy gradient, below) or 'sft' (masked NLL of the loss tokens).
      policy_loss: 'ppo' (token ratio) or 'gspo' (sequence ratio = exp(mean token log-ratio)).
      clip_low: the ratio is clipped to [1 - clip_low, 1 + clip_high]; in [0, 1).
      clip_high: upper clip, >= 0 (DAPO clip-higher: clip_high > clip_low).
      dual_clip: None, or c > 1: for negative advantages the per-token loss is capped at -c * A.
      aggregation: how per-token losses become one scalar over the whole (accumulated) batch:
        token_mean               sum over all loss tokens / number of loss tokens
        seq_mean_token_sum       sum over all loss tokens / number of sequences
        seq_mean_token_mean      mean over sequences of the per-sequence token mean
        seq_mean_token_sum_norm  sum over all loss tokens / (sequences * norm_length)  (Dr. GRPO)
      norm_length: the fixed length of 'seq_mean_token_sum_norm' (e.g. the max response length), an
        int >= 1; required by that aggregation, ignored by the others (None).
      behavior: which log-probs the PPO/GSPO ratio is taken against:
        current  stop_gradient(current log-probs): exact on-policy with one update per batch (the
                 ratio is 1 in value; train/inference mismatch is then corrected with `is_correction`)
        rollout  the engine's rollout log-probs (the behaviour policy as sampled)
        old      `old_logprobs` from the batch (a training-engine forward of the sampling weights)
      kl_coef: coefficient (>= 0) of the KL(pi || ref) penalty added to the loss (needs
        `ref_logprobs`); 0 disables it. For KL as reward shaping use `rl.advantages.kl_shaped_rewards`
        before computing advantages and keep kl_coef = 0 here.
      kl_estimator: the per-token KL estimator of that penalty, 'k1', 'k2' or 'k3' (`rl.kl`).
      entropy_coef: the aggregated token entropy times this (>= 0) is subtracted from the loss.
      is_correction: train/inference mismatch correction with w = pi_behavior / pi_rollout: 'none';
        'tis' multiplies the loss by min(w, is_cap); 'mis' (IcePop-style) multiplies it by w where
        is_low <= w <= is_high and masks the token (or sequence) otherwise.
      is_level: 'token' (per-token w), 'sequence' (w = product over the sequence's tokens),
        'geo_sequence' (w = geometric mean over the sequence's tokens).
      is_cap: the TIS cap, > 0.
      is_low: the lower MIS bound, in [0, 1].
      is_high: the upper MIS bound, >= 1.
      router_aux_coef: coefficient of the model's router auxiliary loss (>= 0); None takes it from
        the ModelConfig.
      router_z_coef: coefficient of the model's router z-loss (>= 0); None takes it from the ModelConfig.
      routing_replay: 'off', or 'r3' (rollout routing replay, MoE models): the engine records the
        experts every token it fed used, the micro-batches carry them ('routes' [rows, seq, moe
        layers, top_k], 'routes_mask' [rows, seq]) and the train forward uses those experts, with
        gate weights from its own router (so the router still learns). Metrics then include
        'routing_agreement' and 'routing_agreement/layer_<i>' (the share of the engine's choices
        the train router would have made itself).
      vocab_chunk: vocab chunk size (int >= 1) of the logprob computation (never materialises [T, V]).
      seq_chunk: sequence chunk size (int >= 1) of the logprob computation.
    Raises:
      ValueError: a field outside its choices or range (the message names the field and the valid
        choices), 'seq_mean_token_sum_norm' without norm_length, or not is_low <= 1 <= is_high.
    """

    objective: Objective = "policy"
    policy_loss: PolicyLoss = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: Aggregation = "token_mean"
    norm_length: int | None = None
    behavior: Behavior = "current"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    is_correction: ISCorrection = "none"
    is_level: ISLevel = "token"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    router_aux_coef: float | None = None
    router_z_coef: float | None = None
    routing_replay: RoutingReplay = "off"
    vocab_chunk: int = 8192
    seq_chunk: int = 1024

    def __post_init__(self):
        own = "LossConfig"
        _check_choice(own, "objective", self.objective, Objective)
        _check_choice(own, "policy_loss", self.policy_loss, PolicyLoss)
        _check_choice(own, "aggregation", self.aggregation, Aggregation)
        _check_choice(own, "behavior", self.behavior, Behavior)
        _check_choice(own, "kl_estimator", self.kl_estimator, KLEstimator)
        _check_choice(own, "is_correction", self.is_correction, ISCorrection)
        _check_choice(own, "is_level", self.is_level, ISLevel)
        _check_choice(own, "routing_replay", self.routing_replay, RoutingReplay)
        check_number(f"{own}.clip_low", self.clip_low, 0, 1, hi_open=True)
        check_number_fields(self, ("clip_high", "kl_coef", "entropy_coef", "is_low", "is_high"), 0)
        check_number(f"{own}.dual_clip", self.dual_clip, 1, lo_open=True, optional=True)
        check_number(f"{own}.is_cap", self.is_cap, 0, lo_open=True)
        check_number_fields(self, ("router_aux_coef", "router_z_coef"), 0, optional=True)
        check_int_fields(self, ("vocab_chunk", "seq_chunk"), 1)
        check_int(f"{own}.norm_length", self.norm_length, 1, optional=True)
        if self.aggregation == "seq_mean_token_sum_norm" and self.norm_length is None:
            raise ValueError(
                f"{own}.aggregation='seq_mean_token_sum_norm' needs norm_length >= 1 "
                f"(e.g. the max response length), got {self.norm_length!r}"
            )
        if not (self.is_low <= 1.0 <= self.is_high):
            raise ValueError(f"{own}: need 0 <= is_low <= 1 <= is_high, got "
                             f"is_low={self.is_low!r}, is_high={self.is_high!r}")

    @property
    def per_sequence(self) -> bool:
        """Whether the aggregation's normaliser counts sequences (else loss tokens)."""
        return self.aggregation != "token_mean"


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
    """Overlong handling (DAPO). `max_length` is the response budget in tokens.

    Used by `rl.filters.overlong_filter`.

    Attributes:
      mode: 'mask' (overlong filtering): a response that was truncated (reached max_length without
        finishing) is dropped from the loss. 'soft' (overlong punishment): the reward gets a penalty
        that grows linearly from 0 at length max_length - buffer to -penalty at max_length, and stays
        at -penalty beyond.
      max_length: the response budget in tokens, an int >= 1.
      buffer: length of the soft-penalty ramp in tokens, an int in [0, max_length] (0: the full
        penalty beyond max_length).
      penalty: the full soft penalty, >= 0.
    Raises:
      ValueError: a field outside its choices or range.
    """

    mode: Literal["mask", "soft"] = "soft"
    max_length: int = 4096
    buffer: int = 512
    penalty: float = 1.0

    def __post_init__(self):
        if self.mode not in ("mask", "soft"):
            raise ValueError(f"OverlongConfig.mode={self.mode!r}; valid: ['mask', 'soft']")
        check_int("OverlongConfig.max_length", self.max_length, 1)
        check_int("OverlongConfig.buffer", self.buffer, 0, self.max_length)
        check_number("OverlongConfig.penalty", self.penalty, 0)
