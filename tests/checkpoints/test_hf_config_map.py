"""config.json <-> ModelConfig: the published configs (4.x spelling, as on the Hub) map onto our
presets, and our export is read back by transformers' own config classes unchanged."""
import copy

import pytest

from sfrrl_jax.checkpoints.hf import config_from_hf, config_to_hf
from sfrrl_jax.config import ModelConfig

import hf_fixtures as F

# The fields of the published config.json files that matter to the architecture.
PUBLISHED = {
    "qwen3-moe-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
        "norm_topk_prob": True, "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-06,
        "max_position_embeddings": 40960, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 48, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "router_aux_loss_coef": 0.001,
        "torch_dtype": "bfloat16"},
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "experts_per_token": 4, "intermediate_size": 2880, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rms_norm_eps": 1e-05, "max_position_embeddings": 131072, "swiglu_limit": 7.0,
        "attention_bias": True, "tie_word_embeddings": False, "router_aux_loss_coef": 0.9,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4"}},
    "mixtral-8x7b": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "intermediate_size": 14336, "rope_theta": 1e6, "rms_norm_eps": 1e-05,
        "max_position_embeddings": 32768, "sliding_window": None, "hidden_act": "silu",
        "tie_word_embeddings": False, "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16"},
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_configs_map_onto_the_presets(preset):
    cfg = config_from_hf(PUBLISHED[preset])
    assert cfg.replace(name=preset) == ModelConfig.preset(preset)


@pytest.mark.parametrize("name", sorted(F.CONFIGS))
def test_export_config_is_read_back_by_transformers_identically(name):
    family, kwargs = F.CONFIGS[name]
    hf_config = F.FAMILY_CLASSES[family][0](**kwargs)
    cfg = config_from_hf(hf_config.to_dict())
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    reread = F.FAMILY_CLASSES[family][0](**{k: v for k, v in exported.items() if k != "architectures"})
    assert config_from_hf(reread.to_dict()) == cfg


def test_dense_layers_export_as_mlp_only_layers_and_only_for_qwen3_moe():
    from sfrrl_jax.checkpoints.hf import HFConfigError
    cfg = ModelConfig.preset("tiny-moe", n_layers=4, d_ff=40, dense_layers=(0, 3))
    hf = config_to_hf(cfg)
    assert (hf["mlp_only_layers"], hf["decoder_sparse_step"], hf["intermediate_size"]) == ([0, 3], 1, 40)
    assert config_from_hf(hf).replace(name=cfg.name) == cfg
    assert "intermediate_size" not in config_to_hf(ModelConfig.preset("tiny-moe"))   # as before
    with pytest.raises(HFConfigError, match=r"dense_layers=\(0, 3\); HF MixtralForCausalLM has no dense"):
        config_to_hf(cfg.replace(family="mixtral", qk_norm=False, router="topk_softmax"))


# Mistral-7B-Instruct-v0.3's and Mistral-Nemo-Instruct-2407's config.json (the architecture's
# fields, as published), and v0.1's window.
MISTRAL_V03 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32768,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
MISTRAL_NEMO = {**MISTRAL_V03, "vocab_size": 131072, "hidden_size": 5120, "num_hidden_layers": 40,
                "head_dim": 128, "max_position_embeddings": 1024000}


def test_published_mistral_configs_read_as_dense_llama_shapes_with_the_window_on_every_layer():
    v03 = config_from_hf(MISTRAL_V03)
    assert (v03.family, v03.n_experts, v03.d_ff, v03.head_dim, v03.n_kv_heads) == ("mistral", 0, 14336, 128, 8)
    assert (v03.rope_theta, v03.sliding_window, v03.layer_types, v03.attention_bias) == (1e6, None, None, False)
    assert v03.param_dtype == "bfloat16" and not v03.tie_embeddings
    nemo = config_from_hf(MISTRAL_NEMO)
    assert (nemo.head_dim, nemo.n_heads * nemo.head_dim, nemo.d_model) == (128, 4096, 5120)
    v01 = config_from_hf({**MISTRAL_V03, "vocab_size": 32000, "rope_theta": 10000.0, "sliding_window": 4096})
    assert v01.sliding_window == 4096 and v01.layer_types == ("sliding",) * 32
    assert config_to_hf(v01)["sliding_window"] == 4096 and config_to_hf(v03)["sliding_window"] is None


