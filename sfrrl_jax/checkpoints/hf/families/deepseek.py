"""DeepSeek-V2 / V2.5 / V2-Lite, Coder-V2 (DeepseekV2ForCausalLM) and DeepSeek-V3 / R1, Moonlight and
Kimi K2 (DeepseekV3ForCausalLM; Kimi K2's config names its own model_type, 'kimi_k2', read as
'deepseek_v3'): multi-head latent attention and DeepSeek's MoE (`_deepseek_moe`).

Tool calls: DeepSeek-V3's <｜tool▁calls▁begin｜> sections ('deepseek_v3'). Kimi K2 reads as
deepseek_v3 (its architecture) but writes calls of its own ('kimi_k2'): its template decides, or
`AgenticRollout.tool_format`. DeepSeek-V2's: the template decides."""
from __future__ import annotations

from typing import Any, Mapping

from sfrrl_jax.checkpoints.hf.families._deepseek_moe import (LATENT, LATENT_FREE, deepseek_moe, deepseek_moe_to_hf,
                                                             grouped_sigmoid_moe, latent_attention_fields,
                                                             latent_attention_to_hf)
from sfrrl_jax.checkpoints.hf.families._shared import checked
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec
from sfrrl_jax.checkpoints.hf.hf_fields import float_of, int_of, require
from sfrrl_jax.config import ModelConfig


def _read_v3(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """Latent attention (`rope_interleave` is the checkpoint's layout, the loader's concern) and the
    MoE of `grouped_sigmoid_moe`. Multi-token-prediction layers (past num_hidden_layers) are not
    read."""
    require(hf, "scoring_func", ("sigmoid",), where)
    require(hf, "topk_method", ("noaux_tc",), where)
    return checked(where, **{**common, **latent_attention_fields(hf, where)},
                   **grouped_sigmoid_moe(hf, common["n_layers"], where))


def _read_v2(hf: Mapping[str, Any], common: dict, where: str) -> ModelConfig:
    """Latent attention with RoPE on adjacent pairs, the first `first_k_dense_replace` layers dense,
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
    return checked(where, **{**common, **latent_attention_fields(hf, where)}, router="softmax_topk",
                   router_fp32=True, norm_topk_prob=False, **groups,
                   router_scale=float_of(hf, "routed_scaling_factor", where, 1.0),
                   **deepseek_moe(hf, common["n_layers"], where, 0, 2))


def _write_v3(cfg: ModelConfig, hf: dict) -> None:
    deepseek_moe_to_hf(cfg, hf)
    hf.update(latent_attention_to_hf(cfg))


def _write_v2(cfg: ModelConfig, hf: dict) -> None:
    _write_v3(cfg, hf)
    # softmax routing, never renormalised, groups limited or not
    for k in ("norm_topk_prob", "num_nextn_predict_layers", "rope_interleave"):
        del hf[k]
    hf.update(topk_method="group_limited_greedy" if cfg.router_groups > 1 else "greedy")


DEEPSEEK_V2 = FamilySpec(
    model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM", read_config=_read_v2, write_config=_write_v2,
    fixed=lambda cfg: dict(LATENT, router="softmax_topk", norm_topk_prob=False), moe=True, attention="latent",
    free=LATENT_FREE, dense_layers="first_k", shared_expert="ungated", rope_always_interleaved=True)

DEEPSEEK_V3 = FamilySpec(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", read_config=_read_v3, write_config=_write_v3,
    fixed=lambda cfg: dict(LATENT, router="sigmoid_topk"), moe=True, attention="latent", aliases=("kimi_k2",),
    free=LATENT_FREE, dense_layers="first_k", shared_expert="ungated", mtp_layers=True, tool_format="deepseek_v3")
