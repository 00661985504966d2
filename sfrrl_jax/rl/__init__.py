"""RL math (pure functions): advantages, policy/SFT losses, aggregation, filters, chunked logprobs."""
from sfrrl_jax.rl.advantages import (
    broadcast_to_tokens, compute_advantages, dr_grpo_advantages, grpo_advantages,
    kl_shaped_rewards, reinforce_pp_advantages, reinforce_pp_token_advantages, rloo_advantages,
)
from sfrrl_jax.rl.aggregation import SequenceLayout, aggregate, aggregation_parts
from sfrrl_jax.rl.config import AdvantageConfig, LossConfig, OverlongConfig
from sfrrl_jax.rl.filters import apply_sample_mask, overlong_filter, zero_variance_groups
from sfrrl_jax.rl.importance import mismatch_weights
from sfrrl_jax.rl.kl import kl_estimate
from sfrrl_jax.rl.logprobs import naive_token_logprobs_and_entropy, token_logprobs_and_entropy
from sfrrl_jax.rl.losses import gspo_log_ratio, policy_objective, ppo_clip_loss, sft_objective

__all__ = [
    "AdvantageConfig", "LossConfig", "OverlongConfig", "SequenceLayout", "aggregate",
    "aggregation_parts", "apply_sample_mask", "broadcast_to_tokens", "compute_advantages",
    "dr_grpo_advantages", "grpo_advantages", "gspo_log_ratio", "kl_estimate", "kl_shaped_rewards",
    "mismatch_weights", "naive_token_logprobs_and_entropy", "overlong_filter", "policy_objective",
    "ppo_clip_loss", "reinforce_pp_advantages", "reinforce_pp_token_advantages", "rloo_advantages",
    "sft_objective", "token_logprobs_and_entropy", "zero_variance_groups",
]
