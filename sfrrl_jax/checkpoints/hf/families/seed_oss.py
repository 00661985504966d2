"""Seed-OSS (SeedOssForCausalLM): Llama's block, the output projection's bias apart from q/k/v's.

Tool calls: <seed:tool_call> ('seed_oss')."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import DENSE, check_llama_mlp, drop_moe_fields
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import bool_of, int_of, rope_of
from sfrrl_jax.config import ModelConfig


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    check_llama_mlp(hf, where)
    # attention_dropout / residual_dropout act in HF's training mode only: not part of the function
    return ModelConfig(**common, **rope_of(hf, where, 1e7), n_experts=0,
                       d_ff=int_of(hf, "intermediate_size", where),
                       attention_out_bias=bool_of(hf, "attention_out_bias", where, False))


def _write(cfg: ModelConfig, hf: dict) -> None:
    drop_moe_fields(hf)
    # dropout 0: the function; HF applies it in training mode only
    hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, attention_out_bias=cfg.out_bias,
              mlp_bias=False, attention_dropout=0.0, residual_dropout=0.0)


SEED_OSS = FamilySpec(
    model_type="seed_oss", architecture="SeedOssForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(DENSE, qk_norm=False), moe=False, tool_format="seed_oss")
