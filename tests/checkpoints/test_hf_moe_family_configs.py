"""config.json <-> ModelConfig for GLM-4.5's and DeepSeek's MoE (sigmoid routing over expert groups,
a selection bias, dense first layers) and the latent-attention families (DeepSeek-V2 / V3,
Moonlight, GLM-4.7-Flash): the published configs read as transformers' own config classes read
them, our export is read back unchanged, and what the models cannot hold is refused by name."""
import copy

import pytest

from sfrrl_jax.checkpoints.hf import config_from_hf, config_to_hf


# GLM-4.5-Air's config.json (the architecture's fields, as published; 4.x spelling).
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
    "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16", "use_qk_norm": False,
    "vocab_size": 151552}


def test_published_glm45_air_config_reads_as_transformers_reads_it():
    import transformers
    cfg = config_from_hf(GLM45_AIR)
    theirs = transformers.Glm4MoeConfig(**copy.deepcopy(GLM45_AIR))
    assert (cfg.family, cfg.router, cfg.n_experts, cfg.top_k, cfg.d_ff_expert, cfg.d_ff_shared) == (
        "glm4_moe", "sigmoid_topk", 128, 8, 1408, 1408)
    assert (cfg.dense_layers, cfg.d_ff, cfg.router_scale, cfg.router_groups, cfg.router_topk_groups) == (
        (0,), 10944, 1.0, 1, 1)
    assert (cfg.head_dim, cfg.rope_partial_factor, cfg.rope_theta, cfg.qk_norm) == (128, 0.5, 1e6, False)
    assert cfg.attention_bias and not cfg.out_bias and not cfg.shared_expert_gate and cfg.norm_topk_prob
    assert theirs.rope_parameters["partial_rotary_factor"] == 0.5 and theirs.first_k_dense_replace == 1
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    back = transformers.Glm4MoeConfig(**copy.deepcopy(exported))
    assert (back.n_routed_experts, back.n_shared_experts, back.first_k_dense_replace, back.routed_scaling_factor,
            back.rope_parameters["partial_rotary_factor"]) == (128, 1, 1, 1.0, 0.5)
    # GLM-4.5 (355B): 2.5x scaled routes; a DeepSeek-style grouped choice reads too
    grouped = config_from_hf({**GLM45_AIR, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4})
    assert (grouped.router_scale, grouped.router_groups, grouped.router_topk_groups) == (2.5, 8, 4)
    from sfrrl_jax.checkpoints.hf import HFConfigError
    for changes, message in (({"n_group": 3}, "router_groups=3 must divide n_experts=128"),
                             ({"n_group": 0}, "^config.json: n_group=0 must be >= 1$"),   # named once
                             ({"topk_group": 2}, "router_topk_groups=2 > router_groups=1"),
                             ({"first_k_dense_replace": 46}, "leaves no MoE layer"),
                             ({"hidden_act": "gelu"}, "hidden_act='gelu'")):
        with pytest.raises(HFConfigError, match=message):
            config_from_hf({**GLM45_AIR, **changes})
    with pytest.raises(HFConfigError, match="dense layers are the first k"):
        config_to_hf(cfg.replace(dense_layers=(1,)))
    with pytest.raises(HFConfigError, match="shared expert is a multiple of d_ff_expert wide"):
        config_to_hf(cfg.replace(d_ff_shared=1000))
    with pytest.raises(HFConfigError, match="Qwen3MoeForCausalLM requires"):
        config_to_hf(cfg.replace(family="qwen3_moe"))


# DeepSeek-V3's config.json (the architecture's fields, as published: FP8 weights, YaRN with mscale).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 129280}

# Kimi K2 Instruct's (DeepSeek-V3's architecture under model_type kimi_k2: 384 experts in one
# group, 64 heads, YaRN x32 over 4096 positions, FP8 blocks).
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585,
           "first_k_dense_replace": 1, "max_position_embeddings": 131072, "n_group": 1, "n_routed_experts": 384,
           "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "topk_group": 1, "vocab_size": 163840}