def test_mistral_refuses_what_hf_mistral_cannot_hold():
    from sfrrl_jax.checkpoints.hf import HFConfigError
    with pytest.raises(HFConfigError, match="attention_bias=True is not supported for mistral"):
        config_from_hf({**MISTRAL_V03, "attention_bias": True})
    with pytest.raises(HFConfigError, match="sliding_window=0"):
        config_from_hf({**MISTRAL_V03, "sliding_window": 0})
    mixed = config_from_hf({**MISTRAL_V03, "sliding_window": 8}).replace(layer_types=("sliding", "full") * 16)
    with pytest.raises(HFConfigError, match="mixes kinds"):
        config_to_hf(mixed)


# gemma-3-1b-it's config.json as published (transformers 4.50 spelling: sliding_window_pattern,
# rope_local_base_freq, rope_theta / rope_scaling of the global layers).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}


def test_published_gemma3_config_reads_as_transformers_reads_it():
    import transformers
    cfg = config_from_hf(GEMMA3_1B)
    theirs = transformers.Gemma3TextConfig(**copy.deepcopy(GEMMA3_1B))
    assert [t + "_attention" for t in cfg.layer_types] == list(theirs.layer_types)
    assert cfg.layer_types[5] == cfg.layer_types[11] == "full" and cfg.layer_types.count("full") == 4
    assert (cfg.family, cfg.n_experts, cfg.d_ff, cfg.head_dim, cfg.n_kv_heads, cfg.sliding_window) == (
        "gemma3_text", 0, 6912, 256, 1, 512)
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_local_theta) == (1e6, "default", 10000.0)
    assert cfg.query_scale == 256 ** -0.5 and cfg.embed_scale == 1152 ** 0.5 and cfg.norm_offset == 1.0
    assert cfg.sandwich_norms and cfg.qk_norm and cfg.tie_embeddings and cfg.mlp_act == "gelu_tanh"
    assert cfg.param_dtype == "bfloat16"
    # 4B and up: the global layers' RoPE scaled linearly by 8 (a text_config of the multimodal model)
    scaled = config_from_hf({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (scaled.rope_type, scaled.rope_factor, scaled.rope_local_theta) == ("linear", 8.0, 10000.0)
    # the export, in transformers 5's spelling, reads back the same, ours and theirs
    exported = config_to_hf(scaled)
    assert config_from_hf(exported) == scaled
    back = transformers.Gemma3TextConfig(**copy.deepcopy(exported))
    assert back.rope_parameters["full_attention"]["factor"] == 8.0 and back.query_pre_attn_scalar == 256
    assert list(back.layer_types) == list(theirs.layer_types)


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "gemma3"}, "model_type 'gemma3' without a text_config object"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern=0 must be >= 1"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding layers' rope type 'linear'"),
])
def test_gemma3_refuses_what_the_model_does_not_implement(changes, message):
    from sfrrl_jax.checkpoints.hf import HFConfigError
    with pytest.raises(HFConfigError, match=message):
        config_from_hf({**GEMMA3_1B, **changes})
    with pytest.raises(HFConfigError, match="Gemma3ForCausalLM requires"):
        config_to_hf(config_from_hf(GEMMA3_1B).replace(sandwich_norms=False))
    with pytest.raises(HFConfigError, match="LlamaForCausalLM requires"):
        config_to_hf(config_from_hf(GEMMA3_1B).replace(family="llama", qk_norm=False))


