"""HF `config.json` <-> `ModelConfig`, for the families we support.

Field names follow transformers 5 (`rope_parameters`); the 4.x spelling (`rope_theta` at the top
level plus `rope_scaling`) is accepted on read, which is what most published checkpoints carry.
Anything our model cannot represent (an unknown RoPE type, a non-SiLU activation, ...) is refused with the offending key named, rather than loaded wrongly.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from sfrrl_jax.config import MODEL_DTYPES, ModelConfig

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "llama", "mistral", "qwen2", "qwen3",
                      "gemma3_text", "phi3", "granite")
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "granite")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "mixtral": "MixtralForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM"}
_HF_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
_TO_HF_LAYER_TYPES = {ours: theirs for theirs, ours in _HF_LAYER_TYPES.items()}
_LLAMA3_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"}
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow",
              "original_max_position_embeddings", "truncate"}
_LINEAR_KEYS = {"rope_type", "type", "rope_theta", "factor"}
_LONGROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "attention_factor", "long_factor", "short_factor",
                  "original_max_position_embeddings", "partial_rotary_factor"}


class HFConfigError(ValueError):
    """The HF config names a family or a variant our model does not implement."""


def read_hf_config(path: str | os.PathLike) -> dict:
    """The parsed `config.json` of an HF model directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFConfigError(f"{Path(path)}: no config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{file}: not valid JSON ({e})") from None


def _get(hf: Mapping[str, Any], key: str, where: str, default=...):
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise HFConfigError(f"{where}: config.json lacks required key {key!r}")
    return default