def test_kimi_k2_reads_as_deepseek_v3():
    import math
    cfg = config_from_hf(KIMI_K2)
    assert cfg == config_from_hf({**KIMI_K2, "model_type": "deepseek_v3"}).replace(name="kimi_k2")
    assert (cfg.family, cfg.n_heads, cfg.n_experts, cfg.top_k, cfg.router_groups, cfg.router_scale) == (
        "deepseek_v3", 64, 384, 8, 1, 2.827)
    assert (cfg.dense_layers, cfg.rope_factor, cfg.rope_theta) == ((0,), 32.0, 50000.0)
    assert cfg.query_scale == pytest.approx((0.1 * math.log(32) + 1) ** 2 / math.sqrt(192), rel=1e-12)
    assert config_to_hf(cfg)["model_type"] == "deepseek_v3"   # written as the architecture transformers reads


# Moonlight-16B-A3B's (Kimi's DeepSeek-V3 architecture): no query latent, plain RoPE, bf16.
MOONLIGHT_16B = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 163584,
    "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 163840}


def test_published_deepseek_v3_configs_read_as_transformers_reads_them():
    import math

    import transformers
    from sfrrl_jax.checkpoints.hf import HFConfigError
    bf16 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}   # dequantised, as released by others
    cfg = config_from_hf(bf16)
    assert config_from_hf(DEEPSEEK_V3) == cfg   # FP8 storage is the loader's concern (test_hf_fp8_weights)
    theirs = transformers.DeepseekV3Config(**copy.deepcopy(bf16))
    assert (cfg.family, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("deepseek_v3", 128, 1, 576)  # cache: one head
    assert (cfg.mla_q_rank, cfg.mla_kv_rank, cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim) == (
        theirs.q_lora_rank, theirs.kv_lora_rank, theirs.qk_nope_head_dim, theirs.qk_rope_head_dim, theirs.v_head_dim)
    assert (cfg.router, cfg.n_experts, cfg.top_k, cfg.router_groups, cfg.router_topk_groups, cfg.router_scale) == (
        "sigmoid_topk", 256, 8, 8, 4, 2.5)
    assert (cfg.dense_layers, cfg.d_ff, cfg.d_ff_expert, cfg.d_ff_shared) == ((0, 1, 2), 18432, 2048, 2048)
    # transformers' scale: 1/sqrt(192) x mscale(40, mscale_all_dim=1)^2; cos/sin x mscale / mscale_all_dim
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    def scaling(hf_cfg):   # DeepseekV3Attention.scaling, without building a 128-head layer
        return yarn_apply_mscale(hf_cfg.rope_parameters, hf_cfg.qk_head_dim ** -0.5)
    assert cfg.query_scale == pytest.approx(scaling(theirs), rel=1e-12)
    assert cfg.query_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192), rel=1e-12)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_attention_factor, cfg.rope_original_max_len) == (
        "yarn", 40.0, 1.0, 4096)
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    back = transformers.DeepseekV3Config(**copy.deepcopy(exported))
    assert scaling(back) == pytest.approx(scaling(theirs), rel=1e-12)
    assert (back.num_key_value_heads, back.q_lora_rank, back.rope_interleave) == (128, 1536, True)
    unscaled = config_from_hf({**bf16, "rope_scaling": {**bf16["rope_scaling"], "factor": 1.0}})
    assert unscaled.query_scale is None and config_from_hf(config_to_hf(unscaled)) == unscaled   # mscale(1) = 1

    moon = config_from_hf(MOONLIGHT_16B)
    assert (moon.mla_q_rank, moon.query_scale, moon.rope_type, moon.rope_theta, moon.d_ff_shared) == (
        0, None, "default", 50000.0, 2816)
    assert (moon.router_scale, moon.router_groups, moon.dense_layers, moon.head_dim) == (2.446, 1, (0,), 576)
    assert config_from_hf(config_to_hf(moon)) == moon
    assert transformers.DeepseekV3Config(**copy.deepcopy(config_to_hf(moon))).q_lora_rank is None
    for changes, message in (({"scoring_func": "softmax"}, "scoring_func='softmax'"),
                             ({"topk_method": "greedy"}, "topk_method='greedy'"),
                             ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
                             ({"attention_bias": True}, "attention_bias=True is not supported with latent"),
                             ({"qk_rope_head_dim": 7}, "mla_rope_dim=7: RoPE rotates an even number"),
                             ({"kv_lora_rank": None}, "kv_lora_rank")):
        with pytest.raises(HFConfigError, match=message):
            config_from_hf({**MOONLIGHT_16B, **changes})
    with pytest.raises(HFConfigError, match="attention is latent"):
        config_to_hf(moon.replace(mla_kv_rank=0, mla_q_rank=0, mla_nope_dim=0, mla_rope_dim=0, mla_v_dim=0,
                                  n_kv_heads=16, head_dim=128))
    with pytest.raises(HFConfigError, match="scales scores only by YaRN's mscale_all_dim"):
        config_to_hf(moon.replace(query_scale=0.1))
    with pytest.raises(HFConfigError, match="Glm4MoeForCausalLM requires"):
        config_to_hf(moon.replace(family="glm4_moe"))


