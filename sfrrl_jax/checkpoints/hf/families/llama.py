"""Llama and Mistral: a SwiGLU MLP in every layer. Llama's optional q/k/v/o bias is one switch
(attention_bias); Mistral is Llama without biases, its `sliding_window` (when not null: v0.1) on
every layer. `llama_block` / `llama_block_to_hf` are the reader and writer Qwen2 / Qwen3 share.

Tool calls: Llama's and Mistral's checkpoints differ (Llama 3.1's template writes JSON calls,
SmolLM2's none; Mistral v0.3's [TOOL_CALLS], v0.1's none), so their chat template decides."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import DENSE, check_llama_mlp, drop_moe_fields, window_to_hf
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, int_of, rope_of
from sfrrl_jax.config import ModelConfig


def llama_block(hf: Mapping[str, Any], common: dict, where: str, sliding_window: int | None = None,
                layer_types: tuple[str, ...] | None = None, **extra: Any) -> ModelConfig:
    """Llama's dense block read from config.json: `common` (`extra` over it), its RoPE (base
    10000 by default) and a SwiGLU MLP `intermediate_size` wide in every layer."""
    return ModelConfig(
        **{**common, **extra}, **rope_of(hf, where, 10000.0), n_experts=0,
        d_ff=int_of(hf, "intermediate_size", where), sliding_window=sliding_window, layer_types=layer_types,
    )


def llama_block_to_hf(cfg: ModelConfig, hf: dict) -> None:
    """Llama's dense block's config.json fields: no router, the MLP's width, biases."""
    drop_moe_fields(hf)
    hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, mlp_bias=False)


def _read_llama(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    check_llama_mlp(hf, where)
    return llama_block(hf, common, where)


def _read_mistral(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    check_llama_mlp(hf, where)
    window, layer_types = None, None
    if hf.get("attention_bias"):  # MistralAttention builds its projections without biases
        raise HFConfigError(f"{where}: attention_bias=True is not supported for mistral (HF Mistral "
                            "has no attention biases)")
    if hf.get("sliding_window") is not None:
        window, layer_types = int_of(hf, "sliding_window", where), ("sliding",) * common["n_layers"]
    return llama_block(hf, common, where, window, layer_types)


def _write_mistral(cfg: ModelConfig, hf: dict) -> None:
    llama_block_to_hf(cfg, hf)
    del hf["attention_bias"], hf["mlp_bias"]   # not MistralConfig fields: it has neither
    hf["sliding_window"] = window_to_hf(cfg)


LLAMA = FamilySpec(
    model_type="llama", architecture="LlamaForCausalLM", read_config=_read_llama, write_config=llama_block_to_hf,
    fixed=lambda cfg: dict(DENSE, qk_norm=False, out_bias=cfg.attention_bias), moe=False, sliding="none")

MISTRAL = FamilySpec(
    model_type="mistral", architecture="MistralForCausalLM", read_config=_read_mistral, write_config=_write_mistral,
    fixed=lambda cfg: dict(DENSE, qk_norm=False, attention_bias=False, out_bias=False), moe=False, sliding="all")
