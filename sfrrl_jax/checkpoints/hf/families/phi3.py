"""Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM): Llama's block with q/k/v and gate/up fused in
the checkpoint (split on load), RoPE on the leading `partial_rotary_factor` of each head
(Phi-4-mini: 0.75), default or longrope scaling, and `sliding_window` (when not null) on every
layer.

Tool calls: the chat template decides."""
from __future__ import annotations

import math
from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import DENSE, drop_moe_fields, partial_rope_to_hf, window_to_hf
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec, TensorNames
from sfrrl_jax.checkpoints.hf.hf_fields import (LONGROPE_KEYS, HFConfigError, float_of, int_of, require, rope_of,
                                                value_of)
from sfrrl_jax.config import ModelConfig


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    require(hf, "hidden_act", ("silu",), where)
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    partial = float_of({"partial_rotary_factor": params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))},
                     "partial_rotary_factor", where, 1.0)
    extra: dict = {"rope_partial_factor": partial}
    if params.get("rope_type", params.get("type")) in ("longrope", "su"):   # 'su': its name in early Phi-3 files
        at = f"{where} {field}"
        unknown = sorted(set(params) - LONGROPE_KEYS)
        if unknown:
            raise HFConfigError(f"{where}: longrope parameter(s) {unknown} are not supported; "
                                f"supported: {sorted(LONGROPE_KEYS)}")
        original = int_of({"original_max_position_embeddings": params.get("original_max_position_embeddings",
                                                                        hf.get("original_max_position_embeddings"))},
                        "original_max_position_embeddings", at)
        factors = {}
        for key in ("long_factor", "short_factor"):
            value = value_of(params, key, at)
            if not isinstance(value, list) or not all(isinstance(f, (int, float)) and not isinstance(f, bool)
                                                      for f in value):
                raise HFConfigError(f"{at}: {key} must be a list of numbers, got {value!r}")
            factors[key] = tuple(float(f) for f in value)
        factor = float_of(params, "factor", at, common["max_seq_len"] / original)
        attention = params.get("attention_factor")   # HF's default: from the context's growth
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        extra.update(rope_type="longrope", rope_original_max_len=original, rope_long_factor=factors["long_factor"],
                     rope_short_factor=factors["short_factor"],
                     rope_attention_factor=float_of({"attention_factor": attention}, "attention_factor", at),
                     rope_theta=float_of({"rope_theta": params.get("rope_theta", hf.get("rope_theta"))}, "rope_theta",
                                       where, 10000.0))
    else:
        extra.update(rope_of({**hf, field: {k: v for k, v in params.items() if k != "partial_rotary_factor"}},
                           where, 10000.0))
    window = None if hf.get("sliding_window") is None else int_of(hf, "sliding_window", where)
    if window is not None and window >= common["max_seq_len"]:
        window = None   # Phi-4-mini's 262144 over 131072 positions: no window at all
    try:
        return ModelConfig(**common, **extra, n_experts=0, d_ff=int_of(hf, "intermediate_size", where),
                           sliding_window=window, layer_types=("sliding",) * common["n_layers"] if window else None)
    except HFConfigError:   # a field's own error already names it
        raise
    except ValueError as e:   # factor counts and the rotated dims are checked by ModelConfig
        raise HFConfigError(f"{where}: {e}") from None


def _write(cfg: ModelConfig, hf: dict) -> None:
    drop_moe_fields(hf)
    # pad_token_id: Phi3Config's default (32000) is an embedding row HF checks against the vocabulary
    hf.update(intermediate_size=cfg.d_ff, sliding_window=window_to_hf(cfg), rope_parameters=partial_rope_to_hf(cfg),
              original_max_position_embeddings=cfg.rope_original_max_len, pad_token_id=None)


PHI3 = FamilySpec(
    model_type="phi3", architecture="Phi3ForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(DENSE, qk_norm=False, attention_bias=False, out_bias=False), moe=False,
    free=("rope_partial_factor",), sliding="all", tensor_names=TensorNames(fused_projections=True))