# DeepSeek-V2-Lite's config.json (as published).
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 102400}


def test_published_deepseek_v2_lite_config_reads_as_transformers_reads_it():
    import transformers
    from sfrrl_jax.checkpoints.hf import HFConfigError
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale
    cfg = config_from_hf(DEEPSEEK_V2_LITE)
    theirs = transformers.DeepseekV2Config(**copy.deepcopy(DEEPSEEK_V2_LITE))
    assert (cfg.family, cfg.n_kv_heads, cfg.head_dim, cfg.mla_q_rank, cfg.mla_kv_rank, cfg.mla_v_dim) == (
        "deepseek_v2", 1, 576, 0, 512, 128)
    assert (cfg.router, cfg.norm_topk_prob, cfg.router_scale, cfg.router_fp32, cfg.n_experts, cfg.top_k) == (
        "softmax_topk", False, 1.0, True, 64, 6)
    assert (cfg.dense_layers, cfg.d_ff, cfg.d_ff_expert, cfg.d_ff_shared) == ((0,), 10944, 1408, 2816)
    assert cfg.query_scale == pytest.approx(yarn_apply_mscale(theirs.rope_parameters, 192 ** -0.5), rel=1e-12)
    assert cfg.rope_attention_factor == 1.0   # mscale / mscale_all_dim
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    back = transformers.DeepseekV2Config(**copy.deepcopy(exported))
    assert (back.topk_method, back.routed_scaling_factor, back.q_lora_rank, back.first_k_dense_replace) == (
        "greedy", 1.0, None, 1)
    assert yarn_apply_mscale(back.rope_parameters, 192 ** -0.5) == pytest.approx(cfg.query_scale, rel=1e-12)
    # DeepSeek-V2 / V2.5 (236B): experts chosen within the 3 of 8 groups whose best probability is highest
    v2 = {**DEEPSEEK_V2_LITE, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
          "n_routed_experts": 160, "routed_scaling_factor": 16.0, "q_lora_rank": 1536}
    big = config_from_hf(v2)
    assert (big.router, big.router_groups, big.router_topk_groups, big.n_experts, big.router_scale) == (
        "softmax_topk", 8, 3, 160, 16.0)
    assert config_from_hf(config_to_hf(big)) == big
    back = transformers.DeepseekV2Config(**copy.deepcopy(config_to_hf(big)))
    assert (back.topk_method, back.n_group, back.topk_group) == ("group_limited_greedy", 8, 3)
    with pytest.raises(HFConfigError, match=r"topk_method='noaux_tc' is not supported"):
        config_from_hf({**v2, "topk_method": "noaux_tc"})
    # a family whose HF class has no groups refuses them on export
    from sfrrl_jax.config import PRESETS
    with pytest.raises(HFConfigError, match=r"Qwen3MoeForCausalLM requires \{'router_groups': 1"):
        config_to_hf(PRESETS["tiny-moe"].replace(family="qwen3_moe", router_groups=2))
    with pytest.raises(HFConfigError, match="DeepseekV2ForCausalLM requires"):
        config_to_hf(cfg.replace(norm_topk_prob=True))
    with pytest.raises(HFConfigError, match="DeepseekV3ForCausalLM requires"):
        config_to_hf(cfg.replace(family="deepseek_v3"))


