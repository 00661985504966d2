"""config.json readers of the families whose block is not Llama's: Gemma 3 (text, and the language
model of the multimodal one), Phi-3, OLMo 2/3, SmolLM3, GLM-4.5 (MoE) and the latent-attention
DeepSeek-V2 / V3 and GLM-4.7-Flash (MoE). `hf_config.config_from_hf` dispatches to them."""
from __future__ import annotations

import math
from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.hf_fields import (LONGROPE_KEYS, HFConfigError, bool_of, float_of, int_of, layer_types_of,
                                                require, rope_of, value_of)
from sfrrl_jax.config import ModelConfig


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


def per_kind_rope(hf: Mapping[str, Any], where: str, default_theta: float, local_theta_key: str,
                  default_local_theta: float) -> tuple[dict, float]:
    """(the full layers' RoPE fields, the sliding layers' base) of a model whose two layer kinds
    rotate differently (Gemma 3, OLMo 3): transformers 5 writes one rope_parameters set per kind;
    4.x files have the full layers' rope_theta / rope_scaling and the sliding layers' base under
    `local_theta_key`. The sliding layers' RoPE is unscaled; another type is refused by name."""
    per_kind = hf.get("rope_parameters")
    if isinstance(per_kind, Mapping) and ("full_attention" in per_kind or "sliding_attention" in per_kind):
        full = dict(hf, rope_parameters=per_kind.get("full_attention") or {"rope_theta": default_theta})
        local, at = per_kind.get("sliding_attention") or {}, f"{where} rope_parameters.sliding_attention"
        local_theta = float_of(local, "rope_theta", at, default_local_theta)
        local_kind = local.get("rope_type", local.get("type", "default"))
    else:
        full = dict(hf, rope_scaling=hf.get("rope_scaling") or None)
        local_theta, local_kind = float_of(hf, local_theta_key, where, default_local_theta), "default"
    if local_kind != "default":
        raise HFConfigError(f"{where}: the sliding layers' rope type {local_kind!r} is not supported (supported: "
                            "['default'])")
    return rope_of(full, where, default_theta), local_theta


def gemma3_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
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


def phi3_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """Phi-3 / Phi-3.5 / Phi-4-mini: Llama's block with q/k/v and gate/up fused in the checkpoint
    (split on load), RoPE on the leading `partial_rotary_factor` of each head (Phi-4-mini: 0.75),
    default or longrope scaling, and `sliding_window` (when not null) on every layer."""
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


def olmo_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """OLMo 2 / OLMo 3: Llama's attention and MLP in a post-norm block (each sublayer's output
    normed before the residual add, no norm on its input), q/k norms over the whole projection
    rather than per head, and norms that multiply by their weight in fp32. OLMo 3 adds sliding
    layers (three in four by default) whose RoPE is unscaled; a `rope_scaling` (OLMo 3's YaRN)
    applies to its full layers only, as transformers reads it."""
    family = common["family"]
    require(hf, "hidden_act", ("silu",), where)
    if hf.get("clip_qkv") is not None:   # OLMo 1's; OLMo 2/3 have none
        raise HFConfigError(f"{where}: clip_qkv={hf['clip_qkv']!r} is not supported (OLMo 1's q/k/v clipping)")
    n_layers = common["n_layers"]
    extra: dict = {}
    if family == "olmo2":
        extra.update(rope_of(hf, where, 10000.0))
    else:
        hf_types = hf.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                             for i in range(n_layers)]
        layer_types = layer_types_of(hf_types, n_layers, where)
        # 4.x files: rope_theta is both kinds' base, rope_scaling the full layers' alone
        rope, local_theta = per_kind_rope(hf, where, 10000.0, "rope_theta", 10000.0)
        extra.update(rope)
        if "sliding" in layer_types:
            extra.update(sliding_window=int_of(hf, "sliding_window", where, 4096), layer_types=layer_types,
                         rope_local_theta=local_theta)
    try:
        return ModelConfig(**common, **extra, n_experts=0, d_ff=int_of(hf, "intermediate_size", where),
                           qk_norm=True, qk_norm_over_heads=True, pre_norms=False, sandwich_norms=True,
                           norm_scale_fp32=True)
    except HFConfigError:   # a field's own error already names it
        raise
    except ValueError as e:
        raise HFConfigError(f"{where}: {e}") from None


