"""RL math (pure functions): advantages, policy/SFT losses, aggregation, filters, chunked logprobs.

Losses are values (`Loss`, `rl.loss_fn`): built-ins from a `LossConfig` (`policy_loss`, `sft_loss`,
`loss_from_config`), or any new objective with its declared batch fields.
"""
from sfrrl_jax.rl.advantages import (
    ESTIMATORS, Estimator, advantage_slopes, broadcast_to_tokens, compute_advantages, dr_grpo_advantages, grpo_advantages,
    kl_shaped_rewards, reinforce_pp_advantages, reinforce_pp_token_advantages, rloo_advantages,
)
from sfrrl_jax.rl.aggregation import SequenceLayout, aggregate, aggregation_parts
from sfrrl_jax.rl.config import AdvantageConfig, LossConfig, OverlongConfig
from sfrrl_jax.rl.filters import apply_sample_mask, overlong_filter, zero_variance_groups
from sfrrl_jax.rl.importance import mismatch_weights
from sfrrl_jax.rl.kl import kl_estimate
from sfrrl_jax.rl.logprobs import naive_token_logprobs_and_entropy, token_logprobs_and_entropy
from sfrrl_jax.rl.loss_fn import Loss, LossInputs, as_loss, loss_from_config, policy_loss, sft_loss
from sfrrl_jax.rl.microbatch import MicroBatch, as_microbatch, validate_microbatch
from sfrrl_jax.rl.losses import (
    ObjectiveParts, gspo_log_ratio, policy_objective, ppo_clip_loss, sft_objective,
)

__all__ = [
    "AdvantageConfig", "ESTIMATORS", "Estimator", "Loss", "LossConfig", "LossInputs", "MicroBatch", "ObjectiveParts", "OverlongConfig",
    "SequenceLayout", "aggregate", "aggregation_parts", "advantage_slopes", "apply_sample_mask", "as_loss", "as_microbatch",
    "broadcast_to_tokens", "compute_advantages", "dr_grpo_advantages", "grpo_advantages",
    "gspo_log_ratio", "kl_estimate", "kl_shaped_rewards", "loss_from_config", "mismatch_weights",
    "naive_token_logprobs_and_entropy", "overlong_filter", "policy_loss", "policy_objective",
    "ppo_clip_loss", "reinforce_pp_advantages", "reinforce_pp_token_advantages", "rloo_advantages",
    "sft_loss", "sft_objective", "token_logprobs_and_entropy", "validate_microbatch", "zero_variance_groups",
]