def _int(hf: Mapping[str, Any], key: str, where: str, default=..., lo: int = 1) -> int:
    """`hf[key]` as an int >= lo (an integral float like 2.0 too), or an error naming the key:
    int(2.5) would quietly make a 2-layer model of a 2.5-layer config."""
    value = _get(hf, key, where, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HFConfigError(f"{where}: {key}={value!r} must be an integer")
    if value < lo:
        raise HFConfigError(f"{where}: {key}={value} must be >= {lo}")
    return value


def _float(hf: Mapping[str, Any], key: str, where: str, default=...) -> float:
    value = _get(hf, key, where, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFConfigError(f"{where}: {key}={value!r} must be a number")
    return float(value)


def _bool(hf: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = _get(hf, key, where, default)
    if not isinstance(value, bool):
        raise HFConfigError(f"{where}: {key}={value!r} must be true or false")
    return value


#: The param / compute dtypes a config.json may name (`dtype`, or 4.x's `torch_dtype`).
DTYPES = MODEL_DTYPES


def _rope(hf: Mapping[str, Any], where: str, default_theta: float) -> dict:
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(field) or {}
    if not isinstance(params, Mapping):
        raise HFConfigError(f"{where}: {field}={params!r} must be an object")
    params = dict(params)
    at = f"{where} {field}"
    kind = params.get("rope_type", params.get("type", "default"))
    theta = _float({"rope_theta": params.get("rope_theta", hf.get("rope_theta"))}, "rope_theta", where, default_theta)
    max_len = _int(hf, "max_position_embeddings", where)
    if kind == "default":
        return {"rope_theta": theta, "rope_type": "default"}
    if kind == "linear":   # positions divided by `factor` (Gemma 3's global layers, 4B and up)
        unknown = sorted(set(params) - _LINEAR_KEYS)
        if unknown:
            raise HFConfigError(f"{where}: linear rope parameter(s) {unknown} are not supported; "
                                f"supported: {sorted(_LINEAR_KEYS)}")
        if params.get("factor") is None:
            raise HFConfigError(f"{where}: linear rope needs 'factor'")
        return {"rope_theta": theta, "rope_type": "linear", "rope_factor": _float(params, "factor", at)}
    if kind == "llama3":
        unknown = sorted(set(params) - _LLAMA3_KEYS)
        if unknown:
            raise HFConfigError(f"{where}: llama3 rope parameter(s) {unknown} are not supported; "
                                f"supported: {sorted(_LLAMA3_KEYS)}")
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if params.get(k) is None]
        if missing:
            raise HFConfigError(f"{where}: llama3 rope needs {missing}")
        return {"rope_theta": theta, "rope_type": "llama3", "rope_factor": _float(params, "factor", at),
                "rope_low_freq_factor": _float(params, "low_freq_factor", at),
                "rope_high_freq_factor": _float(params, "high_freq_factor", at),
                "rope_original_max_len": _int(params, "original_max_position_embeddings", at, max_len)}
    if kind != "yarn":
        raise HFConfigError(f"{where}: rope type {kind!r} is not supported (supported: 'default', 'linear', "
                            "'yarn', 'llama3')")
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:  # attention_factor, mscale, partial_rotary_factor, ... change the maths
        raise HFConfigError(f"{where}: yarn rope parameter(s) {unknown} are not supported; "
                            f"supported: {sorted(_YARN_KEYS)}")
    if params.get("factor") is None:
        raise HFConfigError(f"{where}: yarn rope needs 'factor'")
    return {
        "rope_theta": theta, "rope_type": "yarn", "rope_factor": _float(params, "factor", at),
        "rope_beta_fast": _float(params, "beta_fast", at, 32.0),
        "rope_beta_slow": _float(params, "beta_slow", at, 1.0),
        "rope_original_max_len": _int(params, "original_max_position_embeddings", at, max_len),
        "rope_truncate": _bool(params, "truncate", at, True),
    }


def _require(hf, key, allowed, where):
    value = hf.get(key, allowed[0])
    if value not in allowed:
        raise HFConfigError(f"{where}: {key}={value!r} is not supported (supported: {list(allowed)})")


def config_from_hf(hf: Mapping[str, Any], dtype: str | None = None, where: str = "config.json") -> ModelConfig:
    """Our `ModelConfig` for an HF config dict. `dtype` sets param and compute dtype
    (default: the config's `dtype`/`torch_dtype`, else float32)."""
    family = hf.get("model_type")
    if family == "gemma3":
        return config_from_hf(gemma3_text_config(hf, where), dtype, f"{where} text_config")
    if family not in SUPPORTED_FAMILIES:
        raise HFConfigError(f"{where}: model_type {family!r} is not supported; supported model_types: "
                            f"{list(SUPPORTED_FAMILIES)}")
    d_model = _int(hf, "hidden_size", where)
    n_heads = _int(hf, "num_attention_heads", where)
    if dtype is not None:
        if dtype not in DTYPES:
            raise HFConfigError(f"dtype={dtype!r} is not supported (supported: {list(DTYPES)})")
    else:
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
        if dtype not in DTYPES:
            raise HFConfigError(f"{where}: dtype {dtype!r} is not supported (supported: {list(DTYPES)})")
    common = dict(
        name=str(hf.get("_name_or_path") or family), family=family,
        vocab_size=_int(hf, "vocab_size", where), d_model=d_model,
        n_layers=_int(hf, "num_hidden_layers", where), n_heads=n_heads,
        n_kv_heads=_int(hf, "num_key_value_heads", where, n_heads),
        head_dim=_int(hf, "head_dim", where, 256 if family == "gemma3_text" else d_model // n_heads),
        top_k=_int(hf, "num_experts_per_tok", where, 1 if family in DENSE_FAMILIES else ...),
        rms_eps=_float(hf, "rms_norm_eps", where),
        max_seq_len=_int(hf, "max_position_embeddings", where),
        tie_embeddings=_bool(hf, "tie_word_embeddings", where, family == "gemma3_text"),
        attention_bias=_bool(hf, "attention_bias", where, family == "gpt_oss"),
        router_aux_coef=_float(hf, "router_aux_loss_coef", where, 0.0),
        param_dtype=dtype, compute_dtype=dtype,
    )
    if family == "gemma3_text":
        return _gemma3_config(hf, common, where)
    if family == "phi3":
        return _phi3_config(hf, common, where)
    if family == "granite":   # Llama's block with four multipliers
        _require(hf, "hidden_act", ("silu",), where)
        if hf.get("mlp_bias"):
            raise HFConfigError(f"{where}: mlp_bias=True is not supported (the MLP has no biases)")
        return ModelConfig(
            **common, **_rope(hf, where, 10000.0), n_experts=0, d_ff=_int(hf, "intermediate_size", where),
            embed_scale=_float(hf, "embedding_multiplier", where, 1.0),
            query_scale=_float(hf, "attention_multiplier", where, 1.0),
            residual_scale=_float(hf, "residual_multiplier", where, 1.0),
            logits_divisor=_float(hf, "logits_scaling", where, 1.0))
    if family in DENSE_FAMILIES:
        return _dense_config(hf, family, common, where)
    if family == "qwen3_moe":
        _require(hf, "hidden_act", ("silu",), where)
        dense = _qwen3_moe_dense_layers(hf, common["n_layers"], where)
        n_exp = _int(hf, "num_experts" if hf.get("num_experts") is not None else "num_local_experts", where)
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        return ModelConfig(
            **common, **_rope(hf, where, 10000.0), n_experts=n_exp,
            d_ff_expert=_int(hf, "moe_intermediate_size", where), router="softmax_topk",
            norm_topk_prob=_bool(hf, "norm_topk_prob", where, False), qk_norm=True,
            sliding_window=window, layer_types=("sliding",) * common["n_layers"] if window else None,
            dense_layers=dense, d_ff=_int(hf, "intermediate_size", where) if dense else 0,
        )
    if family == "qwen2_moe":
        # Qwen1.5-MoE / Qwen2-57B-A14B: Qwen2's attention (q/k/v biases, none on the output),
        # Qwen3-MoE's routing and dense layers, and a gated shared expert in every MoE layer
        _require(hf, "hidden_act", ("silu",), where)
        dense = _qwen3_moe_dense_layers(hf, common["n_layers"], where)
        window, layer_types = _qwen2_windows(hf, common["n_layers"], where)
        return ModelConfig(
            **{**common, "attention_bias": _bool(hf, "qkv_bias", where, True)}, attention_out_bias=False,
            **_rope(hf, where, 10000.0), n_experts=_int(hf, "num_experts", where),
            d_ff_expert=_int(hf, "moe_intermediate_size", where), router="softmax_topk",
            norm_topk_prob=_bool(hf, "norm_topk_prob", where, False),
            d_ff_shared=_int(hf, "shared_expert_intermediate_size", where), shared_expert_gate=True,
            sliding_window=window, layer_types=layer_types,
            dense_layers=dense, d_ff=_int(hf, "intermediate_size", where) if dense else 0,
        )
    if family == "mixtral":
        _require(hf, "hidden_act", ("silu",), where)
        window = hf.get("sliding_window")
        return ModelConfig(
            **common, **_rope(hf, where, 1e6), n_experts=_int(hf, "num_local_experts", where),
            d_ff_expert=_int(hf, "intermediate_size", where), router="topk_softmax",
            sliding_window=window, layer_types=("sliding",) * common["n_layers"] if window else None,
        )
    # gpt_oss
    n_layers = common["n_layers"]
    hf_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(n_layers)]
    layer_types = _layer_types(hf_types, n_layers, where)
    return ModelConfig(
        **common, **_rope(hf, where, 150000.0), n_experts=_int(hf, "num_local_experts", where),
        d_ff_expert=_int(hf, "intermediate_size", where), router="topk_softmax",
        router_bias=True, expert_bias=True, expert_act="gptoss_swiglu",
        swiglu_limit=_float(hf, "swiglu_limit", where, 7.0), swiglu_alpha=_float(hf, "swiglu_alpha", where, 1.702),
        attn_sinks=True, sliding_window=hf.get("sliding_window") if "sliding" in layer_types else None,
        layer_types=layer_types,
    )


def _qwen3_moe_dense_layers(hf: Mapping[str, Any], n_layers: int, where: str) -> tuple[int, ...]:
    """The layers transformers' Qwen3MoeDecoderLayer builds with a dense MLP: layer i is sparse
    iff i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0."""
    step = hf.get("decoder_sparse_step")
    step = 1 if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise HFConfigError(f"{where}: decoder_sparse_step={step!r} must be an int >= 1")
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise HFConfigError(f"{where}: mlp_only_layers={only!r} must be a list of layer indices")
    outside = [i for i in only if not 0 <= i < n_layers]
    if outside:
        raise HFConfigError(f"{where}: mlp_only_layers={only} names layer(s) {outside} outside "
                            f"[0, {n_layers}) (num_hidden_layers={n_layers})")
    dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    if len(dense) == n_layers:
        raise HFConfigError(f"{where}: mlp_only_layers={only} with decoder_sparse_step={step} leaves no "
                            f"MoE layer among the {n_layers}; not supported for qwen3_moe")
    return dense


def _layer_types(hf_types, n_layers: int, where: str) -> tuple[str, ...]:
    """HF `layer_types` -> ours ('sliding' / 'full'), one per layer; other kinds are refused."""
    bad = sorted(set(hf_types) - set(_HF_LAYER_TYPES))
    if bad:
        raise HFConfigError(f"{where}: layer_types contains {bad}; supported: {sorted(_HF_LAYER_TYPES)}")
    if len(hf_types) != n_layers:
        raise HFConfigError(f"{where}: layer_types has {len(hf_types)} entries for {n_layers} layers")
    return tuple(_HF_LAYER_TYPES[t] for t in hf_types)


def _qwen2_windows(hf: Mapping[str, Any], n_layers: int, where: str) -> tuple[int | None, tuple | None]:
    """(sliding_window, layer_types) of a Qwen2/Qwen3 config: transformers 5 writes layer_types;
    older files say use_sliding_window + max_window_layers (layers from max_window_layers on use
    the window). (None, None) when no layer slides."""
    hf_types = hf.get("layer_types")
    if hf_types is None and hf.get("use_sliding_window") and hf.get("sliding_window"):
        first = _int(hf, "max_window_layers", where, n_layers, lo=0)
        hf_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    kinds = () if hf_types is None else _layer_types(hf_types, n_layers, where)
    if "sliding" in kinds:
        return _int(hf, "sliding_window", where), kinds
    return None, None


def _dense_config(hf: Mapping[str, Any], family: str, common: dict, where: str) -> ModelConfig:
    """Llama / Mistral / Qwen2 / Qwen3: a SwiGLU MLP in every layer. Llama's optional q/k/v/o bias
    is one switch (attention_bias); Mistral is Llama without biases, its `sliding_window` (when
    not null: v0.1) on every layer; Qwen2 has q/k/v biases and none on the output; Qwen3 has q/k
    norms."""
    _require(hf, "hidden_act", ("silu",), where)
    if hf.get("mlp_bias"):
        raise HFConfigError(f"{where}: mlp_bias=True is not supported (the MLP has no biases)")
    n_layers = common["n_layers"]
    window, layer_types = None, None
    if family in ("qwen2", "qwen3"):
        window, layer_types = _qwen2_windows(hf, n_layers, where)
    if family == "mistral":
        if hf.get("attention_bias"):  # MistralAttention builds its projections without biases
            raise HFConfigError(f"{where}: attention_bias=True is not supported for mistral (HF Mistral "
                                "has no attention biases)")
        if hf.get("sliding_window") is not None:
            window, layer_types = _int(hf, "sliding_window", where), ("sliding",) * n_layers
    extra: dict = {}
    if family == "qwen2":
        extra = dict(attention_bias=True, attention_out_bias=False)
    elif family == "qwen3":
        extra = dict(qk_norm=True)
    return ModelConfig(
        **{**common, **extra}, **_rope(hf, where, 10000.0), n_experts=0,
        d_ff=_int(hf, "intermediate_size", where), sliding_window=window, layer_types=layer_types,
    )


#: Gemma3TextConfig's defaults: the text_config of a published multimodal Gemma 3 (4B, 12B, 27B)
#: names only the fields that differ from them.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "tie_word_embeddings": True, "attention_bias": False}


def gemma3_text_config(hf: Mapping[str, Any], where: str) -> dict:
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


def _gemma3_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """Gemma 3 (text): Qwen3-like q/k norms, norms whose weights are offsets from one, a norm on
    each sublayer's output too, a GeGLU MLP, embeddings scaled by sqrt(hidden_size), the
    attention scaled by query_pre_attn_scalar ** -0.5, and sliding layers (five in six by
    default) with a RoPE of their own (rope_local_base_freq, unscaled)."""
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
        pattern = _int({"sliding_window_pattern": pattern}, "sliding_window_pattern", where)
        hf_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    layer_types = _layer_types(hf_types, n_layers, where)
    window = _int(hf, "sliding_window", where) if "sliding" in layer_types else None
    # RoPE: transformers 5 writes one parameter set per layer kind; 4.x files have the global
    # layers' rope_theta / rope_scaling and the local layers' rope_local_base_freq
    per_kind = hf.get("rope_parameters")
    if isinstance(per_kind, Mapping) and ("full_attention" in per_kind or "sliding_attention" in per_kind):
        full = dict(hf, rope_parameters=per_kind.get("full_attention") or {"rope_theta": 1e6})
        local = per_kind.get("sliding_attention") or {}
        local_theta = _float(local, "rope_theta", f"{where} rope_parameters.sliding_attention", 10000.0)
        local_kind = local.get("rope_type", local.get("type", "default"))
    else:
        full = dict(hf, rope_scaling=hf.get("rope_scaling") or None)
        local_theta = _float(hf, "rope_local_base_freq", where, 10000.0)
        local_kind = "default"
    if local_kind != "default":
        raise HFConfigError(f"{where}: the sliding layers' rope type {local_kind!r} is not supported (supported: "
                            "['default'])")
    rope = _rope(full, where, 1e6)
    d_model = common["d_model"]
    return ModelConfig(
        **common, **rope, n_experts=0, d_ff=_int(hf, "intermediate_size", where), qk_norm=True,
        sliding_window=window, layer_types=layer_types, rope_local_theta=local_theta,
        norm_offset=1.0, sandwich_norms=True, mlp_act="gelu_tanh", embed_scale=d_model ** 0.5,
        query_scale=_float(hf, "query_pre_attn_scalar", where, 256) ** -0.5,
    )


def _phi3_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """Phi-3 / Phi-3.5 / Phi-4-mini: Llama's block with q/k/v and gate/up fused in the checkpoint
    (split on load), RoPE on the leading `partial_rotary_factor` of each head (Phi-4-mini: 0.75),
    default or longrope scaling, and `sliding_window` (when not null) on every layer."""
    _require(hf, "hidden_act", ("silu",), where)
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    partial = _float({"partial_rotary_factor": params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))},
                     "partial_rotary_factor", where, 1.0)
    extra: dict = {"rope_partial_factor": partial}
    if params.get("rope_type", params.get("type")) in ("longrope", "su"):   # 'su': its name in early Phi-3 files
        at = f"{where} {field}"
        unknown = sorted(set(params) - _LONGROPE_KEYS)
        if unknown:
            raise HFConfigError(f"{where}: longrope parameter(s) {unknown} are not supported; "
                                f"supported: {sorted(_LONGROPE_KEYS)}")
        original = _int({"original_max_position_embeddings": params.get("original_max_position_embeddings",
                                                                        hf.get("original_max_position_embeddings"))},
                        "original_max_position_embeddings", at)
        factors = {}
        for key in ("long_factor", "short_factor"):
            value = _get(params, key, at)
            if not isinstance(value, list) or not all(isinstance(f, (int, float)) and not isinstance(f, bool)
                                                      for f in value):
                raise HFConfigError(f"{at}: {key} must be a list of numbers, got {value!r}")
            factors[key] = tuple(float(f) for f in value)
        factor = _float(params, "factor", at, common["max_seq_len"] / original)
        attention = params.get("attention_factor")   # HF's default: from the context's growth
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        extra.update(rope_type="longrope", rope_original_max_len=original, rope_long_factor=factors["long_factor"],
                     rope_short_factor=factors["short_factor"],
                     rope_attention_factor=_float({"attention_factor": attention}, "attention_factor", at),
                     rope_theta=_float({"rope_theta": params.get("rope_theta", hf.get("rope_theta"))}, "rope_theta",
                                       where, 10000.0))
    else:
        extra.update(_rope({**hf, field: {k: v for k, v in params.items() if k != "partial_rotary_factor"}},
                           where, 10000.0))
    window = None if hf.get("sliding_window") is None else _int(hf, "sliding_window", where)
    if window is not None and window >= common["max_seq_len"]:
        window = None   # Phi-4-mini's 262144 over 131072 positions: no window at all
    try:
        return ModelConfig(**common, **extra, n_experts=0, d_ff=_int(hf, "intermediate_size", where),
                           sliding_window=window, layer_types=("sliding",) * common["n_layers"] if window else None)
    except ValueError as e:   # factor counts and the rotated dims are checked by ModelConfig
        raise HFConfigError(f"{where}: {e}") from None


