"""Qwen2 / Qwen2.5 and Qwen3 (Llama's dense block: Qwen2 with q/k/v biases and none on the output,
Qwen3 with q/k norms), Qwen3-MoE, and Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B). One module: they
share the windows of Qwen2's config (`layer_types`, or `use_sliding_window` + `max_window_layers`)
and the MoE models' dense layers (`mlp_only_layers`, `decoder_sparse_step`).

Tool calls: Qwen2.5's and Qwen3's templates write Hermes-style <tool_call> JSON ('qwen3')."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._shared import DENSE, check_llama_mlp, layer_types_to_hf, window_to_hf
from sfrrl_jax.checkpoints.hf.families.llama import llama_block, llama_block_to_hf
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec, TensorNames
from sfrrl_jax.checkpoints.hf.hf_fields import HFConfigError, bool_of, int_of, layer_types_of, require, rope_of
from sfrrl_jax.config import ModelConfig


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


def _read_qwen2(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    check_llama_mlp(hf, where)
    window, layer_types = _qwen2_windows(hf, common["n_layers"], where)
    return llama_block(hf, common, where, window, layer_types, attention_bias=True, attention_out_bias=False)


def _read_qwen3(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    check_llama_mlp(hf, where)
    window, layer_types = _qwen2_windows(hf, common["n_layers"], where)
    return llama_block(hf, common, where, window, layer_types, qk_norm=True)


def _write_qwen3(cfg: ModelConfig, hf: dict) -> None:
    llama_block_to_hf(cfg, hf)
    window = window_to_hf(cfg)
    hf.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=cfg.n_layers,
              layer_types=layer_types_to_hf(cfg))


def _write_qwen2(cfg: ModelConfig, hf: dict) -> None:
    _write_qwen3(cfg, hf)
    del hf["attention_bias"]   # Qwen2's q/k/v biases are not optional


def _read_qwen3_moe(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
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


def _write_qwen3_moe(cfg: ModelConfig, hf: dict) -> None:
    window = window_to_hf(cfg)
    hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.d_ff_expert,
              norm_topk_prob=cfg.norm_topk_prob, attention_bias=cfg.attention_bias,
              decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers),
              use_sliding_window=window is not None, sliding_window=window)
    if cfg.dense_layers:  # the dense layers' MLP width (transformers' default would be 6144)
        hf["intermediate_size"] = cfg.d_ff


def _read_qwen2_moe(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
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


def _write_qwen2_moe(cfg: ModelConfig, hf: dict) -> None:
    window = window_to_hf(cfg)
    hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.d_ff_expert,
              shared_expert_intermediate_size=cfg.d_ff_shared, norm_topk_prob=cfg.norm_topk_prob,
              qkv_bias=cfg.attention_bias, decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers),
              use_sliding_window=window is not None, sliding_window=window, max_window_layers=cfg.n_layers,
              layer_types=layer_types_to_hf(cfg),
              intermediate_size=cfg.d_ff if cfg.dense_layers else cfg.d_ff_shared)


QWEN2 = FamilySpec(
    model_type="qwen2", architecture="Qwen2ForCausalLM", read_config=_read_qwen2, write_config=_write_qwen2,
    fixed=lambda cfg: dict(DENSE, qk_norm=False, attention_bias=True, out_bias=False), moe=False,
    tool_format="qwen3")

QWEN3 = FamilySpec(
    model_type="qwen3", architecture="Qwen3ForCausalLM", read_config=_read_qwen3, write_config=_write_qwen3,
    fixed=lambda cfg: dict(DENSE, qk_norm=True, out_bias=cfg.attention_bias), moe=False, tool_format="qwen3")

QWEN3_MOE = FamilySpec(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", read_config=_read_qwen3_moe,
    write_config=_write_qwen3_moe,
    fixed=lambda cfg: dict(router="softmax_topk", qk_norm=True, attn_sinks=False, router_bias=False,
                           expert_bias=False, expert_act="swiglu", d_ff_shared=0),
    moe=True, dense_layers="any", sliding="all", tool_format="qwen3")

QWEN2_MOE = FamilySpec(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM", read_config=_read_qwen2_moe,
    write_config=_write_qwen2_moe,
    fixed=lambda cfg: dict(router="softmax_topk", qk_norm=False, attn_sinks=False, router_bias=False,
                           expert_bias=False, expert_act="swiglu", out_bias=False, shared_expert_gate=True),
    moe=True, dense_layers="any", shared_expert="gated", tensor_names=TensorNames(shared_expert="shared_expert."),
    tool_format="qwen3")
