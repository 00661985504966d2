"""MiniMax-M2 (MiniMaxM2ForCausalLM): Mixtral's block with OLMo's q/k norms over the whole
projection (`qk_norm_type='per_layer'`), RoPE on the leading `rotary_dim` dims of each head (the
released configs' name; `partial_rotary_factor` too), and every layer's experts routed by sigmoid
scores plus a selection bias (`e_score_correction_bias`, beside the router's weight),
renormalised. The full attention of every layer (`attn_type_list` all 1) only: MiniMax-01's
lightning attention is refused, as are a shared expert and a softmax router. Multi-token-prediction
modules are not read.

Tool calls: <minimax:tool_call> invokes ('minimax_m2')."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import checked, partial_rope_to_hf
from sfrrl_jax.checkpoints.hf.families.mixtral import BLOCK_SPARSE_MOE
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, float_of, int_of, require, rope_of
from sfrrl_jax.config import ModelConfig


def _read(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
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
    return checked(where, **common, **rope, n_experts=int_of(hf, "num_local_experts", where),
                   d_ff_expert=int_of(hf, "intermediate_size", where), router="sigmoid_topk", norm_topk_prob=True,
                   qk_norm=True, qk_norm_over_heads=True,
                   rope_partial_factor=float_of({"partial_rotary_factor": partial}, "partial_rotary_factor", where,
                                                1.0))


def _write(cfg: ModelConfig, hf: dict) -> None:
    hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_ff_expert, rope_parameters=partial_rope_to_hf(cfg),
              scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True)


MINIMAX_M2 = FamilySpec(
    model_type="minimax_m2", architecture="MiniMaxM2ForCausalLM", read_config=_read, write_config=_write,
    fixed=lambda cfg: dict(router="sigmoid_topk", qk_norm=True, qk_norm_over_heads=True, attn_sinks=False,
                           router_bias=False, expert_bias=False, expert_act="swiglu", attention_bias=False,
                           out_bias=False, d_ff_shared=0, norm_topk_prob=True, router_scale=1.0),
    moe=True, free=("rope_partial_factor",), mtp_layers=True,
    tensor_names=dataclasses.replace(BLOCK_SPARSE_MOE, score_bias="e_score_correction_bias"), tool_format="minimax_m2")
