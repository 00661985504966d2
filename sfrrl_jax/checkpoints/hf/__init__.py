"""Hugging Face checkpoints: `load_hf` (streamed into sharded params) and `save_hf`;
PEFT LoRA adapter directories: `load_adapter` / `save_adapter`.

Families: qwen3_moe, qwen2_moe, gpt_oss (incl. MXFP4 experts on load), mixtral, olmoe, glm4_moe, minimax_m2, the
latent-attention deepseek_v2, deepseek_v3 and glm4_moe_lite (DeepSeek's interleaved RoPE rows permuted on
load, written back interleaved), and the dense
llama, mistral, qwen2, qwen3, gemma3_text, phi3 (q/k/v and gate/up fused in its files), granite, seed_oss,
olmo2, olmo3 and smollm3 (NoPE layers); kimi_k2 reads as deepseek_v3. FP8 weights (DeepSeek-V3's block
scales, `*-FP8` releases, compressed-tensors' float-quantized format) are dequantised on load.
"""
from sfrrl_jax.checkpoints.hf.fp8_weights import dequantize_fp8
from sfrrl_jax.checkpoints.hf.hf_config import (SUPPORTED_FAMILIES, HFConfigError, config_from_hf,
                                                config_to_hf, read_hf_config)
from sfrrl_jax.checkpoints.hf.loader import load_hf
from sfrrl_jax.checkpoints.hf.mxfp4 import dequantize_mxfp4
from sfrrl_jax.checkpoints.hf.peft_adapter import load_adapter, save_adapter
from sfrrl_jax.checkpoints.hf.safetensors_io import CheckpointError
from sfrrl_jax.checkpoints.hf.saver import save_hf

__all__ = ["SUPPORTED_FAMILIES", "CheckpointError", "HFConfigError", "config_from_hf", "config_to_hf",
           "dequantize_fp8", "dequantize_mxfp4", "load_adapter", "load_hf", "read_hf_config", "save_adapter",
           "save_hf"]
