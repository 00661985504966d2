"""SmolLM3 (SmolLM3ForCausalLM): Llama's block, with no RoPE in the layers `no_rope_layers` marks 0
(by default every `no_rope_layer_interval`-th), and a window (with `use_sliding_window`) on the
layers `layer_types` marks sliding (by default the NoPE ones), as transformers builds them.

Tool calls: Hermes-style <tool_call> JSON, as Qwen3's ('qwen3')."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import (DENSE, check_llama_mlp, drop_moe_fields, layer_types_to_hf,
                                                       window_to_hf)
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, int_of, layer_types_of, rope_of
from sfrrl_jax.config import ModelConfig


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    check_llama_mlp(hf, where)
    n_layers = common["n_layers"]
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int_of(hf, "no_rope_layer_interval", where, 4)
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) != n_layers or any(f not in (0, 1) or isinstance(f, float)
                                                                    for f in flags):
        raise HFConfigError(f"{where}: no_rope_layers={flags!r} must list 0 or 1 for each of the {n_layers} layers")
    window, layer_types = None, None
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        hf_types = hf.get("layer_types") or ["sliding_attention" if not f else "full_attention" for f in flags]
        kinds = layer_types_of(hf_types, n_layers, where)
        if "sliding" in kinds:
            window, layer_types = int_of(hf, "sliding_window", where), kinds
    return ModelConfig(**common, **rope_of(hf, where, 2e6), n_experts=0, d_ff=int_of(hf, "intermediate_size", where),
                       nope_layers=tuple(i for i, f in enumerate(flags) if not f), sliding_window=window,
                       layer_types=layer_types)


def _write(cfg: ModelConfig, hf: dict) -> None:
    drop_moe_fields(hf)
    window = window_to_hf(cfg)
    hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, mlp_bias=False,
              no_rope_layers=[int(r) for r in cfg.layer_ropes], use_sliding_window=window is not None,
              sliding_window=window, layer_types=layer_types_to_hf(cfg),
              pad_token_id=None)   # SmolLM3Config's default (128004) is an embedding row HF checks


SMOLLM3 = FamilySpec(
    model_type="smollm3", architecture="SmolLM3ForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(DENSE, qk_norm=False, out_bias=cfg.attention_bias), moe=False, nope_layers=True,
    default_tie_embeddings=True, tool_format="qwen3")
