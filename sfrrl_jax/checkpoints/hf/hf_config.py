"""HF `config.json` <-> `ModelConfig`, for the families we support.

Field names follow transformers 5 (`rope_parameters`); the 4.x spelling (`rope_theta` at the top
level plus `rope_scaling`) is accepted on read, which is what most published checkpoints carry.
Anything our model cannot represent (an unknown RoPE type, a non-SiLU activation, ...) is refused
with the offending key named, rather than loaded wrongly. The typed field readers are in
`hf_fields`; what differs between families is their spec's (`families/`, one module per family,
gathered in `families.FAMILIES`): this module reads and writes what they share and asks the spec
for the rest.
"""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families import FAMILIES, spec_for_model_type, spec_of, supported_model_types, wrapped_by
from sfrrl_jax.checkpoints.hf.hf_fields import (DTYPES, HFConfigError, bool_of, float_of, int_of, read_hf_config,
                                                rope_to_hf)
from sfrrl_jax.config import ModelConfig

__all__ = ["ARCHITECTURES", "DENSE_FAMILIES", "DTYPES", "SUPPORTED_FAMILIES", "HFConfigError", "check_exportable",
           "config_from_hf", "config_to_hf", "read_hf_config"]

# The registry's, as lists (names other code reads); a family is added in `families/`, not here.
SUPPORTED_FAMILIES = tuple(FAMILIES)
MODEL_TYPE_ALIASES = {alias: name for name, spec in FAMILIES.items() for alias in spec.aliases}
LATENT_ATTENTION_FAMILIES = tuple(name for name, spec in FAMILIES.items() if spec.attention == "latent")
DENSE_FAMILIES = tuple(name for name, spec in FAMILIES.items() if not spec.moe)
ARCHITECTURES = {name: spec.architecture for name, spec in FAMILIES.items()}


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
    model_type = hf.get("model_type")
    wrapped = wrapped_by(model_type)
    if wrapped is not None:   # a multimodal model's config: its language model's
        wrapper = wrapped.wrapper
        return config_from_hf(wrapper.unwrap(hf, where), dtype, f"{where} {wrapper.part}")
    spec = spec_for_model_type(model_type)
    if spec is None:
        raise HFConfigError(f"{where}: model_type {model_type!r} is not supported; supported model_types: "
                            f"{supported_model_types()}")
    if model_type != spec.model_type:   # another name for an architecture we read
        return config_from_hf({**hf, "model_type": spec.model_type,
                               "_name_or_path": hf.get("_name_or_path") or model_type}, dtype, where)
    family = spec.model_type
    d_model = int_of(hf, "hidden_size", where)
    n_heads = int_of(hf, "num_attention_heads", where)
    if dtype is not None:
        if dtype not in DTYPES:
            raise HFConfigError(f"dtype={dtype!r} is not supported (supported: {list(DTYPES)})")
    else:
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
        if dtype not in DTYPES:
            raise HFConfigError(f"{where}: dtype {dtype!r} is not supported (supported: {list(DTYPES)})")
    head_dim = d_model // n_heads if spec.default_head_dim is None else spec.default_head_dim
    # the fields every family reads alike; its spec reads the rest (and may override these)
    common = dict(
        name=str(hf.get("_name_or_path") or family), family=family,
        vocab_size=int_of(hf, "vocab_size", where), d_model=d_model,
        n_layers=int_of(hf, "num_hidden_layers", where), n_heads=n_heads,
        n_kv_heads=int_of(hf, "num_key_value_heads", where, n_heads),
        head_dim=int_of(hf, "head_dim", where, head_dim),
        top_k=int_of(hf, "num_experts_per_tok", where, ... if spec.moe else 1),
        rms_eps=float_of(hf, "rms_norm_eps", where),
        max_seq_len=int_of(hf, "max_position_embeddings", where),
        tie_embeddings=bool_of(hf, "tie_word_embeddings", where, spec.default_tie_embeddings),
        attention_bias=bool_of(hf, "attention_bias", where, spec.default_attention_bias),
        router_aux_coef=float_of(hf, "router_aux_loss_coef", where, 0.0),
        param_dtype=dtype, compute_dtype=dtype,
    )
    return spec.read_config(hf, common, where)