# Phi-4-mini-instruct's config.json as published (4.x spelling: rope_scaling with 48 factors each
# for the 96 rotated dims of 128, partial_rotary_factor and original length at the top level).
PHI4_MINI = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "bos_token_id": 199999, "eos_token_id": 199999,
    "full_attn_mod": 1, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
    "interpolate_factor": 1, "lm_head_bias": False, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "phi3", "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "original_max_position_embeddings": 4096, "pad_token_id": 199999, "partial_rotary_factor": 0.75,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "vocab_size": 200064,
    "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 10 for i in range(48)],
                     "short_factor": [1.0 + i / 100 for i in range(48)]}}


def test_published_phi4_mini_config_reads_as_transformers_reads_it():
    import math

    import transformers
    cfg = config_from_hf(PHI4_MINI)
    assert (cfg.family, cfg.head_dim, cfg.n_kv_heads, cfg.d_ff, cfg.tie_embeddings) == ("phi3", 128, 8, 8192, True)
    assert (cfg.rope_type, cfg.rope_partial_factor, cfg.rope_original_max_len) == ("longrope", 0.75, 4096)
    assert len(cfg.rope_long_factor) == len(cfg.rope_short_factor) == 48
    assert config_from_hf({**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "type": "su"}}) == cfg
    assert cfg.sliding_window is None and cfg.layer_types is None   # 262144 over 131072 positions
    # HF's default attention factor: from the context's growth, 131072 / 4096
    assert cfg.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-12)
    theirs = transformers.Phi3Config(**copy.deepcopy(PHI4_MINI))   # it writes into the nested dicts
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    _, attention = ROPE_INIT_FUNCTIONS["longrope"](theirs, "cpu")
    assert attention == pytest.approx(cfg.rope_attention_factor, rel=1e-12)
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    back = transformers.Phi3Config(**copy.deepcopy(exported))
    assert back.rope_parameters["partial_rotary_factor"] == 0.75 and len(back.rope_parameters["long_factor"]) == 48


