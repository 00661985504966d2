"""sfrrl_jax: pipelined-synchronous RL for agentic Mixture-of-Experts LLMs in JAX.

    mesh = make_mesh(data=2, expert=4)
    cfg = ModelConfig.preset("tiny-moe")
    params = init_params(cfg, mesh, seed=0)        # the one sharded param pytree
    logits = forward(cfg, params, tokens)          # training forward
    outs = generate(cfg, params, prompts, 16)      # the rollout engine, same arrays
"""
from sfrrl_jax import agents, engine, learner, rl  # noqa: F401
from sfrrl_jax.checkpoints.hf import load_hf, save_hf
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine import Engine, generate
from sfrrl_jax.mesh import LOGICAL_AXIS_RULES, make_mesh, shard_by_logical
from sfrrl_jax.models import forward, init_params, param_logical_axes
from sfrrl_jax.rl import AdvantageConfig, LossConfig
from sfrrl_jax.tokenizer import load_tokenizer
from sfrrl_jax.learner import OptimizerConfig, make_train_step

__all__ = ["ModelConfig", "LOGICAL_AXIS_RULES", "make_mesh", "shard_by_logical", "forward",
           "init_params", "param_logical_axes", "Engine", "generate", "AdvantageConfig", "LossConfig",
           "OptimizerConfig", "make_train_step", "load_tokenizer", "load_hf", "save_hf"]