def check_exportable(cfg: ModelConfig) -> None:
    """Raises if `cfg` uses a variant the HF class of its family cannot express.

    Args:
      cfg: the model config; its `family` names the HF class (`families.FAMILIES`).
    Raises:
      HFConfigError: naming the fields the class cannot hold and what it requires.
    """
    spec = spec_of(cfg.family)
    arch = spec.architecture
    # what every family's HF class requires unless its spec says otherwise (`fixed`, `free`): none
    # of Gemma's, Granite's, OLMo's or Phi-3's variants of the block
    plain = dict(norm_offset=0.0, sandwich_norms=False, mlp_act="silu", embed_scale=1.0, query_scale=None,
                 rope_local_theta=None, residual_scale=1.0, logits_divisor=1.0, pre_norms=True,
                 qk_norm_over_heads=False, norm_scale_fp32=False, rope_partial_factor=1.0, mla_kv_rank=0,
                 router_groups=1, router_topk_groups=1)
    want = {k: v for k, v in {**plain, **spec.fixed(cfg)}.items() if k not in spec.free}
    if spec.check_export is not None:
        spec.check_export(cfg)
    if cfg.nope_layers and not spec.nope_layers:
        nope = " / ".join(name for name, s in FAMILIES.items() if s.nope_layers)
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has nope_layers={cfg.nope_layers}; HF "
                            f"{arch} applies RoPE in every layer (only {nope} has NoPE layers)")
    latent = spec.attention == "latent"
    if latent and not cfg.mla_kv_rank:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has mla_kv_rank=0; HF {arch}'s "
                            "attention is latent (set the mla_* fields)")
    if latent and cfg.query_scale is not None and (cfg.rope_type != "yarn" or cfg.rope_factor <= 1):
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has query_scale={cfg.query_scale}; HF "
                            f"{arch} scales scores only by YaRN's mscale_all_dim "
                            "(rope_type='yarn', rope_factor > 1)")
    if spec.dense_layers == "first_k" and cfg.dense_layers != tuple(range(len(cfg.dense_layers))):
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}): HF {arch}'s dense layers are "
                            f"the first k (dense_layers={cfg.dense_layers})")
    if spec.shared_expert == "ungated" and cfg.d_ff_shared % cfg.d_ff_expert:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}): HF {arch}'s shared expert is "
                            f"a multiple of d_ff_expert wide (d_ff_shared={cfg.d_ff_shared}, "
                            f"d_ff_expert={cfg.d_ff_expert})")
    if cfg.dense_layers and spec.dense_layers == "none":
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has dense_layers={cfg.dense_layers}; HF "
                            f"{arch} has no dense layers (only qwen3_moe's mlp_only_layers)")
    if spec.moe and not cfg.is_moe:
        dense = [name for name, s in FAMILIES.items() if not s.moe]
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has n_experts=0 (dense); HF "
                            f"{arch} needs experts: use a dense family {dense}")
    wrong = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
    if wrong:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has {wrong}; HF {arch} "
                            f"requires {({k: want[k] for k in wrong})}")
    types = set(cfg.layer_types or ())
    if spec.sliding == "none" and "sliding" in types:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has sliding layers (layer_types={cfg.layer_types}); "
                            f"HF {arch} has no sliding window")
    if spec.shared_expert == "gated" and not cfg.d_ff_shared:
        raise HFConfigError(f"ModelConfig(family={cfg.family!r}) has d_ff_shared=0; HF {arch} has a "
                            "shared expert in every MoE layer")
    if spec.sliding == "all" and types and types != {"sliding"}:
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
    spec = spec_of(cfg.family)
    # the fields every family writes alike; its spec edits them into what its config class reads
    hf: dict[str, Any] = {
        "architectures": [spec.architecture], "model_type": spec.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "num_experts_per_tok": cfg.top_k, "rms_norm_eps": cfg.rms_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope_to_hf(cfg), "router_aux_loss_coef": cfg.router_aux_coef,
        "hidden_act": "silu", "dtype": cfg.param_dtype,
    }
    spec.write_config(cfg, hf)
    return hf