@pytest.mark.parametrize("changes,message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"partial_rotary_factor": 0.7}, "rotates 89 of head_dim=128 dims"),
    ({"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 47, "short_factor": [1.0] * 48}},
     "rope_long_factor has 47 factors; longrope needs one per rotated pair of dims: 48"),
    ({"rope_scaling": {"type": "longrope", "long_factor": "fast", "short_factor": [1.0] * 48}},
     "long_factor must be a list of numbers"),
    ({"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48, "mscale": 2}},
     r"longrope parameter\(s\) \['mscale'\] are not supported"),
    ({"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48}}, "lacks required key 'short_factor'"),
])
def test_phi3_refuses_what_the_model_does_not_implement(changes, message):
    from sfrrl_jax.checkpoints.hf import HFConfigError
    with pytest.raises(HFConfigError, match=message):
        config_from_hf({**PHI4_MINI, **changes})


# granite-3.3-2b-instruct's config.json (the architecture's fields, as published).
GRANITE_33_2B = {
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_multiplier": 0.015625,
    "embedding_multiplier": 12.0, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
    "logits_scaling": 8.0, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "granite",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "vocab_size": 49159}


def test_published_granite_config_maps_its_multipliers():
    import transformers
    cfg = config_from_hf(GRANITE_33_2B)
    assert (cfg.family, cfg.head_dim, cfg.n_kv_heads, cfg.d_ff, cfg.rope_theta) == ("granite", 64, 8, 8192, 1e7)
    assert (cfg.embed_scale, cfg.query_scale, cfg.residual_scale, cfg.logits_divisor) == (12.0, 0.015625, 0.22, 8.0)
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    back = transformers.GraniteConfig(**copy.deepcopy(exported))
    assert (back.embedding_multiplier, back.attention_multiplier, back.residual_multiplier, back.logits_scaling) == (
        12.0, 0.015625, 0.22, 8.0)
    from sfrrl_jax.checkpoints.hf import HFConfigError
    with pytest.raises(HFConfigError, match="mlp_bias=True"):
        config_from_hf({**GRANITE_33_2B, "mlp_bias": True})
    with pytest.raises(HFConfigError, match="LlamaForCausalLM requires"):
        config_to_hf(cfg.replace(family="llama"))   # Llama has no multipliers


# gemma-3-4b-it's config.json as published: a multimodal model whose text_config names only what
# differs from Gemma3TextConfig's defaults (the vision_config left out here).
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16"}


def test_published_multimodal_gemma3_config_reads_as_its_language_model():
    import transformers
    cfg = config_from_hf(GEMMA3_4B)
    theirs = transformers.Gemma3Config(**copy.deepcopy(GEMMA3_4B)).text_config
    assert (cfg.family, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        "gemma3_text", theirs.vocab_size, 2560, 34, theirs.num_attention_heads, theirs.num_key_value_heads, 256)
    assert [t + "_attention" for t in cfg.layer_types] == list(theirs.layer_types)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_theta, cfg.rope_local_theta) == ("linear", 8.0, 1e6, 10000.0)
    assert (cfg.sliding_window, cfg.param_dtype, cfg.tie_embeddings, cfg.query_scale) == (1024, "bfloat16", True,
                                                                                          256 ** -0.5)


# OLMo-2-1124-7B-Instruct's config.json (the architecture's fields, as published).
OLMO2_7B = {
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "eos_token_id": 100257, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "olmo2",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 100277,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 100352}

# Olmo-3-7B-Instruct's config.json: 4.57's spelling, its YaRN (attention_factor written out) for
# the full layers, three sliding layers to one full.
OLMO3_7B = {
    **{k: v for k, v in OLMO2_7B.items() if k not in ("rope_scaling", "max_position_embeddings")},
    "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "max_position_embeddings": 65536,
    "sliding_window": 4096,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 8,
    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1, "factor": 8.0,
                     "original_max_position_embeddings": 8192, "rope_type": "yarn"}}


def test_published_olmo_configs_read_as_transformers_reads_them():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    olmo2 = config_from_hf(OLMO2_7B)
    assert (olmo2.family, olmo2.head_dim, olmo2.d_ff, olmo2.rope_theta, olmo2.rope_type) == (
        "olmo2", 128, 11008, 5e5, "default")
    assert olmo2.qk_norm and olmo2.qk_norm_over_heads and olmo2.sandwich_norms and olmo2.norm_scale_fp32
    assert not olmo2.pre_norms and olmo2.layer_types is None and olmo2.param_dtype == "bfloat16"
    olmo3 = config_from_hf(OLMO3_7B)
    theirs = transformers.Olmo3Config(**copy.deepcopy(OLMO3_7B))
    assert [t + "_attention" for t in olmo3.layer_types] == list(theirs.layer_types)
    assert (olmo3.sliding_window, olmo3.rope_type, olmo3.rope_factor, olmo3.rope_original_max_len) == (
        4096, "yarn", 8.0, 8192)
    # the sliding layers rotate unscaled at the same base, as transformers' per-kind RoPE does
    assert olmo3.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 5e5
    assert theirs.rope_parameters["sliding_attention"]["rope_type"] == "default"
    _, attention = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu", layer_type="full_attention")
    assert olmo3.rope_attention_factor == pytest.approx(attention, rel=1e-12)
    # the layer kinds default to transformers' pattern when a file leaves them out
    bare = config_from_hf({k: v for k, v in OLMO3_7B.items() if k != "layer_types"})
    assert bare.layer_types == olmo3.layer_types
    for cfg, cls in ((olmo2, transformers.Olmo2Config), (olmo3, transformers.Olmo3Config)):
        exported = config_to_hf(cfg)
        assert config_from_hf(exported) == cfg
        back = cls(**copy.deepcopy(exported))
        assert (back.hidden_size, back.num_hidden_layers, back.intermediate_size) == (4096, 32, 11008)
    back = transformers.Olmo3Config(**copy.deepcopy(config_to_hf(olmo3)))
    assert back.rope_parameters["full_attention"]["factor"] == 8.0
    assert back.rope_parameters["sliding_attention"]["rope_type"] == "default"


@pytest.mark.parametrize("changes,message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 16}, r"layer_types contains \['chunked_attention'\]"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                       "mscale": 1.0, "mscale_all_dim": 1.0, "extrapolation": 2}},
     r"yarn rope parameter\(s\) \['extrapolation'\] are not supported"),
])
def test_olmo_refuses_what_the_model_does_not_implement(changes, message):
    from sfrrl_jax.checkpoints.hf import HFConfigError
    with pytest.raises(HFConfigError, match=message):
        config_from_hf({**OLMO3_7B, **changes})
    olmo3 = config_from_hf(OLMO3_7B)
    with pytest.raises(HFConfigError, match="Olmo3ForCausalLM requires"):
        config_to_hf(olmo3.replace(pre_norms=True))
    with pytest.raises(HFConfigError, match="needs rope_local_theta"):
        config_to_hf(olmo3.replace(rope_local_theta=None))
    with pytest.raises(HFConfigError, match="Olmo2ForCausalLM has no sliding window"):
        config_to_hf(olmo3.replace(family="olmo2", rope_local_theta=None))
    with pytest.raises(HFConfigError, match="LlamaForCausalLM requires"):
        config_to_hf(config_from_hf(OLMO2_7B).replace(family="llama"))


