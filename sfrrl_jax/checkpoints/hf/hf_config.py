"""HF `config.json` <-> `ModelConfig`, for the families we support.

Field names follow transformers 5 (`rope_parameters`); the 4.x spelling (`rope_theta` at the top
level plus `rope_scaling`) is accepted on read, which is what most published checkpoints carry.
Anything our model cannot represent (an unknown RoPE type, a non-SiLU activation, ...) is refused
with the offending key named, rather than loaded wrongly. The typed field readers are in
`hf_fields`, Gemma 3's, Phi-3's and OLMo's readers in `family_configs`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.family_configs import (deepseek_v2_config, deepseek_v3_config, gemma3_config,
                                                     gemma3_text_config, glm4_moe_config, glm4_moe_lite_config,
                                                     minimax_m2_config, olmo_config, phi3_config, smollm3_config)
from sfrrl_jax.checkpoints.hf.hf_fields import (DTYPES, TO_HF_LAYER_TYPES, HFConfigError, bool_of, float_of, int_of,
                                                layer_types_of, read_hf_config, require, rope_of, rope_to_hf)
from sfrrl_jax.config import ModelConfig

__all__ = ["ARCHITECTURES", "DENSE_FAMILIES", "DTYPES", "SUPPORTED_FAMILIES", "HFConfigError", "check_exportable",
           "config_from_hf", "config_to_hf", "read_hf_config"]

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "llama", "mistral", "qwen2", "qwen3",
                      "gemma3_text", "phi3", "granite", "olmo2", "olmo3", "smollm3", "olmoe", "glm4_moe",
                      "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minimax_m2", "seed_oss")
# Kimi K2 (Instruct, Thinking's bf16 / FP8 weights) is DeepSeek-V3's architecture under its own model_type
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
LATENT_ATTENTION_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "granite", "olmo2", "olmo3",
                  "smollm3", "seed_oss")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "mixtral": "MixtralForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "olmo3": "Olmo3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
                 "minimax_m2": "MiniMaxM2ForCausalLM", "seed_oss": "SeedOssForCausalLM"}


def config_from_hf(hf: Mapping[str, Any], dtype: str | None = None, where: str = "config.json") -> ModelConfig:
    """Our `ModelConfig` for an HF config dict.

    Args:
      hf: the parsed `config.json` (transformers 5 or 4.x field names). Gemma 3's multimodal config is read through
        its `text_config`; `kimi_k2` is read as `deepseek_v3`.
      dtype: sets param and compute dtype, one of `DTYPES` (default: the config's `dtype`/`torch_dtype`, else
        float32).
      where: names the config in error messages.
    Returns:
      The `ModelConfig` of the model the config describes.
    Raises:
      HFConfigError: when the model_type is not supported, a required key is missing or malformed, the dtype is not
        supported, or the config uses a variant our model cannot represent (the offending key named).
    """
    family = hf.get("model_type")
    if family == "gemma3":
        return config_from_hf(gemma3_text_config(hf, where), dtype, f"{where} text_config")
    if family in MODEL_TYPE_ALIASES:   # another name for an architecture we read
        return config_from_hf({**hf, "model_type": MODEL_TYPE_ALIASES[family],
                               "_name_or_path": hf.get("_name_or_path") or family}, dtype, where)
    if family not in SUPPORTED_FAMILIES:
        raise HFConfigError(f"{where}: model_type {family!r} is not supported; supported model_types: "
                            f"{list(SUPPORTED_FAMILIES) + list(MODEL_TYPE_ALIASES)}")
    d_model = int_of(hf, "hidden_size", where)
    n_heads = int_of(hf, "num_attention_heads", where)
    if dtype is not None:
        if dtype not in DTYPES:
            raise HFConfigError(f"dtype={dtype!r} is not supported (supported: {list(DTYPES)})")
    else:
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
        if dtype not in DTYPES:
            raise HFConfigError(f"{where}: dtype {dtype!r} is not supported (supported: {list(DTYPES)})")
    common = dict(
        name=str(hf.get("_name_or_path") or family), family=family,
        vocab_size=int_of(hf, "vocab_size", where), d_model=d_model,
        n_layers=int_of(hf, "num_hidden_layers", where), n_heads=n_heads,
        n_kv_heads=int_of(hf, "num_key_value_heads", where, n_heads),
        head_dim=int_of(hf, "head_dim", where, 256 if family == "gemma3_text" else d_model // n_heads),
        top_k=int_of(hf, "num_experts_per_tok", where, 1 if family in DENSE_FAMILIES else ...),
        rms_eps=float_of(hf, "rms_norm_eps", where),
        max_seq_len=int_of(hf, "max_position_embeddings", where),
        tie_embeddings=bool_of(hf, "tie_word_embeddings", where, family in ("gemma3_text", "smollm3")),
        attention_bias=bool_of(hf, "attention_bias", where, family == "gpt_oss"),
        router_aux_coef=float_of(hf, "router_aux_loss_coef", where, 0.0),
        param_dtype=dtype, compute_dtype=dtype,
    )
    if family == "gemma3_text":
        return gemma3_config(hf, common, where)
    if family == "phi3":
        return phi3_config(hf, common, where)
    if family in ("olmo2", "olmo3"):
        return olmo_config(hf, common, where)
    if family == "smollm3":
        return smollm3_config(hf, common, where)
    if family == "glm4_moe":
        return glm4_moe_config(hf, common, where)
    if family == "deepseek_v3":
        return deepseek_v3_config(hf, common, where)
    if family == "deepseek_v2":
        return deepseek_v2_config(hf, common, where)
    if family == "glm4_moe_lite":
        return glm4_moe_lite_config(hf, common, where)
    if family == "minimax_m2":
        return minimax_m2_config(hf, common, where)
    if family == "seed_oss":   # Llama's block, the output projection's bias apart from q/k/v's
        require(hf, "hidden_act", ("silu",), where)
        if hf.get("mlp_bias"):
            raise HFConfigError(f"{where}: mlp_bias=True is not supported (the MLP has no biases)")
        # attention_dropout / residual_dropout act in HF's training mode only: not part of the function
        return ModelConfig(**common, **rope_of(hf, where, 1e7), n_experts=0,
                           d_ff=int_of(hf, "intermediate_size", where),
                           attention_out_bias=bool_of(hf, "attention_out_bias", where, False))
    if family == "granite":   # Llama's block with four multipliers
        require(hf, "hidden_act", ("silu",), where)
        if hf.get("mlp_bias"):
            raise HFConfigError(f"{where}: mlp_bias=True is not supported (the MLP has no biases)")
        return ModelConfig(
            **common, **rope_of(hf, where, 10000.0), n_experts=0, d_ff=int_of(hf, "intermediate_size", where),
            embed_scale=float_of(hf, "embedding_multiplier", where, 1.0),
            query_scale=float_of(hf, "attention_multiplier", where, 1.0),
            residual_scale=float_of(hf, "residual_multiplier", where, 1.0),
            logits_divisor=float_of(hf, "logits_scaling", where, 1.0))
    if family in DENSE_FAMILIES:
        return _dense_config(hf, family, common, where)
    if family == "qwen3_moe":
        require(hf, "hidden_act", ("silu",), where)
        dense = _qwen3_moe_dense_layers(hf, common["n_layers"], where)
        n_exp = int_of(hf, "num_experts" if hf.get("num_experts") is not None else "num_local_experts", where)
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        return ModelConfig(
            **common, **rope_of(hf, where, 10000.0), n_experts=n_exp,
            d_ff_expert=int_of(hf, "moe_intermediate_size", where), router="softmax_topk",
            norm_topk_prob=bool_of(hf, "norm_topk_prob", where, False), qk_norm=True,
            sliding_window=window, layer_types=("sliding",) * common["n_layers"] if window else None,
            dense_layers=dense, d_ff=int_of(hf, "intermediate_size", where) if dense else 0,
        )
    if family == "qwen2_moe":
        # Qwen1.5-MoE / Qwen2-57B-A14B: Qwen2's attention (q/k/v biases, none on the output),
        # Qwen3-MoE's routing and dense layers, and a gated shared expert in every MoE layer
        require(hf, "hidden_act", ("silu",), where)
        dense = _qwen3_moe_dense_layers(hf, common["n_layers"], where)
        window, layer_types = _qwen2_windows(hf, common["n_layers"], where)
        return ModelConfig(
            **{**common, "attention_bias": bool_of(hf, "qkv_bias", where, True)}, attention_out_bias=False,
            **rope_of(hf, where, 10000.0), n_experts=int_of(hf, "num_experts", where),
            d_ff_expert=int_of(hf, "moe_intermediate_size", where), router="softmax_topk",
            norm_topk_prob=bool_of(hf, "norm_topk_prob", where, False),
            d_ff_shared=int_of(hf, "shared_expert_intermediate_size", where), shared_expert_gate=True,
            sliding_window=window, layer_types=layer_types,
            dense_layers=dense, d_ff=int_of(hf, "intermediate_size", where) if dense else 0,
        )
    if family == "olmoe":
        # OLMoE: Llama's pre-norm block, q/k norms over the whole projection (as OLMo 2's, but
        # multiplying after the cast), softmax-then-top-k routing over per-expert SwiGLU MLPs
        require(hf, "hidden_act", ("silu",), where)
        if hf.get("clip_qkv") is not None:
            raise HFConfigError(f"{where}: clip_qkv={hf['clip_qkv']!r} is not supported (q/k/v clipping)")
        if common["head_dim"] * n_heads != d_model:   # HF builds q_norm over hidden_size
            raise HFConfigError(f"{where}: head_dim={common['head_dim']} x num_attention_heads={n_heads} != "
                                f"hidden_size={d_model}; HF OLMoE's q_norm spans hidden_size")
        return ModelConfig(
            **common, **rope_of(hf, where, 10000.0), n_experts=int_of(hf, "num_experts", where),
            d_ff_expert=int_of(hf, "intermediate_size", where), router="softmax_topk",
            norm_topk_prob=bool_of(hf, "norm_topk_prob", where, False), qk_norm=True, qk_norm_over_heads=True)
    if family == "mixtral":
        require(hf, "hidden_act", ("silu",), where)
        window = hf.get("sliding_window")
        return ModelConfig(
            **common, **rope_of(hf, where, 1e6), n_experts=int_of(hf, "num_local_experts", where),
            d_ff_expert=int_of(hf, "intermediate_size", where), router="topk_softmax",
            sliding_window=window, layer_types=("sliding",) * common["n_layers"] if window else None,
        )
    # gpt_oss
    n_layers = common["n_layers"]
    hf_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(n_layers)]
    layer_types = layer_types_of(hf_types, n_layers, where)
    return ModelConfig(
        **common, **rope_of(hf, where, 150000.0), n_experts=int_of(hf, "num_local_experts", where),
        d_ff_expert=int_of(hf, "intermediate_size", where), router="topk_softmax",
        router_bias=True, expert_bias=True, expert_act="gptoss_swiglu",
        swiglu_limit=float_of(hf, "swiglu_limit", where, 7.0), swiglu_alpha=float_of(hf, "swiglu_alpha", where, 1.702),
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


def _qwen2_windows(hf: Mapping[str, Any], n_layers: int, where: str) -> tuple[int | None, tuple | None]:
    """(sliding_window, layer_types) of a Qwen2/Qwen3 config: transformers 5 writes layer_types;
    older files say use_sliding_window + max_window_layers (layers from max_window_layers on use
    the window). (None, None) when no layer slides."""
    hf_types = hf.get("layer_types")
    if hf_types is None and hf.get("use_sliding_window") and hf.get("sliding_window"):
        first = int_of(hf, "max_window_layers", where, n_layers, lo=0)
        hf_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    kinds = () if hf_types is None else layer_types_of(hf_types, n_layers, where)
    if "sliding" in kinds:
        return int_of(hf, "sliding_window", where), kinds
    return None, None


def _dense_config(hf: Mapping[str, Any], family: str, common: dict, where: str) -> ModelConfig:
    """Llama / Mistral / Qwen2 / Qwen3: a SwiGLU MLP in every layer. Llama's optional q/k/v/o bias
    is one switch (attention_bias); Mistral is Llama without biases, its `sliding_window` (when
    not null: v0.1) on every layer; Qwen2 has q/k/v biases and none on the output; Qwen3 has q/k
    norms."""
    require(hf, "hidden_act", ("silu",), where)
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
            window, layer_types = int_of(hf, "sliding_window", where), ("sliding",) * n_layers
    extra: dict = {}
    if family == "qwen2":
        extra = dict(attention_bias=True, attention_out_bias=False)
    elif family == "qwen3":
        extra = dict(qk_norm=True)
    return ModelConfig(
        **{**common, **extra}, **rope_of(hf, where, 10000.0), n_experts=0,
        d_ff=int_of(hf, "intermediate_size", where), sliding_window=window, layer_types=layer_types,
    )


def check_exportable(cfg: ModelConfig) -> None:
    """Raises if `cfg` uses a variant the HF class of its family cannot express."""
    dense = dict(n_experts=0, attn_sinks=False, router_bias=False, expert_bias=False)
    # what every family's HF class requires unless its own entry below says otherwise: none of
    # Gemma's, Granite's, OLMo's or Phi-3's variants of the block
    plain = dict(norm_offset=0.0, sandwich_norms=False, mlp_act="silu", embed_scale=1.0, query_scale=None,
                 rope_local_theta=None, residual_scale=1.0, logits_divisor=1.0, pre_norms=True,
                 qk_norm_over_heads=False, norm_scale_fp32=False, rope_partial_factor=1.0, mla_kv_rank=0,
                 router_groups=1, router_topk_groups=1)
    # DeepSeek's latent attention (no biases, norms or sinks) and ungated shared expert
    latent = dict(attn_sinks=False, router_bias=False, expert_bias=False, expert_act="swiglu", shared_expert_gate=False,
                  qk_norm=False, attention_bias=False, out_bias=False)
    # OLMo 2/3's post-norm block and whole-projection q/k norms, the rest as Llama
    olmo = dict(dense, qk_norm=True, qk_norm_over_heads=True, pre_norms=False, sandwich_norms=True,
                norm_scale_fp32=True, out_bias=cfg.attention_bias)
    family = {
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
                            mlp_act="gelu_tanh", embed_scale=cfg.d_model ** 0.5),
        "phi3": dict(dense, qk_norm=False, attention_bias=False, out_bias=False),
        "granite": dict(dense, qk_norm=False, out_bias=cfg.attention_bias),
        "olmo2": olmo,
        "olmo3": olmo,
        "smollm3": dict(dense, qk_norm=False, out_bias=cfg.attention_bias),
        "seed_oss": dict(dense, qk_norm=False),
        "glm4_moe": dict(router="sigmoid_topk", attn_sinks=False, router_bias=False, expert_bias=False,
                         expert_act="swiglu", out_bias=False, shared_expert_gate=False),
        "deepseek_v3": dict(latent, router="sigmoid_topk"),
        "deepseek_v2": dict(latent, router="softmax_topk", norm_topk_prob=False),
        "glm4_moe_lite": dict(latent, router="sigmoid_topk"),
        "minimax_m2": dict(router="sigmoid_topk", qk_norm=True, qk_norm_over_heads=True, attn_sinks=False,
                           router_bias=False, expert_bias=False, expert_act="swiglu", attention_bias=False,
                           out_bias=False, d_ff_shared=0, norm_topk_prob=True, router_scale=1.0),
        "olmoe": dict(router="softmax_topk", qk_norm=True, qk_norm_over_heads=True, attn_sinks=False,
                      router_bias=False, expert_bias=False, expert_act="swiglu", d_ff_shared=0,
                      out_bias=cfg.attention_bias),
    }[cfg.family]
    # the fields a family's HF class reads from its config.json, whatever their value
    free = {"granite": ("embed_scale", "query_scale", "residual_scale", "logits_divisor"),
            "gemma3_text": ("query_scale", "rope_local_theta", "norm_scale_fp32"),   # its offset: fp32 anyway
            "olmo3": ("rope_local_theta",), "phi3": ("rope_partial_factor",),
            "glm4_moe": ("rope_partial_factor", "router_groups", "router_topk_groups"),
            "minimax_m2": ("rope_partial_factor",),
            **{f: ("query_scale", "mla_kv_rank", "router_groups", "router_topk_groups")
               for f in LATENT_ATTENTION_FAMILIES}}.get(cfg.family, ())
    want = {k: v for k, v in {**plain, **family}.items() if k not in free}
    if cfg.family == "granite" and cfg.query_scale is None:
        raise HFConfigError("ModelConfig(family='granite') needs query_scale (attention_multiplier)")
    if cfg.family == "olmoe" and cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise HFConfigError(f"ModelConfig(family='olmoe') has head_dim={cfg.head_dim} x n_heads={cfg.n_heads} "
                            f"!= d_model={cfg.d_model}; HF OlmoeForCausalLM's q_norm spans hidden_size")
    if cfg.family == "gemma3_text" and (cfg.query_scale is None or (
            cfg.rope_local_theta is None and "sliding" in (cfg.layer_types or ()))):
        raise HFConfigError("ModelConfig(family='gemma3_text') needs query_scale (query_pre_attn_scalar ** -0.5) "
                            "and, with sliding layers, rope_local_theta (rope_local_base_freq)")
    if (cfg.family == "olmo3" and "sliding" in (cfg.layer_types or ()) and cfg.rope_type != "default"
            and cfg.rope_local_theta is None):
        raise HFConfigError("ModelConfig(family='olmo3') with sliding layers and rope_type="
                            f"{cfg.rope_type!r} needs rope_local_theta: HF's sliding layers rotate unscaled")
    if cfg.nope_layers and cfg.family != "smollm3":
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has nope_layers={cfg.nope_layers}; HF "
                            f"{ARCHITECTURES[cfg.family]} applies RoPE in every layer (only smollm3 has NoPE layers)")
    if cfg.family in LATENT_ATTENTION_FAMILIES and not cfg.mla_kv_rank:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has mla_kv_rank=0; HF {ARCHITECTURES[cfg.family]}'s "
                            "attention is latent (set the mla_* fields)")
    if cfg.family in LATENT_ATTENTION_FAMILIES and cfg.query_scale is not None and (cfg.rope_type != "yarn"
                                                                            or cfg.rope_factor <= 1):
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has query_scale={cfg.query_scale}; HF "
                            f"{ARCHITECTURES[cfg.family]} scales scores only by YaRN's mscale_all_dim "
                            "(rope_type='yarn', rope_factor > 1)")
    first_k = cfg.family in ("glm4_moe", "deepseek_v2", "deepseek_v3")   # glm4_moe_lite names them per layer
    if first_k and cfg.dense_layers != tuple(range(len(cfg.dense_layers))):
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}): HF {ARCHITECTURES[cfg.family]}'s dense layers are "
                            f"the first k (dense_layers={cfg.dense_layers})")
    if cfg.family in ("glm4_moe", *LATENT_ATTENTION_FAMILIES) and cfg.d_ff_shared % cfg.d_ff_expert:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}): HF {ARCHITECTURES[cfg.family]}'s shared expert is "
                            f"a multiple of d_ff_expert wide (d_ff_shared={cfg.d_ff_shared}, "
                            f"d_ff_expert={cfg.d_ff_expert})")
    if cfg.dense_layers and cfg.family not in ("qwen3_moe", "qwen2_moe", "glm4_moe", *LATENT_ATTENTION_FAMILIES):
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
    if cfg.family in ("llama", "granite", "olmo2") and "sliding" in types:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has sliding layers (layer_types={cfg.layer_types}); "
                            f"HF {ARCHITECTURES[cfg.family]} has no sliding window")
    if cfg.family == "qwen2_moe" and not cfg.d_ff_shared:
        raise HFConfigError("ModelConfig(family='qwen2_moe') has d_ff_shared=0; HF Qwen2MoeForCausalLM has a "
                            "shared expert in every MoE layer")
    if cfg.family in ("qwen3_moe", "mixtral", "mistral", "phi3") and types and types != {"sliding"}:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}): HF applies sliding_window to every layer; "
                            f"layer_types={cfg.layer_types} mixes kinds")


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF `config.json` dict for `cfg` (transformers 5 field names).

    Args:
      cfg: the model config; its `family` picks the HF architecture.
    Returns:
      The dict to write as `config.json`.
    Raises:
      HFConfigError: when `cfg` uses a variant the HF class of its family cannot express (`check_exportable`).
    """
    check_exportable(cfg)
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "num_experts_per_tok": cfg.top_k, "rms_norm_eps": cfg.rms_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope_to_hf(cfg), "router_aux_loss_coef": cfg.router_aux_coef,
        "hidden_act": "silu", "dtype": cfg.param_dtype,
    }
    window = cfg.sliding_window if "sliding" in (cfg.layer_types or ()) else None
    layer_types = [TO_HF_LAYER_TYPES[t] for t in cfg.layer_types or ("full",) * cfg.n_layers]
    # Gemma 3's and OLMo 3's RoPE per layer kind: the sliding layers' unscaled
    local_rope = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    per_kind_rope = {"full_attention": rope_to_hf(cfg), "sliding_attention": local_rope}
    partial_rope = {**rope_to_hf(cfg), "partial_rotary_factor": cfg.rope_partial_factor}   # Phi-3's, GLM's
    if cfg.family == "gemma3_text":
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"], hf["hidden_act"]
        scalar = cfg.query_scale ** -2
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, hidden_activation="gelu_pytorch_tanh",
                  query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar,
                  sliding_window=window, layer_types=layer_types,
                  final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False,
                  rope_parameters=per_kind_rope)
    elif cfg.family == "granite":
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, mlp_bias=False,
                  embedding_multiplier=cfg.embed_scale, attention_multiplier=cfg.query_scale,
                  residual_multiplier=cfg.residual_scale, logits_scaling=cfg.logits_divisor)
    elif cfg.family == "seed_oss":   # dropout 0: the function; HF applies it in training mode only
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, attention_out_bias=cfg.out_bias,
                  mlp_bias=False, attention_dropout=0.0, residual_dropout=0.0)
    elif cfg.family == "smollm3":
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, mlp_bias=False,
                  no_rope_layers=[int(r) for r in cfg.layer_ropes], use_sliding_window=window is not None,
                  sliding_window=window, layer_types=layer_types,
                  pad_token_id=None)   # SmolLM3Config's default (128004) is an embedding row HF checks
    elif cfg.family in ("olmo2", "olmo3"):
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias)
        if cfg.family == "olmo3":
            hf.update(sliding_window=window, layer_types=layer_types, rope_parameters=per_kind_rope)
    elif cfg.family == "phi3":
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        # pad_token_id: Phi3Config's default (32000) is an embedding row HF checks against the vocabulary
        hf.update(intermediate_size=cfg.d_ff, sliding_window=window, rope_parameters=partial_rope,
                  original_max_position_embeddings=cfg.rope_original_max_len, pad_token_id=None)
    elif cfg.family in DENSE_FAMILIES:
        del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
        hf.update(intermediate_size=cfg.d_ff, attention_bias=cfg.attention_bias, mlp_bias=False)
        if cfg.family == "mistral":
            del hf["attention_bias"], hf["mlp_bias"]   # not MistralConfig fields: it has neither
            hf["sliding_window"] = window
        elif cfg.family != "llama":
            hf.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=cfg.n_layers,
                      layer_types=layer_types)
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
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.d_ff_expert,
                  shared_expert_intermediate_size=cfg.d_ff_shared, norm_topk_prob=cfg.norm_topk_prob,
                  qkv_bias=cfg.attention_bias, decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers),
                  use_sliding_window=window is not None, sliding_window=window, max_window_layers=cfg.n_layers,
                  layer_types=layer_types,
                  intermediate_size=cfg.d_ff if cfg.dense_layers else cfg.d_ff_shared)
    elif cfg.family in ("glm4_moe", *LATENT_ATTENTION_FAMILIES):
        del hf["router_aux_loss_coef"]
        hf.update(n_routed_experts=cfg.n_experts, moe_intermediate_size=cfg.d_ff_expert,
                  n_shared_experts=cfg.d_ff_shared // cfg.d_ff_expert, routed_scaling_factor=cfg.router_scale,
                  n_group=cfg.router_groups, topk_group=cfg.router_topk_groups, norm_topk_prob=cfg.norm_topk_prob,
                  first_k_dense_replace=len(cfg.dense_layers), num_nextn_predict_layers=0,
                  intermediate_size=cfg.d_ff if cfg.dense_layers else cfg.d_ff_expert)   # unused without them
        if cfg.family == "glm4_moe":
            hf.update(rope_parameters=partial_rope, attention_bias=cfg.attention_bias, use_qk_norm=cfg.qk_norm)
        else:
            hf.update(_latent_attention_to_hf(cfg))
        if cfg.family == "glm4_moe_lite":   # its dense layers by name, wherever they are
            del hf["first_k_dense_replace"]
            hf["mlp_layer_types"] = ["dense" if cfg.layer_is_dense(i) else "sparse" for i in range(cfg.n_layers)]
        if cfg.family == "deepseek_v2":   # softmax routing, never renormalised, groups limited or not
            for k in ("norm_topk_prob", "num_nextn_predict_layers", "rope_interleave"):
                del hf[k]
            hf.update(topk_method="group_limited_greedy" if cfg.router_groups > 1 else "greedy")
    elif cfg.family == "olmoe":
        hf.update(num_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert, norm_topk_prob=cfg.norm_topk_prob,
                  attention_bias=cfg.attention_bias, clip_qkv=None)
    elif cfg.family == "mixtral":
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert, sliding_window=window)
    elif cfg.family == "minimax_m2":
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert, rope_parameters=partial_rope,
                  scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True)
    else:
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert,
                  attention_bias=True, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                  sliding_window=cfg.sliding_window,
                  layer_types=layer_types)
    return hf


