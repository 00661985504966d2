"""Gemma 3 (text; Gemma3ForCausalLM), also the language model of the multimodal Gemma 3
(model_type 'gemma3', Gemma3ForConditionalGeneration): Qwen3-like q/k norms, norms whose weights
are offsets from one, a norm on each sublayer's output too, a GeGLU MLP, embeddings scaled by
sqrt(hidden_size), the attention scaled by query_pre_attn_scalar ** -0.5, and sliding layers (five
in six by default) with a RoPE of their own (rope_local_base_freq, unscaled).

Tool calls: the chat template decides."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import (DENSE, layer_types_to_hf, per_kind_rope, per_kind_rope_to_hf,
                                                       window_to_hf)
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec, Wrapper
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, float_of, int_of, layer_types_of
from sfrrl_jax.config import ModelConfig

#: Gemma3TextConfig's defaults: the text_config of a published multimodal Gemma 3 (4B, 12B, 27B)
#: names only the fields that differ from them.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "tie_word_embeddings": True, "attention_bias": False}


def _text_config(hf: Mapping[str, Any], where: str) -> dict:
    """The language model's config of a multimodal Gemma 3 (model_type 'gemma3',
    Gemma3ForConditionalGeneration): its text_config over Gemma3TextConfig's defaults, with the
    checkpoint's dtype. The loader reads that model's tensors and leaves the vision tower."""
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise HFConfigError(f"{where}: model_type 'gemma3' without a text_config object")
    merged = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if "rope_parameters" in merged:   # transformers 5's spelling replaces the 4.x keys
        merged.pop("rope_theta"), merged.pop("rope_local_base_freq")
    if "layer_types" in merged:
        merged.pop("sliding_window_pattern")
    if not (text.get("dtype") or text.get("torch_dtype")) and (hf.get("dtype") or hf.get("torch_dtype")):
        merged["dtype"] = hf.get("dtype") or hf.get("torch_dtype")
    merged.update(model_type="gemma3_text", _name_or_path=hf.get("_name_or_path") or text.get("_name_or_path"))
    return merged


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh",):
        raise HFConfigError(f"{where}: hidden_activation={act!r} is not supported (supported: ['gelu_pytorch_tanh'])")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:   # Gemma 2's; Gemma 3 has neither
            raise HFConfigError(f"{where}: {key}={hf[key]!r} is not supported (logit soft-capping; null in Gemma 3)")
    if hf.get("use_bidirectional_attention"):
        raise HFConfigError(f"{where}: use_bidirectional_attention=True (an embedding model) is not supported")
    n_layers = common["n_layers"]
    hf_types = hf.get("layer_types")
    if hf_types is None:   # 4.x files: every `sliding_window_pattern`-th layer is global
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        pattern = int_of({"sliding_window_pattern": pattern}, "sliding_window_pattern", where)
        hf_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    layer_types = layer_types_of(hf_types, n_layers, where)
    window = int_of(hf, "sliding_window", where) if "sliding" in layer_types else None
    # 4.x files: the local layers' base is rope_local_base_freq
    rope, local_theta = per_kind_rope(hf, where, 1e6, "rope_local_base_freq", 10000.0)
    d_model = common["d_model"]
    return ModelConfig(
        **common, **rope, n_experts=0, d_ff=int_of(hf, "intermediate_size", where), qk_norm=True,
        sliding_window=window, layer_types=layer_types, rope_local_theta=local_theta,
        norm_offset=1.0, sandwich_norms=True, mlp_act="gelu_tanh", embed_scale=d_model ** 0.5,
        query_scale=float_of(hf, "query_pre_attn_scalar", where, 256) ** -0.5,
    )


def _write(cfg: ModelConfig, hf: dict) -> None:
    del hf["num_experts_per_tok"], hf["router_aux_loss_coef"], hf["hidden_act"]
    scalar = cfg.query_scale ** -2
    hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar,
              sliding_window=window_to_hf(cfg), layer_types=layer_types_to_hf(cfg),
              final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False,
              rope_parameters=per_kind_rope_to_hf(cfg))


def _check_export(cfg: ModelConfig) -> None:
    if cfg.query_scale is None or (cfg.rope_local_theta is None and "sliding" in (cfg.layer_types or ())):
        raise HFConfigError("ModelConfig(family='gemma3_text') needs query_scale (query_pre_attn_scalar ** -0.5) "
                            "and, with sliding layers, rope_local_theta (rope_local_base_freq)")


GEMMA3_TEXT = FamilySpec(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(DENSE, qk_norm=True, out_bias=cfg.attention_bias, norm_offset=1.0, sandwich_norms=True,
                           mlp_act="gelu_tanh", embed_scale=cfg.d_model ** 0.5),
    moe=False, wrapper=Wrapper("gemma3", _text_config, "text_config"),
    free=("query_scale", "rope_local_theta", "norm_scale_fp32"),   # its offset: fp32 anyway
    check_export=_check_export, default_head_dim=256, default_tie_embeddings=True)