def test_yarn_attention_factor_follows_transformers_mscale_rule():
    """DeepSeek-style yarn (mscale, mscale_all_dim; no attention_factor): the cos/sin scale is the
    ratio of the two log-factor scales, as transformers computes it; neither: 0.1 ln(factor) + 1."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for scaling in ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "mscale": 0.707, "mscale_all_dim": 1.0},
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}):
        hf = {**OLMO2_7B, "max_position_embeddings": 131072, "rope_scaling": scaling}
        cfg = config_from_hf(hf)
        _, theirs = ROPE_INIT_FUNCTIONS["yarn"](transformers.Olmo2Config(**copy.deepcopy(hf)), "cpu")
        from sfrrl_jax.models.layers import rope_inv_freq
        _, ours = rope_inv_freq(cfg)
        assert float(ours) == pytest.approx(theirs, rel=1e-12)
        assert config_from_hf(config_to_hf(cfg)) == cfg


# SmolLM3-3B's config.json (the architecture's fields, as published): a NoPE layer every fourth.
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "eos_token_id": 128012, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 65536, "max_window_layers": 28,
    "mlp_bias": False, "model_type": "smollm3", "no_rope_layer_interval": 4,
    "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)], "num_attention_heads": 16,
    "num_hidden_layers": 36, "num_key_value_heads": 4, "pad_token_id": 128004, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 128256}


def test_published_smollm3_config_reads_its_nope_layers_as_transformers_does():
    import transformers
    cfg = config_from_hf(SMOLLM3_3B)
    theirs = transformers.SmolLM3Config(**copy.deepcopy(SMOLLM3_3B))
    assert (cfg.family, cfg.head_dim, cfg.n_kv_heads, cfg.d_ff, cfg.rope_theta, cfg.tie_embeddings) == (
        "smollm3", 128, 4, 11008, 5e6, True)
    assert cfg.nope_layers == tuple(range(3, 36, 4)) and [int(r) for r in cfg.layer_ropes] == theirs.no_rope_layers
    assert cfg.layer_types is None and cfg.sliding_window is None
    # a file without the list: transformers' interval rule
    bare = config_from_hf({k: v for k, v in SMOLLM3_3B.items() if k != "no_rope_layers"})
    assert bare.nope_layers == cfg.nope_layers
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    back = transformers.SmolLM3Config(**copy.deepcopy(exported))
    assert back.no_rope_layers == theirs.no_rope_layers and not back.use_sliding_window
    from sfrrl_jax.checkpoints.hf import HFConfigError
    for changes, message in (({"no_rope_layers": [1] * 35}, "must list 0 or 1 for each of the 36 layers"),
                             ({"no_rope_layers": [2] * 36}, "must list 0 or 1"),
                             ({"mlp_bias": True}, "mlp_bias=True")):
        with pytest.raises(HFConfigError, match=message):
            config_from_hf({**SMOLLM3_3B, **changes})
    with pytest.raises(HFConfigError, match="LlamaForCausalLM applies RoPE in every layer"):
        config_to_hf(cfg.replace(family="llama"))


# OLMoE-1B-7B-0125-Instruct's config.json (the architecture's fields, as published).
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "clip_qkv": None, "eos_token_id": 50279,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024, "max_position_embeddings": 4096,
    "model_type": "olmoe", "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16, "pad_token_id": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 50304}


def test_published_olmoe_config_maps_onto_a_softmax_topk_moe_with_whole_projection_qk_norms():
    import transformers
    cfg = config_from_hf(OLMOE_1B_7B)
    assert (cfg.family, cfg.n_experts, cfg.top_k, cfg.d_ff_expert, cfg.router, cfg.norm_topk_prob) == (
        "olmoe", 64, 8, 1024, "softmax_topk", False)
    assert cfg.qk_norm and cfg.qk_norm_over_heads and cfg.pre_norms and not cfg.norm_scale_fp32
    assert (cfg.head_dim, cfg.router_aux_coef) == (128, 0.01)
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    back = transformers.OlmoeConfig(**copy.deepcopy(exported))
    assert (back.num_experts, back.num_experts_per_tok, back.intermediate_size, back.norm_topk_prob) == (
        64, 8, 1024, False)
    from sfrrl_jax.checkpoints.hf import HFConfigError
    with pytest.raises(HFConfigError, match="clip_qkv=8.0"):
        config_from_hf({**OLMOE_1B_7B, "clip_qkv": 8.0})
    with pytest.raises(HFConfigError, match="q_norm spans hidden_size"):
        config_from_hf({**OLMOE_1B_7B, "head_dim": 64})
    with pytest.raises(HFConfigError, match="q_norm spans hidden_size"):
        config_to_hf(cfg.replace(head_dim=64))
    with pytest.raises(HFConfigError, match="Qwen3MoeForCausalLM requires"):
        config_to_hf(cfg.replace(family="qwen3_moe"))   # Qwen3-MoE's q/k norms are per head


# Seed-OSS-36B's config.json (as released: dropout in its training mode, q/k/v biases only).
SEED_OSS_36B = {
    "architectures": ["SeedOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.1,
    "attention_out_bias": False, "bos_token_id": 0, "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 27648, "max_position_embeddings": 524288,
    "mlp_bias": False, "model_type": "seed_oss", "num_attention_heads": 80, "num_hidden_layers": 64,
    "num_key_value_heads": 8, "pad_token_id": 1, "residual_dropout": 0.1, "rms_norm_eps": 1e-06,
    "rope_scaling": {"rope_type": "default"}, "rope_theta": 10000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 155136}


def test_published_seed_oss_config_reads_as_transformers_reads_it():
    import transformers
    from sfrrl_jax.checkpoints.hf import HFConfigError
    cfg = config_from_hf(SEED_OSS_36B)
    theirs = transformers.SeedOssConfig(**copy.deepcopy(SEED_OSS_36B))
    assert (cfg.family, cfg.n_experts, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        "seed_oss", 0, 27648, 80, 8, 128)
    assert (cfg.attention_bias, cfg.out_bias, cfg.rope_theta) == (True, False, theirs.rope_parameters["rope_theta"])
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    back = transformers.SeedOssConfig(**copy.deepcopy(exported))
    assert (back.attention_bias, back.attention_out_bias, back.mlp_bias) == (True, False, False)
    with pytest.raises(HFConfigError, match="mlp_bias=True is not supported"):
        config_from_hf({**SEED_OSS_36B, "mlp_bias": True})