def smollm3_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """SmolLM3: Llama's block, with no RoPE in the layers `no_rope_layers` marks 0 (by default
    every `no_rope_layer_interval`-th), and a window (with `use_sliding_window`) on the layers
    `layer_types` marks sliding (by default the NoPE ones), as transformers builds them."""
    require(hf, "hidden_act", ("silu",), where)
    if hf.get("mlp_bias"):
        raise HFConfigError(f"{where}: mlp_bias=True is not supported (the MLP has no biases)")
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


def _deepseek_moe(hf: Mapping[str, Any], n_layers: int, where: str, first_dense_default: int,
                  shared_default: int) -> dict:
    """DeepSeek's MoE layout, GLM-4.5's too: the first `first_k_dense_replace` layers dense
    (intermediate_size wide), the others `n_routed_experts` experts plus an ungated shared expert
    of `n_shared_experts` x moe_intermediate_size (the defaults: their config classes')."""
    require(hf, "hidden_act", ("silu",), where)
    first_dense = int_of(hf, "first_k_dense_replace", where, first_dense_default, lo=0)
    if first_dense >= n_layers:
        raise HFConfigError(f"{where}: first_k_dense_replace={first_dense} leaves no MoE layer among the {n_layers}")
    d_ff_expert = int_of(hf, "moe_intermediate_size", where)
    return dict(n_experts=int_of(hf, "n_routed_experts", where), d_ff_expert=d_ff_expert,
                d_ff_shared=int_of(hf, "n_shared_experts", where, shared_default, lo=0) * d_ff_expert,
                dense_layers=tuple(range(first_dense)),
                d_ff=int_of(hf, "intermediate_size", where) if first_dense else 0)


def _grouped_sigmoid_moe(hf: Mapping[str, Any], n_layers: int, where: str) -> dict:
    """The MoE of GLM-4.5 and DeepSeek-V3 (one rule): `_deepseek_moe`'s layers, routed by sigmoid
    scores with a selection bias among `topk_group` of `n_group` groups, optionally renormalised,
    scaled by `routed_scaling_factor`; the router kept in fp32, as transformers keeps it."""
    return dict(_deepseek_moe(hf, n_layers, where, 1, 1), router="sigmoid_topk", router_fp32=True,
                norm_topk_prob=bool_of(hf, "norm_topk_prob", where, True),
                router_scale=float_of(hf, "routed_scaling_factor", where, 1.0),
                router_groups=int_of(hf, "n_group", where, 1), router_topk_groups=int_of(hf, "topk_group", where, 1))


