"""GPT-OSS (GptOssForCausalLM): attention sinks and q/k/v/o biases, sliding and full layers in turn
(by default), top-k-then-softmax routing over experts with biases and GPT-OSS's clamped SwiGLU,
stored fused (gate and up interleaved on the last dim), optionally MXFP4-quantised.

Tool calls: the harmony channels ('harmony')."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import layer_types_to_hf
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec, TensorNames
from sfrrl_jax.checkpoints.hf.hf_fields import float_of, int_of, layer_types_of, rope_of
from sfrrl_jax.config import ModelConfig


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    n_layers = common["n_layers"]
    hf_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(n_layers)]
    layer_types = layer_types_of(hf_types, n_layers, where)
    return ModelConfig(
        **common, **rope_of(hf, where, 150000.0), n_experts=int_of(hf, "num_local_experts", where),
        d_ff_expert=int_of(hf, "intermediate_size", where), router="topk_softmax",
        router_bias=True, expert_bias=True, expert_act="gptoss_swiglu",
        swiglu_limit=float_of(hf, "swiglu_limit", where, 7.0), swiglu_alpha=float_of(hf, "swiglu_alpha", where, 1.702),
        attn_sinks=True, sliding_window=hf.get("sliding_window") if "sliding" in layer_types else None,
        layer_types=layer_types,
    )


def _write(cfg: ModelConfig, hf: dict) -> None:
    hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert,
              attention_bias=True, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
              sliding_window=cfg.sliding_window,
              layer_types=layer_types_to_hf(cfg))


GPT_OSS = FamilySpec(
    model_type="gpt_oss", architecture="GptOssForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(router="topk_softmax", qk_norm=False, attn_sinks=True, router_bias=True,
                           expert_bias=True, expert_act="gptoss_swiglu", attention_bias=True, d_ff_shared=0),
    moe=True, default_attention_bias=True, mxfp4_experts=True, tensor_names=TensorNames(fused_experts=True),
    tool_format="harmony")