# GLM-4.7-Flash's config.json (the architecture's fields; MTP layer, first_k_dense_replace unread).
GLM47_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "dtype": "bfloat16", "eos_token_id": [154820, 154827, 154829], "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10240, "kv_lora_rank": 512, "max_position_embeddings": 202752,
    "model_type": "glm4_moe_lite", "moe_intermediate_size": 1536, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 20, "num_experts_per_tok": 4,
    "num_hidden_layers": 47, "num_key_value_heads": 20, "num_nextn_predict_layers": 1, "pad_token_id": 154820,
    "partial_rotary_factor": 1.0, "q_lora_rank": 768, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 1.8,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "v_head_dim": 256,
    "vocab_size": 154880}


def test_published_glm47_flash_config_reads_as_transformers_reads_it():
    import transformers
    from sfrrl_jax.checkpoints.hf import HFConfigError
    cfg = config_from_hf(GLM47_FLASH)
    theirs = transformers.Glm4MoeLiteConfig(**copy.deepcopy(GLM47_FLASH))
    assert (cfg.family, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mla_q_rank, cfg.mla_v_dim) == (
        "glm4_moe_lite", 20, 1, 576, 768, 256)
    assert cfg.dense_layers == tuple(i for i, t in enumerate(theirs.mlp_layer_types) if t == "dense") == (0,)
    assert (cfg.router, cfg.router_scale, cfg.router_fp32, cfg.top_k, cfg.d_ff_shared, cfg.query_scale) == (
        "sigmoid_topk", 1.8, True, 4, 1536, None)
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    assert transformers.Glm4MoeLiteConfig(**copy.deepcopy(exported)).mlp_layer_types == theirs.mlp_layer_types
    spread = config_from_hf({**GLM47_FLASH, "mlp_layer_types": ["dense", "sparse"] * 23 + ["dense"]})
    assert spread.dense_layers == tuple(range(0, 47, 2)) and config_from_hf(config_to_hf(spread)) == spread
    for changes, message in (({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
                             ({"mlp_layer_types": ["dense"] * 47}, "at least one 'sparse'"),
                             ({"mlp_layer_types": ["sparse"] * 46}, "each of the 47 layers"),
                             ({"topk_method": "greedy"}, "topk_method='greedy'")):
        with pytest.raises(HFConfigError, match=message):
            config_from_hf({**GLM47_FLASH, **changes})


# MiniMax-M2's config.json (the architecture's fields, as released: FP8 blocks, `rotary_dim`, MTP
# modules that are not read).
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
    "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
    "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "router_aux_loss_coef": 0.001,
    "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064}


def test_published_minimax_m2_config_reads_as_transformers_reads_it():
    import transformers
    from sfrrl_jax.checkpoints.hf import HFConfigError
    from sfrrl_jax.checkpoints.hf.fp8_weights import fp8_scheme
    cfg = config_from_hf(MINIMAX_M2)
    theirs = transformers.MiniMaxM2Config(**copy.deepcopy(MINIMAX_M2))
    assert (cfg.family, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_experts, cfg.top_k, cfg.d_ff_expert) == (
        "minimax_m2", 48, 8, 128, 256, 8, 1536)
    assert (cfg.router, cfg.norm_topk_prob, cfg.router_groups, cfg.router_scale, cfg.d_ff_shared) == (
        "sigmoid_topk", True, 1, 1.0, 0)
    assert (cfg.qk_norm, cfg.qk_norm_over_heads, cfg.rope_theta, cfg.dense_layers) == (True, True, 5e6, ())
    assert cfg.rope_partial_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.5
    assert fp8_scheme(MINIMAX_M2, "config.json").tile == (128, 128)   # its fmt spelt 'float8_e4m3fn'
    exported = config_to_hf(cfg)
    assert config_from_hf(exported) == cfg
    assert transformers.MiniMaxM2Config(**copy.deepcopy(exported)).rope_parameters["partial_rotary_factor"] == 0.5
    for changes, message in (({"attn_type_list": [0] + [1] * 61}, "lightning attention"),
                             ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
                             ({"shared_intermediate_size": 512}, "no shared expert"),
                             ({"use_routing_bias": False}, "use_routing_bias=False"),
                             ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head'")):
        with pytest.raises(HFConfigError, match=message):
            config_from_hf({**MINIMAX_M2, **changes})
    with pytest.raises(HFConfigError, match="MiniMaxM2ForCausalLM requires"):
        config_to_hf(cfg.replace(norm_topk_prob=False))
