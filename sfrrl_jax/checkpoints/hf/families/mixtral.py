"""Mixtral (MixtralForCausalLM): Llama's attention, top-k-then-softmax routing over SwiGLU experts
(`block_sparse_moe.experts.{e}.w1/w3/w2`), and `sliding_window` (when not null) on every layer.

Tool calls: checkpoints differ; the chat template decides."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import window_to_hf
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec, TensorNames
from sfrrl_jax.checkpoints.hf.hf_fields import int_of, require, rope_of
from sfrrl_jax.config import ModelConfig

#: Mixtral's and MiniMax-M2's MoE tensors: block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1/w3/w2
BLOCK_SPARSE_MOE = TensorNames(moe_prefix="block_sparse_moe.", expert_projections=("w1", "w3", "w2"))


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    require(hf, "hidden_act", ("silu",), where)
    window = hf.get("sliding_window")
    return ModelConfig(
        **common, **rope_of(hf, where, 1e6), n_experts=int_of(hf, "num_local_experts", where),
        d_ff_expert=int_of(hf, "intermediate_size", where), router="topk_softmax",
        sliding_window=window, layer_types=("sliding",) * common["n_layers"] if window else None,
    )


def _write(cfg: ModelConfig, hf: dict) -> None:
    hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert, sliding_window=window_to_hf(cfg))


MIXTRAL = FamilySpec(
    model_type="mixtral", architecture="MixtralForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(router="topk_softmax", qk_norm=False, attn_sinks=False, router_bias=False,
                           expert_bias=False, expert_act="swiglu", attention_bias=False, d_ff_shared=0),
    moe=True, sliding="all", tensor_names=BLOCK_SPARSE_MOE)
