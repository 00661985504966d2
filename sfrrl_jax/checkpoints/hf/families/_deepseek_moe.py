"""What DeepSeek-V2 / V3, GLM-4.5 and GLM-4.7-Flash share: DeepSeek's MoE layout (the first k layers
dense, an ungated shared expert) both ways, GLM-4.5's and DeepSeek-V3's grouped sigmoid routing,
and DeepSeek's multi-head latent attention both ways."""
from __future__ import annotations

import math
from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, bool_of, float_of, int_of, require, rope_of, rope_to_hf
from sfrrl_jax.config import ModelConfig

#: what the latent-attention classes fix: no biases, norms or sinks on the attention, an ungated
#: shared expert
LATENT = dict(attn_sinks=False, router_bias=False, expert_bias=False, expert_act="swiglu", shared_expert_gate=False,
              qk_norm=False, attention_bias=False, out_bias=False)
#: what they read from config.json: the scores' scale (YaRN's mscale_all_dim), the latent rank, the groups
LATENT_FREE = ("query_scale", "mla_kv_rank", "router_groups", "router_topk_groups")


def deepseek_moe(hf: Mapping[str, Any], n_layers: int, where: str, first_dense_default: int,
                 shared_default: int) -> dict:
    """DeepSeek's MoE layout, GLM-4.5's too: the first `first_k_dense_replace` layers dense
    (intermediate_size wide), the others `n_routed_experts` experts plus an ungated shared expert
    of `n_shared_experts` x moe_intermediate_size (the defaults: their config classes')."""
    require(hf, "hidden_act", ("silu",), where)
    first_dense = int_of(hf, "first_k_dense_replace", where, first_dense_default, lo=0)
    if first_dense >= n_layers:
        raise HFConfigError(f"{where}: first_k_dense_replace={first_dense} leaves no MoE layer among the {n_layers}")
    d_ff_expert = int_of(hf, "moe_intermediate_size", where)
    return dict(n_experts=int_of(hf, "n_routed_experts", where), d_ff_expert=d_ff_expert,
                d_ff_shared=int_of(hf, "n_shared_experts", where, shared_default, lo=0) * d_ff_expert,
                dense_layers=tuple(range(first_dense)),
                d_ff=int_of(hf, "intermediate_size", where) if first_dense else 0)


def grouped_sigmoid_moe(hf: Mapping[str, Any], n_layers: int, where: str) -> dict:
    """The MoE of GLM-4.5 and DeepSeek-V3 (one rule): `deepseek_moe`'s layers, routed by sigmoid
    scores with a selection bias among `topk_group` of `n_group` groups, optionally renormalised,
    scaled by `routed_scaling_factor`; the router kept in fp32, as transformers keeps it."""
    return dict(deepseek_moe(hf, n_layers, where, 1, 1), router="sigmoid_topk", router_fp32=True,
                norm_topk_prob=bool_of(hf, "norm_topk_prob", where, True),
                router_scale=float_of(hf, "routed_scaling_factor", where, 1.0),
                router_groups=int_of(hf, "n_group", where, 1), router_topk_groups=int_of(hf, "topk_group", where, 1))


def latent_attention_fields(hf: Mapping[str, Any], where: str) -> dict:
    """DeepSeek-V2/V3's multi-head latent attention as ModelConfig fields: `q_lora_rank` (null:
    none), `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, cached as one KV
    head of kv_lora_rank + qk_rope_head_dim dims; RoPE as `rope_of` reads it, and the scores
    scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times YaRN's mscale(factor,
    mscale_all_dim)^2 where the rope parameters give one, as transformers does. Biases and other
    routers' scoring are refused by name. (FP8 weights are the loader's concern: `fp8_weights`.)"""
    require(hf, "moe_layer_freq", (1,), where)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFConfigError(f"{where}: {flag}=True is not supported with latent attention (no biases)")
    nope, rope_dims = int_of(hf, "qk_nope_head_dim", where), int_of(hf, "qk_rope_head_dim", where)
    kv_rank = int_of(hf, "kv_lora_rank", where)
    rope = rope_of(hf, where, 10000.0)
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    all_dim = (hf.get(field) or {}).get("mscale_all_dim")
    query_scale = None
    if rope["rope_type"] != "default" and all_dim and rope["rope_factor"] > 1:   # else mscale is 1
        m = 0.1 * float_of({"mscale_all_dim": all_dim}, "mscale_all_dim", where) * math.log(rope["rope_factor"]) + 1
        query_scale = (nope + rope_dims) ** -0.5 * m * m
    return dict(rope, n_kv_heads=1, head_dim=kv_rank + rope_dims, attention_bias=False, query_scale=query_scale,
                mla_kv_rank=kv_rank,
                mla_q_rank=0 if hf.get("q_lora_rank") is None else int_of(hf, "q_lora_rank", where),
                mla_nope_dim=nope, mla_rope_dim=rope_dims, mla_v_dim=int_of(hf, "v_head_dim", where))


def deepseek_moe_to_hf(cfg: ModelConfig, hf: dict) -> None:
    """DeepSeek's MoE layout's config.json fields (GLM-4.5's and GLM-4.7-Flash's too)."""
    del hf["router_aux_loss_coef"]
    hf.update(n_routed_experts=cfg.n_experts, moe_intermediate_size=cfg.d_ff_expert,
              n_shared_experts=cfg.d_ff_shared // cfg.d_ff_expert, routed_scaling_factor=cfg.router_scale,
              n_group=cfg.router_groups, topk_group=cfg.router_topk_groups, norm_topk_prob=cfg.norm_topk_prob,
              first_k_dense_replace=len(cfg.dense_layers), num_nextn_predict_layers=0,
              intermediate_size=cfg.d_ff if cfg.dense_layers else cfg.d_ff_expert)   # unused without them


def latent_attention_to_hf(cfg: ModelConfig) -> dict:
    """The latent-attention fields of DeepseekV2Config / V3Config / Glm4MoeLiteConfig. The scores'
    extra scale (our query_scale) is written as YaRN's mscale_all_dim, rounded to 12 digits so that
    reading it back computes the same float; the weights go in the interleaved RoPE layout
    (tensor_map)."""
    qk = cfg.mla_nope_dim + cfg.mla_rope_dim
    rope = rope_to_hf(cfg)
    if cfg.query_scale is not None:
        m = math.sqrt(cfg.query_scale * math.sqrt(qk))
        rope["mscale_all_dim"] = round((m - 1.0) / (0.1 * math.log(cfg.rope_factor)), 12)
    # HF expands every head's key and value and repeats them by heads // num_key_value_heads
    return dict(rope_parameters=rope, num_key_value_heads=cfg.n_heads, head_dim=cfg.mla_rope_dim,
                q_lora_rank=cfg.mla_q_rank or None, kv_lora_rank=cfg.mla_kv_rank, qk_nope_head_dim=cfg.mla_nope_dim,
                qk_rope_head_dim=cfg.mla_rope_dim, v_head_dim=cfg.mla_v_dim, rope_interleave=True,
                attention_bias=False)
