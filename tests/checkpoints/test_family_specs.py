"""One spec per model family (`checkpoints/hf/families/`): the registry is the one list of families,
the names other code reads are derived from it unchanged, no family string branches remain in the
generic checkpoint code, and a spec registered in one line makes the whole path (config.json both
ways, tensor names, the launcher's tool format) know a new model_type."""
import dataclasses
import re
from pathlib import Path
from typing import Literal

import pytest

import sfrrl_jax.config
from sfrrl_jax.checkpoints.hf import HFConfigError, config_from_hf, config_to_hf
from sfrrl_jax.checkpoints.hf import hf_config
from sfrrl_jax.checkpoints.hf.families import FAMILIES, default_tool_format, spec_of, supported_model_types
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec, TensorNames
from sfrrl_jax.checkpoints.hf.hf_fields import int_of, rope_of
from sfrrl_jax.checkpoints.hf.tensor_map import global_groups, layer_groups
from sfrrl_jax.config import Family, ModelConfig
from sfrrl_jax.launch import agentic

HF_DIR = Path(sfrrl_jax.checkpoints.hf.__file__).parent

# The lists as they were written out before the specs (hf_config.py, launch/agentic.py, loader.py,
# tensor_map.py), kept here as the expected values of what is now derived.
OLD_SUPPORTED = ("qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "llama", "mistral", "qwen2", "qwen3",
                 "gemma3_text", "phi3", "granite", "olmo2", "olmo3", "smollm3", "olmoe", "glm4_moe",
                 "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minimax_m2", "seed_oss")
OLD_ALIASES = {"kimi_k2": "deepseek_v3"}
OLD_LATENT = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
OLD_DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "granite", "olmo2", "olmo3",
             "smollm3", "seed_oss")
OLD_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
    "mixtral": "MixtralForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM", "seed_oss": "SeedOssForCausalLM"}
OLD_FAMILY_FORMATS = {
    "qwen2": "qwen3", "qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen2_moe": "qwen3", "gpt_oss": "harmony",
    "granite": "granite", "olmo3": "olmo3", "glm4_moe": "glm45", "deepseek_v3": "deepseek_v3",
    "glm4_moe_lite": "glm45", "smollm3": "qwen3", "minimax_m2": "minimax_m2", "seed_oss": "seed_oss"}
OLD_MTP = {"glm4_moe", "deepseek_v3", "glm4_moe_lite", "minimax_m2"}   # loader.py's skip list
OLD_PER_EXPERT = {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3",
                  "glm4_moe_lite", "minimax_m2"}   # tensor_map.py's families of one linear per expert


def test_the_registry_is_the_list_of_supported_families():
    assert tuple(FAMILIES) == OLD_SUPPORTED == hf_config.SUPPORTED_FAMILIES
    assert all(name == spec.model_type for name, spec in FAMILIES.items())
    assert supported_model_types() == list(OLD_SUPPORTED) + list(OLD_ALIASES)


def test_the_family_literal_names_the_registry():
    # ModelConfig checks `family` against the Literal (the config room sits below the registry)
    assert Family.__args__ == tuple(FAMILIES)


def test_architectures_are_unique_and_unchanged():
    architectures = [spec.architecture for spec in FAMILIES.values()]
    assert len(set(architectures)) == len(architectures)
    assert hf_config.ARCHITECTURES == OLD_ARCHITECTURES


def test_derived_lists_are_what_they_were():
    assert hf_config.DENSE_FAMILIES == OLD_DENSE
    assert hf_config.LATENT_ATTENTION_FAMILIES == OLD_LATENT
    assert hf_config.MODEL_TYPE_ALIASES == OLD_ALIASES
    assert {name for name, spec in FAMILIES.items() if spec.mtp_layers} == OLD_MTP
    assert {name for name, spec in FAMILIES.items() if spec.moe and not spec.tensor_names.fused_experts} == \
        OLD_PER_EXPERT
    assert [name for name, spec in FAMILIES.items() if spec.tensor_names.fused_experts] == ["gpt_oss"]
    assert [name for name, spec in FAMILIES.items() if spec.tensor_names.fused_projections] == ["phi3"]
    assert [name for name, spec in FAMILIES.items() if spec.wrapper] == ["gemma3_text"]
    assert FAMILIES["gemma3_text"].wrapper.model_type == "gemma3"