def minimax_m2_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """MiniMax-M2 (MiniMaxM2ForCausalLM): Mixtral's block with OLMo's q/k norms over the whole
    projection (`qk_norm_type='per_layer'`), RoPE on the leading `rotary_dim` dims of each head
    (the released configs' name; `partial_rotary_factor` too), and every layer's experts routed by
    sigmoid scores plus a selection bias (`e_score_correction_bias`), renormalised. The full
    attention of every layer (`attn_type_list` all 1) only: MiniMax-01's lightning attention is
    refused, as are a shared expert and a softmax router. Multi-token-prediction modules are not
    read."""
    require(hf, "hidden_act", ("silu",), where)
    require(hf, "scoring_func", ("sigmoid",), where)
    for key, want in (("use_qk_norm", True), ("use_routing_bias", True)):
        if hf.get(key, want) != want:
            raise HFConfigError(f"{where}: {key}={hf[key]!r} is not supported (MiniMaxM2ForCausalLM: {want})")
    require(hf, "qk_norm_type", ("per_layer",), where)
    if int_of(hf, "shared_intermediate_size", where, 0, lo=0):
        raise HFConfigError(f"{where}: shared_intermediate_size={hf['shared_intermediate_size']} is not supported "
                            "(no shared expert)")
    kinds = hf.get("attn_type_list")
    if kinds is not None and (not isinstance(kinds, list) or set(kinds) - {1}):
        raise HFConfigError(f"{where}: attn_type_list={kinds!r}: only full attention (1) in every layer is "
                            "supported (0, MiniMax-01's lightning attention, is not)")
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is None and hf.get("rotary_dim") is not None:
        partial = int_of(hf, "rotary_dim", where) / common["head_dim"]
    rope = rope_of({**hf, field: params or None}, where, 5e6)
    return _checked(where, **common, **rope, n_experts=int_of(hf, "num_local_experts", where),
                    d_ff_expert=int_of(hf, "intermediate_size", where), router="sigmoid_topk", norm_topk_prob=True,
                    qk_norm=True, qk_norm_over_heads=True,
                    rope_partial_factor=float_of({"partial_rotary_factor": partial}, "partial_rotary_factor", where,
                                                 1.0))

def _checked(where: str, **fields) -> ModelConfig:
    """ModelConfig(**fields), a ValueError of its checks (groups that do not divide the experts,
    rotated dims, ...) as an HFConfigError naming the file."""
    try:
        return ModelConfig(**fields)
    except HFConfigError:   # a field's own error already names it
        raise
    except ValueError as e:
        raise HFConfigError(f"{where}: {e}") from None


