"""Granite 3 (GraniteForCausalLM): Llama's block with four multipliers (embeddings, attention
scores, residual branches, logits).

Tool calls: Granite 3's template writes `<|tool_call|>` JSON ('granite')."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import DENSE, check_llama_mlp, drop_moe_fields
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, float_of, int_of, rope_of
from sfrrl_jax.config import ModelConfig


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    check_llama_mlp(hf, where)
    return ModelConfig(
        **common, **rope_of(hf, where, 10000.0), n_experts=0, d_ff=int_of(hf, "intermediate_size", where),
        embed_scale=float_of(hf, "embedding_multiplier", where, 1.0),
        query_scale=float_of(hf, "attention_multiplier", where, 1.0),
        residual_scale=float_of(hf, "residual_multiplier", where, 1.0),
        logits_divisor=float_of(hf, "logits_scaling", where, 1.0))


def _write(cfg: ModelConfig, hf: dict) -> None:
    drop_moe_fields(hf)
    hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, mlp_bias=False,
              embedding_multiplier=cfg.embed_scale, attention_multiplier=cfg.query_scale,
              residual_multiplier=cfg.residual_scale, logits_scaling=cfg.logits_divisor)


def _check_export(cfg: ModelConfig) -> None:
    if cfg.query_scale is None:
        raise HFConfigError("ModelConfig(family='granite') needs query_scale (attention_multiplier)")


GRANITE = FamilySpec(
    model_type="granite", architecture="GraniteForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(DENSE, qk_norm=False, out_bias=cfg.attention_bias), moe=False,
    free=("embed_scale", "query_scale", "residual_scale", "logits_divisor"), check_export=_check_export,
    sliding="none", tool_format="granite")