def _latent_attention_to_hf(cfg: ModelConfig) -> dict:
    """The latent-attention fields of DeepseekV2Config / V3Config / Glm4MoeLiteConfig. The scores'
    extra scale (our query_scale) is written as YaRN's mscale_all_dim, rounded to 12 digits so that
    reading it back computes the same float; the weights go in the interleaved RoPE layout
    (tensor_map)."""
    qk = cfg.mla_nope_dim + cfg.mla_rope_dim
    rope = rope_to_hf(cfg)
    if cfg.query_scale is not None:
        m = math.sqrt(cfg.query_scale * math.sqrt(qk))
        rope["mscale_all_dim"] = round((m - 1.0) / (0.1 * math.log(cfg.rope_factor)), 12)
    # HF expands every head's key and value and repeats them by heads // num_key_value_heads
    return dict(rope_parameters=rope, num_key_value_heads=cfg.n_heads, head_dim=cfg.mla_rope_dim,
                q_lora_rank=cfg.mla_q_rank or None, kv_lora_rank=cfg.mla_kv_rank, qk_nope_head_dim=cfg.mla_nope_dim,
                qk_rope_head_dim=cfg.mla_rope_dim, v_head_dim=cfg.mla_v_dim, rope_interleave=True,
                attention_bias=False)
