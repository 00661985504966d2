"""OLMo 2 / OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): Llama's attention and MLP in a post-norm
block (each sublayer's output normed before the residual add, no norm on its input), q/k norms
over the whole projection rather than per head, and norms that multiply by their weight in fp32.
OLMo 3 adds sliding layers (three in four by default) whose RoPE is unscaled; a `rope_scaling`
(OLMo 3's YaRN) applies to its full layers only, as transformers reads it.

Tool calls: OLMo 3's template writes pythonic calls in <function_calls> ('olmo3'); OLMo 2's Tulu
template has no tools."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import (DENSE, drop_moe_fields, layer_types_to_hf, per_kind_rope,
                                                       per_kind_rope_to_hf, window_to_hf)
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, int_of, layer_types_of, require, rope_of
from sfrrl_jax.config import ModelConfig


def _check_olmo(hf: Mapping[str, Any], where: str) -> None:
    require(hf, "hidden_act", ("silu",), where)
    if hf.get("clip_qkv") is not None:   # OLMo 1's; OLMo 2/3 have none
        raise HFConfigError(f"{where}: clip_qkv={hf['clip_qkv']!r} is not supported (OLMo 1's q/k/v clipping)")


def _olmo_block(hf: Mapping[str, Any], common: dict, where: str, extra: dict) -> ModelConfig:
    try:
        return ModelConfig(**common, **extra, n_experts=0, d_ff=int_of(hf, "intermediate_size", where),
                           qk_norm=True, qk_norm_over_heads=True, pre_norms=False, sandwich_norms=True,
                           norm_scale_fp32=True)
    except HFConfigError:   # a field's own error already names it
        raise
    except ValueError as e:
        raise HFConfigError(f"{where}: {e}") from None


def _read_olmo2(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    _check_olmo(hf, where)
    return _olmo_block(hf, common, where, rope_of(hf, where, 10000.0))


def _read_olmo3(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    _check_olmo(hf, where)
    n_layers = common["n_layers"]
    hf_types = hf.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                         for i in range(n_layers)]
    layer_types = layer_types_of(hf_types, n_layers, where)
    # 4.x files: rope_theta is both kinds' base, rope_scaling the full layers' alone
    rope, local_theta = per_kind_rope(hf, where, 10000.0, "rope_theta", 10000.0)
    extra = dict(rope)
    if "sliding" in layer_types:
        extra.update(sliding_window=int_of(hf, "sliding_window", where, 4096), layer_types=layer_types,
                     rope_local_theta=local_theta)
    return _olmo_block(hf, common, where, extra)


def _write_olmo2(cfg: ModelConfig, hf: dict) -> None:
    drop_moe_fields(hf)
    hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias)


def _write_olmo3(cfg: ModelConfig, hf: dict) -> None:
    _write_olmo2(cfg, hf)
    hf.update(sliding_window=window_to_hf(cfg), layer_types=layer_types_to_hf(cfg),
              rope_parameters=per_kind_rope_to_hf(cfg))


def _check_export_olmo3(cfg: ModelConfig) -> None:
    if "sliding" in (cfg.layer_types or ()) and cfg.rope_type != "default" and cfg.rope_local_theta is None:
        raise HFConfigError("ModelConfig(family='olmo3') with sliding layers and rope_type="
                            f"{cfg.rope_type!r} needs rope_local_theta: HF's sliding layers rotate unscaled")


def _fixed(cfg: ModelConfig) -> dict:
    """OLMo 2/3's post-norm block and whole-projection q/k norms, the rest as Llama."""
    return dict(DENSE, qk_norm=True, qk_norm_over_heads=True, pre_norms=False, sandwich_norms=True,
                norm_scale_fp32=True, out_bias=cfg.attention_bias)


OLMO2 = FamilySpec(
    model_type="olmo2", architecture="Olmo2ForCausalLM", read_config=_read_olmo2, write_config=_write_olmo2,
    fixed=_fixed, moe=False, sliding="none")

OLMO3 = FamilySpec(
    model_type="olmo3", architecture="Olmo3ForCausalLM", read_config=_read_olmo3, write_config=_write_olmo3,
    fixed=_fixed, moe=False, free=("rope_local_theta",), check_export=_check_export_olmo3, tool_format="olmo3")