def glm4_moe_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """GLM-4.5 / 4.5-Air / 4.6 (Glm4MoeForCausalLM): q/k/v biases and none on the output, optional
    per-head q/k norms, RoPE on the leading `partial_rotary_factor` of each head (0.5 by default),
    the MoE of `_grouped_sigmoid_moe`. The checkpoint's multi-token-prediction layers (past
    num_hidden_layers) are not read."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    partial = float_of({"partial_rotary_factor": params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))},
                       "partial_rotary_factor", where, 0.5)
    return _checked(where, **{**common, "attention_bias": bool_of(hf, "attention_bias", where, False)},
                    attention_out_bias=False, **rope_of({**hf, field: params or None}, where, 10000.0),
                    rope_partial_factor=partial, qk_norm=bool_of(hf, "use_qk_norm", where, False),
                    **_grouped_sigmoid_moe(hf, common["n_layers"], where))


def _latent_attention_fields(hf: Mapping[str, Any], where: str) -> dict:
    """DeepSeek-V2/V3's multi-head latent attention as ModelConfig fields: `q_lora_rank` (null:
    none), `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, cached as one KV
    head of kv_lora_rank + qk_rope_head_dim dims; RoPE as `rope_of` reads it, and the scores
    scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times YaRN's mscale(factor,
    mscale_all_dim)^2 where the rope parameters give one, as transformers does. Biases and other
    routers' scoring are refused by name. (FP8 weights are the loader's concern: `fp8_weights`.)"""
    require(hf, "moe_layer_freq", (1,), where)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFConfigError(f"{where}: {flag}=True is not supported with latent attention (no biases)")
    nope, rope_dims = int_of(hf, "qk_nope_head_dim", where), int_of(hf, "qk_rope_head_dim", where)
    kv_rank = int_of(hf, "kv_lora_rank", where)
    rope = rope_of(hf, where, 10000.0)
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    all_dim = (hf.get(field) or {}).get("mscale_all_dim")
    query_scale = None
    if rope["rope_type"] != "default" and all_dim and rope["rope_factor"] > 1:   # else mscale is 1
        m = 0.1 * float_of({"mscale_all_dim": all_dim}, "mscale_all_dim", where) * math.log(rope["rope_factor"]) + 1
        query_scale = (nope + rope_dims) ** -0.5 * m * m
    return dict(rope, n_kv_heads=1, head_dim=kv_rank + rope_dims, attention_bias=False, query_scale=query_scale,
                mla_kv_rank=kv_rank,
                mla_q_rank=0 if hf.get("q_lora_rank") is None else int_of(hf, "q_lora_rank", where),
                mla_nope_dim=nope, mla_rope_dim=rope_dims, mla_v_dim=int_of(hf, "v_head_dim", where))


def deepseek_v3_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """DeepSeek-V3 / R1 and Moonlight (DeepseekV3ForCausalLM; Kimi K2's config names its own
    model_type, not read): latent attention (`_latent_attention_fields`; `rope_interleave` is the
    checkpoint's layout, the loader's concern) and the MoE of `_grouped_sigmoid_moe`.
    Multi-token-prediction layers (past num_hidden_layers) are not read."""
    require(hf, "scoring_func", ("sigmoid",), where)
    require(hf, "topk_method", ("noaux_tc",), where)
    return _checked(where, **{**common, **_latent_attention_fields(hf, where)},
                    **_grouped_sigmoid_moe(hf, common["n_layers"], where))


def deepseek_v2_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """DeepSeek-V2 / V2.5 / V2-Lite, Coder-V2 (DeepseekV2ForCausalLM): latent attention with RoPE on
    adjacent pairs (`_latent_attention_fields`), the first `first_k_dense_replace` layers dense,
    the others routed by softmax then top-k (`topk_method='greedy'`; 'group_limited_greedy': among
    the `topk_group` of `n_group` groups whose best probability is highest), never renormalised
    (transformers ignores norm_topk_prob here), times `routed_scaling_factor`, plus an ungated
    shared expert of `n_shared_experts` x moe_intermediate_size; the router in fp32 as
    transformers keeps it."""
    require(hf, "scoring_func", ("softmax",), where)
    require(hf, "topk_method", ("greedy", "group_limited_greedy"), where)
    groups = {}
    if hf.get("topk_method") == "group_limited_greedy":
        groups = dict(router_groups=int_of(hf, "n_group", where), router_topk_groups=int_of(hf, "topk_group", where))
    return _checked(where, **{**common, **_latent_attention_fields(hf, where)}, router="softmax_topk",
                    router_fp32=True, norm_topk_prob=False, **groups,
                    router_scale=float_of(hf, "routed_scaling_factor", where, 1.0),
                    **_deepseek_moe(hf, common["n_layers"], where, 0, 2))


def glm4_moe_lite_config(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's latent attention and GLM's MoE
    (`_grouped_sigmoid_moe`), its dense layers the ones `mlp_layer_types` names 'dense' (by
    default the first; transformers reads no first_k_dense_replace here). RoPE over all of
    qk_rope_head_dim: a partial_rotary_factor below 1 is refused."""
    require(hf, "topk_method", ("noaux_tc",), where)
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and float_of({"partial_rotary_factor": partial}, "partial_rotary_factor", where) != 1.0:
        raise HFConfigError(f"{where}: partial_rotary_factor={partial} is not supported with latent attention "
                            "(RoPE rotates all of qk_rope_head_dim)")
    hf = {**hf, field: params or None}
    n_layers = common["n_layers"]
    types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1)
    if (not isinstance(types, list) or len(types) != n_layers or set(types) - {"dense", "sparse"}
            or "sparse" not in types):
        raise HFConfigError(f"{where}: mlp_layer_types={types!r} must name each of the {n_layers} layers 'dense' or "
                            "'sparse', at least one 'sparse'")
    dense = tuple(i for i, t in enumerate(types) if t == "dense")
    moe = dict(_grouped_sigmoid_moe({**hf, "first_k_dense_replace": 0}, n_layers, where), dense_layers=dense,
               d_ff=int_of(hf, "intermediate_size", where) if dense else 0)
    return _checked(where, **{**common, **_latent_attention_fields(hf, where)}, **moe)
