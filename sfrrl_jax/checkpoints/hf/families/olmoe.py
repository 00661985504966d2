"""OLMoE (OlmoeForCausalLM): Llama's pre-norm block, q/k norms over the whole projection (as OLMo
2's, but multiplying after the cast), softmax-then-top-k routing over per-expert SwiGLU MLPs.

Tool calls: the chat template decides."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, bool_of, int_of, require, rope_of
from sfrrl_jax.config import ModelConfig


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    require(hf, "hidden_act", ("silu",), where)
    if hf.get("clip_qkv") is not None:
        raise HFConfigError(f"{where}: clip_qkv={hf['clip_qkv']!r} is not supported (q/k/v clipping)")
    d_model, n_heads = common["d_model"], common["n_heads"]
    if common["head_dim"] * n_heads != d_model:   # HF builds q_norm over hidden_size
        raise HFConfigError(f"{where}: head_dim={common['head_dim']} x num_attention_heads={n_heads} != "
                            f"hidden_size={d_model}; HF OLMoE's q_norm spans hidden_size")
    return ModelConfig(
        **common, **rope_of(hf, where, 10000.0), n_experts=int_of(hf, "num_experts", where),
        d_ff_expert=int_of(hf, "intermediate_size", where), router="softmax_topk",
        norm_topk_prob=bool_of(hf, "norm_topk_prob", where, False), qk_norm=True, qk_norm_over_heads=True)


def _write(cfg: ModelConfig, hf: dict) -> None:
    hf.update(num_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert, norm_topk_prob=cfg.norm_topk_prob,
              attention_bias=cfg.attention_bias, clip_qkv=None)


def _check_export(cfg: ModelConfig) -> None:
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise HFConfigError(f"ModelConfig(family='olmoe') has head_dim={cfg.head_dim} x n_heads={cfg.n_heads} "
                            f"!= d_model={cfg.d_model}; HF OlmoeForCausalLM's q_norm spans hidden_size")


OLMOE = FamilySpec(
    model_type="olmoe", architecture="OlmoeForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(router="softmax_topk", qk_norm=True, qk_norm_over_heads=True, attn_sinks=False,
                           router_bias=False, expert_bias=False, expert_act="swiglu", d_ff_shared=0,
                           out_bias=cfg.attention_bias),
    moe=True, check_export=_check_export)
