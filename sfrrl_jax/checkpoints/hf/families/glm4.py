"""GLM-4.5 / 4.5-Air / 4.6 (Glm4MoeForCausalLM) and GLM-4.7-Flash (Glm4MoeLiteForCausalLM):
DeepSeek's MoE layout routed by grouped sigmoid scores (`_deepseek_moe`); GLM-4.5 with q/k/v
biases and none on the output, optional per-head q/k norms and RoPE on the leading
`partial_rotary_factor` of each head (0.5 by default); GLM-4.7-Flash with DeepSeek-V3's latent
attention, its dense layers the ones `mlp_layer_types` names. Multi-token-prediction layers (past
num_hidden_layers) are not read.

Tool calls: <arg_key>/<arg_value> pairs ('glm45')."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._deepseek_moe import (LATENT, LATENT_FREE, deepseek_moe_to_hf,
                                                             grouped_sigmoid_moe, latent_attention_fields,
                                                             latent_attention_to_hf)
from sfrrl_jax.checkpoints.hf.families._shared import checked, partial_rope_to_hf
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, bool_of, float_of, int_of, require, rope_of
from sfrrl_jax.config import ModelConfig


def _read_glm4_moe(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    partial = float_of({"partial_rotary_factor": params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))},
                       "partial_rotary_factor", where, 0.5)
    return checked(where, **{**common, "attention_bias": bool_of(hf, "attention_bias", where, False)},
                   attention_out_bias=False, **rope_of({**hf, field: params or None}, where, 10000.0),
                   rope_partial_factor=partial, qk_norm=bool_of(hf, "use_qk_norm", where, False),
                   **grouped_sigmoid_moe(hf, common["n_layers"], where))


def _read_glm4_moe_lite(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """DeepSeek-V3's latent attention and GLM's MoE (`grouped_sigmoid_moe`), its dense layers the
    ones `mlp_layer_types` names 'dense' (by default the first; transformers reads no
    first_k_dense_replace here). RoPE over all of qk_rope_head_dim: a partial_rotary_factor below 1
    is refused."""
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
    moe = dict(grouped_sigmoid_moe({**hf, "first_k_dense_replace": 0}, n_layers, where), dense_layers=dense,
               d_ff=int_of(hf, "intermediate_size", where) if dense else 0)
    return checked(where, **{**common, **latent_attention_fields(hf, where)}, **moe)


def _write_glm4_moe(cfg: ModelConfig, hf: dict) -> None:
    deepseek_moe_to_hf(cfg, hf)
    hf.update(rope_parameters=partial_rope_to_hf(cfg), attention_bias=cfg.attention_bias, use_qk_norm=cfg.qk_norm)


def _write_glm4_moe_lite(cfg: ModelConfig, hf: dict) -> None:
    deepseek_moe_to_hf(cfg, hf)
    hf.update(latent_attention_to_hf(cfg))
    del hf["first_k_dense_replace"]   # its dense layers by name, wherever they are
    hf["mlp_layer_types"] = ["dense" if cfg.layer_is_dense(i) else "sparse" for i in range(cfg.n_layers)]


GLM4_MOE = FamilySpec(
    model_type="glm4_moe", architecture="Glm4MoeForCausalLM", read_config=_read_glm4_moe,
    write_config=_write_glm4_moe,
    fixed=lambda cfg: dict(router="sigmoid_topk", attn_sinks=False, router_bias=False, expert_bias=False,
                           expert_act="swiglu", out_bias=False, shared_expert_gate=False),
    moe=True, free=("rope_partial_factor", "router_groups", "router_topk_groups"), dense_layers="first_k",
    shared_expert="ungated", mtp_layers=True, tool_format="glm45")

GLM4_MOE_LITE = FamilySpec(
    model_type="glm4_moe_lite", architecture="Glm4MoeLiteForCausalLM", read_config=_read_glm4_moe_lite,
    write_config=_write_glm4_moe_lite, fixed=lambda cfg: dict(LATENT, router="sigmoid_topk"), moe=True,
    attention="latent", free=LATENT_FREE, dense_layers="any", shared_expert="ungated", mtp_layers=True,
    tool_format="glm45")