def test_launch_default_tool_format_per_family_is_unchanged():
    assert agentic.FAMILY_FORMATS == OLD_FAMILY_FORMATS
    for family in FAMILIES:
        assert default_tool_format(family) == OLD_FAMILY_FORMATS.get(family), family


def test_every_spec_names_real_model_config_fields():
    fields = {f.name for f in dataclasses.fields(ModelConfig)} | {"out_bias"}   # out_bias: a property
    cfg = ModelConfig()
    for name, spec in FAMILIES.items():
        assert set(spec.fixed(cfg)) <= fields, name
        assert set(spec.free) <= fields, name


def test_a_spec_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match=r"FamilySpec\('x'\).sliding='some'; valid: \['any', 'none', 'all'\]"):
        dataclasses.replace(FAMILIES["llama"], model_type="x", sliding="some")


# `family ==` / `family in` / `family !=`, or a model_type compared with a string
_BRANCH = re.compile(r"family\s*(==|!=|\bin\b|\bnot in\b)|model_type\"?\)?\s*(==|!=)\s*[\"']")


def test_no_family_string_branches_outside_the_specs():
    found = [f"{path.relative_to(HF_DIR)}:{i}: {line.strip()}"
             for path in sorted(HF_DIR.rglob("*.py")) if "families" not in path.relative_to(HF_DIR).parts
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if _BRANCH.search(line.split("#")[0])]
    assert found == []


# A toy family, as a new module would define it: Llama's block whose RoPE base is `toy_theta`.
def _read_toy(hf, common, where):
    return ModelConfig(**common, **rope_of({**hf, "rope_theta": hf.get("toy_theta", 500.0)}, where, 10000.0),
                       n_experts=0, d_ff=int_of(hf, "intermediate_size", where))


def _write_toy(cfg, hf):
    del hf["num_experts_per_tok"], hf["router_aux_loss_coef"]
    hf.update(intermediate_size=cfg.d_ff, toy_theta=cfg.rope_theta)


TOY = FamilySpec(model_type="toy_llama", architecture="ToyLlamaForCausalLM", read_config=_read_toy,
                 write_config=_write_toy, moe=False, sliding="none", default_tie_embeddings=True,
                 fixed=lambda cfg: dict(n_experts=0, attn_sinks=False, router_bias=False, expert_bias=False,
                                        qk_norm=False, out_bias=cfg.attention_bias),
                 tensor_names=TensorNames(), tool_format="qwen3")
TOY_CONFIG = {"model_type": "toy_llama", "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 40, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 128, "toy_theta": 750.0}


def test_one_registered_spec_makes_a_new_model_type_readable(monkeypatch):
    with pytest.raises(HFConfigError, match="model_type 'toy_llama' is not supported"):
        config_from_hf(TOY_CONFIG)
    monkeypatch.setitem(FAMILIES, "toy_llama", TOY)   # the one registry line
    # and ModelConfig's check of the name (a test above holds the Literal equal to the registry)
    monkeypatch.setattr(sfrrl_jax.config, "Family", Literal[Family.__args__ + ("toy_llama",)])
    cfg = config_from_hf(TOY_CONFIG)
    assert (cfg.family, cfg.rope_theta, cfg.d_ff, cfg.n_experts, cfg.head_dim, cfg.top_k, cfg.tie_embeddings) == \
        ("toy_llama", 750.0, 40, 0, 8, 1, True)   # the spec's reader and defaults
    assert "toy_llama" in supported_model_types() and spec_of("toy_llama") is TOY
    hf = config_to_hf(cfg)
    assert (hf["architectures"], hf["model_type"], hf["toy_theta"]) == (["ToyLlamaForCausalLM"], "toy_llama", 750.0)
    assert "num_experts_per_tok" not in hf
    assert config_from_hf(hf) == cfg
    names = {n for g in layer_groups(cfg, 0) + global_groups(cfg) for n in g.hf}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.embed_tokens.weight"} <= names and "lm_head.weight" not in names   # tied
    assert default_tool_format("toy_llama") == "qwen3"
    with pytest.raises(HFConfigError, match="has sliding layers"):   # the shared checks ask the spec
        config_to_hf(dataclasses.replace(cfg, layer_types=("sliding", "full"), sliding_window=8))
    monkeypatch.undo()
    assert "toy_llama" not in FAMILIES and "toy_llama" not in supported_model_types()
    with pytest.raises(HFConfigError, match="model_type 'toy_llama' is not supported"):
        config_from_hf(TOY_CONFIG)
