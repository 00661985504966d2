"""sfrrl_jax: pipelined-synchronous RL for agentic Mixture-of-Experts LLMs in JAX."""
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import LOGICAL_AXIS_RULES, make_mesh, shard_by_logical
from sfrrl_jax import rl  # noqa: F401
from sfrrl_jax.models import forward, init_params, param_logical_axes

__all__ = ["ModelConfig", "LOGICAL_AXIS_RULES", "make_mesh", "shard_by_logical", "forward",
           "init_params", "param_logical_axes"]
