"""Tiny random HF models of each family, built offline with transformers, and their references.

Every parameter (biases, sinks and norm scales included) is re-drawn so that no part of the
mapping can hide behind a zero or a one. Sizes are small but deliberately uneven.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import transformers

FAMILY_CLASSES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    "glm4_moe_lite": (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM),
    "minimax_m2": (transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM),
    "seed_oss": (transformers.SeedOssConfig, transformers.SeedOssForCausalLM),
}

# name -> (family, HF config kwargs). Expert counts divide the test mesh's expert axis (4).
CONFIGS = {
    # GQA 3:1, odd vocab and expert width, renormalised top-k.
    "qwen3_gqa3": ("qwen3_moe", dict(
        vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20, intermediate_size=40,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    # MHA, un-normalised top-k, sliding window on every layer, tied embeddings.
    "qwen3_mha_window_tied": ("qwen3_moe", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        head_dim=12, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=16, intermediate_size=40,
        norm_topk_prob=False, use_sliding_window=True, sliding_window=5, tie_word_embeddings=True)),
    # Mixed stack: layers 0 and 2 dense (mlp_only_layers; intermediate_size != moe width), so the
    # layers run as four one-layer scans alternating between the two stacks.
    "qwen3_mlp_only": ("qwen3_moe", dict(
        vocab_size=59, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, intermediate_size=36,
        norm_topk_prob=True, mlp_only_layers=[0, 2])),
    # decoder_sparse_step=2: layers 1 and 3 MoE; plus mlp_only_layers=[3] -> only layer 1 MoE, the
    # dense ones in runs of 1 and 2 layers.
    "qwen3_sparse_step": ("qwen3_moe", dict(
        vocab_size=61, hidden_size=24, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=12, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=10, intermediate_size=28,
        norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3])),
    # Qwen1.5-MoE-like: q/k/v biases, a gated shared expert of its own width, un-normalised top-k.
    "qwen2_moe_shared": ("qwen2_moe", dict(
        vocab_size=79, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=28,
        intermediate_size=36, norm_topk_prob=False)),
    # ... with a dense layer (mlp_only_layers), renormalised top-k, tied embeddings.
    "qwen2_moe_mlp_only": ("qwen2_moe", dict(
        vocab_size=61, hidden_size=24, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=12, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=10,
        shared_expert_intermediate_size=14, intermediate_size=20, norm_topk_prob=True, mlp_only_layers=[1],
        tie_word_embeddings=True)),
    # GQA 4:1, sliding + full layers, sinks, YaRN (untruncated), a low clamp that bites.
    "gptoss_gqa4": ("gpt_oss", dict(
        vocab_size=80, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=4,
        max_position_embeddings=2048,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    # Odd sizes, three layers of mixed kinds, top-3 of 4, truncated YaRN.
    "gptoss_odd": ("gpt_oss", dict(
        vocab_size=71, hidden_size=40, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
        head_dim=10, num_local_experts=4, num_experts_per_tok=3, intermediate_size=24, sliding_window=3,
        max_position_embeddings=128,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 16.0,
                         "beta_slow": 2.0, "truncate": True, "original_max_position_embeddings": 32})),
    # GQA 4:1, head_dim from hidden/heads.
    "mixtral_gqa4": ("mixtral", dict(
        vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=28)),
    # MQA, explicit head_dim != hidden/heads, sliding window, tied embeddings.
    "mixtral_mqa_window_tied": ("mixtral", dict(
        vocab_size=67, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=10, num_local_experts=8, num_experts_per_tok=2, intermediate_size=18, sliding_window=3,
        tie_word_embeddings=True)),
    # Dense families (n_experts=0). SmolLM2-like: GQA 2:1, tied embeddings, rope theta 1e5.
    "llama_gqa_tied": ("llama", dict(
        vocab_size=83, hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=36, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    # Llama with q/k/v/o biases, MHA, explicit head_dim, linear rope scaling (positions / 3).
    "llama_bias_mha": ("llama", dict(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=12, intermediate_size=20, attention_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 2000.0})),
    # Qwen2: q/k/v biases (none on the output), a window on the layers after the first.
    "qwen2_bias_window": ("qwen2", dict(
        vocab_size=75, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=44, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # Llama 3.1 rope scaling: a low base so that every band (kept, blended, slowed) turns at the
    # test's positions; original context 64 puts 2 of 8 frequencies in the blend.
    "llama3_rope": ("llama", dict(
        vocab_size=66, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=24, max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Mistral v0.1: a window on every layer, GQA 4:1, rope theta 1e4.
    "mistral_window": ("mistral", dict(
        vocab_size=73, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, intermediate_size=26, sliding_window=3, rope_theta=10000.0)),
    # Mistral v0.3 / Nemo: no window (sliding_window null), head_dim * heads != hidden, theta 1e6.
    "mistral_nemo_like": ("mistral", dict(
        vocab_size=69, hidden_size=30, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=22, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3 dense: q/k norms, GQA 3:1, head_dim != hidden/heads.
    "qwen3_dense": ("qwen3", dict(
        vocab_size=70, hidden_size=36, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=10, intermediate_size=30, rope_parameters={"rope_type": "default", "rope_theta": 7000.0})),
    # Gemma 3: sliding and global layers with RoPEs of their own (the global one linearly
    # scaled, as from 4B up), query_pre_attn_scalar != head_dim, GeGLU, sandwich norms, tied.
    "gemma3_local_global": ("gemma3_text", dict(
        vocab_size=71, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=28, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    # Gemma 3 1B's shape in small: MQA, the default pattern (five sliding layers, then a global
    # one), unscaled RoPEs, query_pre_attn_scalar == head_dim.
    "gemma3_1b_like": ("gemma3_text", dict(
        vocab_size=67, hidden_size=24, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=40, sliding_window=3, query_pre_attn_scalar=16)),
    # Phi-4-mini in small: fused qkv and gate_up, RoPE on 3/4 of each head, longrope (its short
    # factors at the test's lengths), tied embeddings; GQA 2:1.
    "phi4_mini_like": ("phi3", dict(
        vocab_size=79, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=36, max_position_embeddings=64, original_max_position_embeddings=16,
        tie_word_embeddings=True, sliding_window=None, pad_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "long_factor": [1.0, 1.5, 2.5, 4.0, 9.0, 16.0],
                         "short_factor": [1.0, 1.1, 1.25, 1.5, 2.0, 2.4],
                         "original_max_position_embeddings": 16})),
    # Phi-3-mini-4k in small: default RoPE on the whole head, a window on every layer.
    "phi3_mini_window": ("phi3", dict(
        vocab_size=73, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=30, max_position_embeddings=64, original_max_position_embeddings=64, sliding_window=4,
        pad_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Granite 3: Llama's block with its four multipliers (none of them 1 or a power of two here),
    # q/k/v/o biases, tied embeddings.
    "granite_multipliers": ("granite", dict(
        vocab_size=77, hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=34, attention_bias=True, tie_word_embeddings=True, embedding_multiplier=3.5,
        attention_multiplier=0.11, residual_multiplier=0.4, logits_scaling=2.5, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 30000.0})),
    # OLMo 2: the post-norm block, q/k norms over the whole projection (GQA 3:1, so the two
    # norms differ in width), q/k/v/o biases, llama3 rope scaling.
    "olmo2_post_norm": ("olmo2", dict(
        vocab_size=83, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=26, attention_bias=True, pad_token_id=0, eos_token_id=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": 20000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    # OLMo 3 7B's shape in small: three sliding layers to one full, YaRN on the full layers only
    # (its attention_factor given, as the published config does), MHA.
    "olmo3_sliding_yarn": ("olmo3", dict(
        vocab_size=75, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=30, sliding_window=3, pad_token_id=0, eos_token_id=1, max_position_embeddings=64,
        rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0,
                                            "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "attention_factor": 1.35},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}})),
    # SmolLM3: Llama's block with two NoPE layers (not at the default interval), windowed as
    # transformers windows them (the NoPE layers, with use_sliding_window), tied embeddings, GQA 3:1.
    "smollm3_nope_window": ("smollm3", dict(
        vocab_size=81, hidden_size=48, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=28, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=3,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    # OLMoE: softmax-then-top-k routing without renormalisation, q/k norms over the whole
    # projection (GQA 2:1: the k norm is narrower), q/k/v/o biases.
    "olmoe_gqa": ("olmoe", dict(
        vocab_size=69, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=18, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, attention_bias=True,
        pad_token_id=0, eos_token_id=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # GLM-4.5 in small: a dense first layer, then sigmoid routing with a selection bias among 2 of
    # 4 expert groups, renormalised and scaled by 2.5, an ungated shared expert two experts wide,
    # RoPE on half of each head, q/k/v biases (none on o), per-head q/k norms, GQA 3:1.
    "glm4_moe_groups": ("glm4_moe", dict(
        vocab_size=91, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=12, intermediate_size=40, moe_intermediate_size=14, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=0,
        pad_token_id=0, eos_token_id=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # DeepSeek-V3 in small: latent attention with a query latent (q_lora_rank), interleaved RoPE,
    # YaRN with mscale_all_dim (the scores' scale) and mscale (the cos/sin scale); v_head_dim
    # apart from the nope and rope dims; GLM's MoE (a dense first layer, 2 of 4 groups, scale 2.5).
    "deepseek_v3_mla": ("deepseek_v3", dict(
        vocab_size=83, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
        intermediate_size=40, moe_intermediate_size=14, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, num_nextn_predict_layers=0, pad_token_id=0, eos_token_id=1,
        max_position_embeddings=64, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.8,
                         "mscale_all_dim": 0.7, "original_max_position_embeddings": 16, "beta_fast": 32,
                         "beta_slow": 1})),
    # Moonlight / DeepSeek-V2-Lite-like attention: no query latent, RoPE halves (rope_interleave
    # false), plain RoPE; un-normalised routes, one group; a large rms_norm_eps (the latent's norm
    # keeps 1e-6).
    "deepseek_v3_noq": ("deepseek_v3", dict(
        vocab_size=71, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=12,
        intermediate_size=24, moe_intermediate_size=10, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=2, n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False,
        first_k_dense_replace=1, num_nextn_predict_layers=0, pad_token_id=0, eos_token_id=1, rms_norm_eps=0.05,
        max_position_embeddings=64, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    # DeepSeek-V2-Lite in small: latent attention without a query latent, RoPE as complex pairs,
    # YaRN with mscale = mscale_all_dim (V2-Lite's 0.707); softmax routing never renormalised,
    # scaled by 1.6; a dense first layer, a shared expert two experts wide.
    "deepseek_v2_lite": ("deepseek_v2", dict(
        vocab_size=79, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=20, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=8,
        intermediate_size=36, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=2, routed_scaling_factor=1.6, topk_method="greedy", first_k_dense_replace=1,
        pad_token_id=0, eos_token_id=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 16})),
    # DeepSeek-V2 / V2.5 / Coder-V2 in small: V2-Lite's attention with a query latent, the experts
    # chosen within the 2 of 4 groups whose best probability is highest (group_limited_greedy).
    "deepseek_v2_groups": ("deepseek_v2", dict(
        vocab_size=73, hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=16, kv_lora_rank=20, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=8,
        intermediate_size=36, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, routed_scaling_factor=1.3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        first_k_dense_replace=1, pad_token_id=0, eos_token_id=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # MiniMax-M2 in small: q/k norms over the whole projection, RoPE on half of each head (the
    # released configs' rotary_dim), every layer's experts chosen by sigmoid + a selection bias.
    "minimax_m2_small": ("minimax_m2", dict(
        vocab_size=89, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rotary_dim=8, intermediate_size=20, num_local_experts=8, num_experts_per_tok=3,
        pad_token_id=0, bos_token_id=2, eos_token_id=1, max_position_embeddings=64, rms_norm_eps=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6})),
    # Seed-OSS in small: Llama's block with q/k/v biases and none on the output, GQA 3:1, head_dim
    # apart from hidden / heads (dropout off: it acts in HF's training mode only).
    "seed_oss_bias": ("seed_oss", dict(
        vocab_size=77, hidden_size=36, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, intermediate_size=28, attention_bias=True, attention_out_bias=False, attention_dropout=0.0,
        residual_dropout=0.0, pad_token_id=0, bos_token_id=2, eos_token_id=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7})),
    # GLM-4.7-Flash in small: DeepSeek-V3's latent attention (a query latent, values wider than
    # the key's nope dims, interleaved RoPE) and GLM's MoE, its dense layers named per layer: the
    # second and the fourth, not a leading run. A large rms_norm_eps: the latents' norms keep 1e-6.
    "glm4_moe_lite_types": ("glm4_moe_lite", dict(
        vocab_size=87, hidden_size=40, num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=5,
        q_lora_rank=16, kv_lora_rank=18, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=14,
        intermediate_size=30, moe_intermediate_size=10, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
        mlp_layer_types=["sparse", "dense", "sparse", "dense"], pad_token_id=0, eos_token_id=1, rms_norm_eps=0.05,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(std * noise)
        for name, b in model.named_buffers():   # GLM's routing bias: a buffer, moved to matter
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    family, kwargs = CONFIGS[name]
    config_cls, model_cls = FAMILY_CLASSES[family]
    config = config_cls(**kwargs)
    # The reference implementations: plain attention and the per-expert loop (transformers'
    # grouped_mm path needs 16-byte aligned strides, which odd sizes do not have on CPU).
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def save_model(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def tokens_for(vocab_size: int, batch: int = 2, seq: int = 11, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, seq)).astype(np.int32)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def load_transformers(directory: Path):
    """`from_pretrained` of a local directory, fp32, eager attention, as a user would."""
    config = json.loads((Path(directory) / "config.json").read_text())
    _, model_cls = FAMILY_CLASSES[config["model_type"]]
    return model_cls.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                     attn_implementation="eager", experts_implementation="eager").eval()


# -- MXFP4 reference (written from the format definition, independent of the library) -----------

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_value(code: int) -> float:
    """FP4 e2m1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 = subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else (1.0 + man / 2.0) * 2.0 ** (exp - 1)
    return sign * mag


