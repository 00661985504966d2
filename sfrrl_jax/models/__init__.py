"""Model definitions: layers, MoE, the transformer, LoRA adapters, and the public entry points."""
from sfrrl_jax.models.api import forward, init_params, mesh_of, param_shardings
from sfrrl_jax.models.lora import (AdaptedParams, LoraAdapter, LoraConfig, adapter_shardings, init_adapter,
                                   merge_adapter, with_adapter)
from sfrrl_jax.models.transformer import forward_hidden, param_logical_axes, unembedding

__all__ = ["forward", "init_params", "mesh_of", "param_shardings", "forward_hidden",
           "param_logical_axes", "unembedding",
           "AdaptedParams", "LoraAdapter", "LoraConfig", "adapter_shardings", "init_adapter", "merge_adapter",
           "with_adapter"]