def _rope_to_hf(cfg: ModelConfig) -> dict:
    if cfg.rope_type == "default":
        return {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_type == "linear":
        return {"rope_theta": cfg.rope_theta, "rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_type == "longrope":
        return {"rope_theta": cfg.rope_theta, "rope_type": "longrope", "long_factor": list(cfg.rope_long_factor),
                "short_factor": list(cfg.rope_short_factor), "attention_factor": cfg.rope_attention_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    if cfg.rope_type == "llama3":
        return {"rope_theta": cfg.rope_theta, "rope_type": "llama3", "factor": cfg.rope_factor,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    return {"rope_theta": cfg.rope_theta, "rope_type": "yarn", "factor": cfg.rope_factor,
            "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
            "original_max_position_embeddings": cfg.rope_original_max_len, "truncate": cfg.rope_truncate}


def check_exportable(cfg: ModelConfig) -> None:
    """Raises if `cfg` uses a variant the HF class of its family cannot express."""
    dense = dict(n_experts=0, attn_sinks=False, router_bias=False, expert_bias=False)
    # Gemma's and Granite's variants of the block: none in the other families' HF classes
    plain = dict(norm_offset=0.0, sandwich_norms=False, mlp_act="silu", embed_scale=1.0, query_scale=None,
                 rope_local_theta=None, residual_scale=1.0, logits_divisor=1.0)
    want = {
        "llama": dict(dense, qk_norm=False, out_bias=cfg.attention_bias),
        "mistral": dict(dense, qk_norm=False, attention_bias=False, out_bias=False),
        "qwen2": dict(dense, qk_norm=False, attention_bias=True, out_bias=False),
        "qwen3": dict(dense, qk_norm=True, out_bias=cfg.attention_bias),
        "qwen3_moe": dict(router="softmax_topk", qk_norm=True, attn_sinks=False, router_bias=False,
                          expert_bias=False, expert_act="swiglu", d_ff_shared=0),
        "qwen2_moe": dict(router="softmax_topk", qk_norm=False, attn_sinks=False, router_bias=False,
                          expert_bias=False, expert_act="swiglu", out_bias=False, shared_expert_gate=True),
        "mixtral": dict(router="topk_softmax", qk_norm=False, attn_sinks=False, router_bias=False,
                        expert_bias=False, expert_act="swiglu", attention_bias=False, d_ff_shared=0),
        "gpt_oss": dict(router="topk_softmax", qk_norm=False, attn_sinks=True, router_bias=True,
                        expert_bias=True, expert_act="gptoss_swiglu", attention_bias=True, d_ff_shared=0),
        "gemma3_text": dict(dense, qk_norm=True, out_bias=cfg.attention_bias, norm_offset=1.0, sandwich_norms=True,
                            mlp_act="gelu_tanh", embed_scale=cfg.d_model ** 0.5, residual_scale=1.0,
                            logits_divisor=1.0),
        "phi3": dict(dense, qk_norm=False, attention_bias=False, out_bias=False),
        "granite": dict(dense, qk_norm=False, out_bias=cfg.attention_bias),
    }[cfg.family]
    if cfg.family != "phi3":
        want["rope_partial_factor"] = 1.0
    if cfg.family == "granite":   # its multipliers, the rest as Llama
        if cfg.query_scale is None:
            raise HFConfigError("ModelConfig(family='granite') needs query_scale (attention_multiplier)")
        want.update({k: v for k, v in plain.items() if k not in ("embed_scale", "query_scale", "residual_scale",
                                                                    "logits_divisor")})
    elif cfg.family != "gemma3_text":
        want.update(plain)
    elif cfg.query_scale is None or (cfg.rope_local_theta is None and "sliding" in (cfg.layer_types or ())):
        raise HFConfigError("ModelConfig(family='gemma3_text') needs query_scale (query_pre_attn_scalar ** -0.5) "
                            "and, with sliding layers, rope_local_theta (rope_local_base_freq)")
    if cfg.dense_layers and cfg.family not in ("qwen3_moe", "qwen2_moe"):
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has dense_layers={cfg.dense_layers}; HF "
                            f"{ARCHITECTURES[cfg.family]} has no dense layers (only qwen3_moe's mlp_only_layers)")
    if cfg.family not in DENSE_FAMILIES and not cfg.is_moe:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has n_experts=0 (dense); HF "
                            f"{ARCHITECTURES[cfg.family]} needs experts: use a dense family {list(DENSE_FAMILIES)}")
    wrong = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
    if wrong:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has {wrong}; HF {ARCHITECTURES[cfg.family]} "
                            f"requires {({k: want[k] for k in wrong})}")
    types = set(cfg.layer_types or ())
    if cfg.family in ("llama", "granite") and "sliding" in types:
        raise HFConfigError(f"ModelConfig(family='llama') has sliding layers (layer_types={cfg.layer_types}); "
                            "HF Llama has no sliding window")
    if cfg.family == "qwen2_moe" and not cfg.d_ff_shared:
        raise HFConfigError("ModelConfig(family='qwen2_moe') has d_ff_shared=0; HF Qwen2MoeForCausalLM has a "
                            "shared expert in every MoE layer")
    if cfg.family in ("qwen3_moe", "mixtral", "mistral", "phi3") and types and types != {"sliding"}:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}): HF applies sliding_window to every layer; "
                            f"layer_types={cfg.layer_types} mixes kinds")


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF `config.json` dict for `cfg` (transformers 5 field names)."""
    check_exportable(cfg)
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "num_experts_per_tok": cfg.top_k, "rms_norm_eps": cfg.rms_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": _rope_to_hf(cfg), "router_aux_loss_coef": cfg.router_aux_coef,
        "hidden_act": "silu", "dtype": cfg.param_dtype,
    }
    window = cfg.sliding_window if "sliding" in (cfg.layer_types or ()) else None
    if cfg.family == "gemma3_text":
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"], hf["hidden_act"]
        types = cfg.layer_types or ("full",) * cfg.n_layers
        scalar = cfg.query_scale ** -2
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, hidden_activation="gelu_pytorch_tanh",
                  query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar,
                  sliding_window=window, layer_types=[_TO_HF_LAYER_TYPES[t] for t in types],
                  final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False,
                  rope_parameters={"full_attention": _rope_to_hf(cfg),
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": cfg.rope_local_theta or cfg.rope_theta}})
    elif cfg.family == "granite":
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, mlp_bias=False,
                  embedding_multiplier=cfg.embed_scale, attention_multiplier=cfg.query_scale,
                  residual_multiplier=cfg.residual_scale, logits_scaling=cfg.logits_divisor)
    elif cfg.family == "phi3":
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        rope = {**_rope_to_hf(cfg), "partial_rotary_factor": cfg.rope_partial_factor}
        # pad_token_id: Phi3Config's default (32000) is an embedding row HF checks against the vocabulary
        hf.update(intermediate_size=cfg.d_ff, sliding_window=window, rope_parameters=rope,
                  original_max_position_embeddings=cfg.rope_original_max_len, pad_token_id=None)
    elif cfg.family in DENSE_FAMILIES:
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, mlp_bias=False)
        if cfg.family == "mistral":
            del hf["attention_bias"], hf["mlp_bias"]   # not MistralConfig fields: it has neither
            hf["sliding_window"] = window
        elif cfg.family != "llama":
            types = cfg.layer_types or ("full",) * cfg.n_layers
            hf.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=cfg.n_layers,
                      layer_types=[_TO_HF_LAYER_TYPES[t] for t in types])
            if cfg.family == "qwen2":
                del hf["attention_bias"]   # Qwen2's q/k/v biases are not optional
    elif cfg.family == "qwen3_moe":
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.d_ff_expert,
                  norm_topk_prob=cfg.norm_topk_prob, attention_bias=cfg.attention_bias,
                  decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers),
                  use_sliding_window=window is not None, sliding_window=window)
        if cfg.dense_layers:  # the dense layers' MLP width (transformers' default would be 6144)
            hf["intermediate_size"] = cfg.d_ff
    elif cfg.family == "qwen2_moe":
        types = cfg.layer_types or ("full",) * cfg.n_layers
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.d_ff_expert,
                  shared_expert_intermediate_size=cfg.d_ff_shared, norm_topk_prob=cfg.norm_topk_prob,
                  qkv_bias=cfg.attention_bias, decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers),
                  use_sliding_window=window is not None, sliding_window=window, max_window_layers=cfg.n_layers,
                  layer_types=[_TO_HF_LAYER_TYPES[t] for t in types],
                  intermediate_size=cfg.d_ff if cfg.dense_layers else cfg.d_ff_shared)
    elif cfg.family == "mixtral":
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert, sliding_window=window)
    else:
        types = cfg.layer_types or ("full",) * cfg.n_layers
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert,
                  attention_bias=True, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                  sliding_window=cfg.sliding_window,
                  layer_types=[_TO_HF_LAYER_TYPES[t] for t in types])
    return hf