def reference_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Element by element: byte j of a block holds values 2j (low nibble) and 2j+1 (high nibble)."""
    *lead, groups, nbytes = blocks.shape
    out = np.zeros((*lead, groups * 2 * nbytes), np.float64)
    flat_b = blocks.reshape(-1, groups, nbytes)
    flat_s = scales.reshape(-1, groups)
    flat_o = out.reshape(-1, groups * 2 * nbytes)
    for r in range(flat_b.shape[0]):
        for g in range(groups):
            scale = 2.0 ** (int(flat_s[r, g]) - 127)
            for j in range(nbytes):
                byte = int(flat_b[r, g, j])
                flat_o[r, g * 32 + 2 * j] = e2m1_value(byte & 0xF) * scale
                flat_o[r, g * 32 + 2 * j + 1] = e2m1_value(byte >> 4) * scale
    return out


def reference_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K] float -> (blocks [..., K/32, 16] u8, scales [..., K/32] u8), round to nearest."""
    *lead, k = w.shape
    g = k // 32
    x = w.reshape(*lead, g, 32).astype(np.float64)
    amax = np.abs(x).max(axis=-1)
    # The largest e2m1 magnitude is 6 = 1.5 * 2**2: pick the exponent that maps amax into range.
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).astype(np.int64)
    exp = np.clip(exp, -127, 127)
    scaled = x / (2.0 ** exp)[..., None]
    mags = np.array(E2M1_MAGNITUDES)
    idx = np.abs(np.abs(scaled)[..., None] - mags).argmin(axis=-1)
    codes = (idx | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    # C order explicitly: ufuncs keep a transposed input's memory order, and safetensors.numpy
    # writes an array's raw buffer.
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exp + 127).astype(np.uint8))


def expected_mxfp4_shapes(e: int, out_dim: int, in_dim: int) -> tuple[tuple, tuple]:
    return (e, out_dim, math.ceil(in_dim / 32), 16), (e, out_dim, math.ceil(in_dim / 32))
