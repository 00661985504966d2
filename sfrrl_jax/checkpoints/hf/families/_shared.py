"""What several families' specs share: Llama's MLP checks, the dense families' fixed fields, the
two-kind RoPE of Gemma 3 and OLMo 3, and the config.json values several writers derive from a
ModelConfig (the window, the layer kinds, per-kind and partial RoPE)."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.hf_fields import (TO_HF_LAYER_TYPES, HFConfigError, float_of, require, rope_of,
                                                rope_to_hf)
from sfrrl_jax.config import ModelConfig

#: what every dense family's HF class fixes: no experts, sinks or router biases
DENSE = dict(n_experts=0, attn_sinks=False, router_bias=False, expert_bias=False)


def checked(where: str, **fields: Any) -> ModelConfig:
    """ModelConfig(**fields), a ValueError of its checks (groups that do not divide the experts,
    rotated dims, ...) as an HFConfigError naming the file."""
    try:
        return ModelConfig(**fields)
    except HFConfigError:   # a field's own error already names it
        raise
    except ValueError as e:
        raise HFConfigError(f"{where}: {e}") from None


def check_llama_mlp(hf: Mapping[str, Any], where: str) -> None:
    """Refuses what Llama's SwiGLU MLP cannot be: another activation, or biases."""
    require(hf, "hidden_act", ("silu",), where)
    if hf.get("mlp_bias"):
        raise HFConfigError(f"{where}: mlp_bias=True is not supported (the MLP has no biases)")


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


def drop_moe_fields(hf: dict) -> None:
    """Removes the router's fields from a dense family's config.json."""
    del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]


def window_to_hf(cfg: ModelConfig) -> int | None:
    """config.json's `sliding_window`: cfg's window when some layer slides, else None."""
    return cfg.sliding_window if "sliding" in (cfg.layer_types or ()) else None


def layer_types_to_hf(cfg: ModelConfig) -> list[str]:
    """config.json's `layer_types`: HF's kind of each layer ('full_attention' when cfg names none)."""
    return [TO_HF_LAYER_TYPES[t] for t in cfg.layer_types or ("full",) * cfg.n_layers]


def per_kind_rope_to_hf(cfg: ModelConfig) -> dict:
    """Gemma 3's and OLMo 3's `rope_parameters`, one set per layer kind: the sliding layers'
    unscaled, at their own base."""
    local_rope = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return {"full_attention": rope_to_hf(cfg), "sliding_attention": local_rope}


def partial_rope_to_hf(cfg: ModelConfig) -> dict:
    """`rope_parameters` with the rotated fraction of each head (Phi-3's, GLM's, MiniMax-M2's)."""
    return {**rope_to_hf(cfg), "partial_rotary_factor": cfg.rope_partial_factor}
