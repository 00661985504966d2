"""The train step (exact micro-batch accumulation + one optimizer update), its typed state, the optimizer.

The loss is a `sfrrl_jax.rl.Loss` value (re-exported here with its built-in constructors) or a
`LossConfig`; the optimizer an optax `GradientTransformation` or an `OptimizerConfig`. A micro-batch
is a `sfrrl_jax.rl.MicroBatch` (re-exported here with `validate_microbatch`, its edge check).
"""
from sfrrl_jax.rl.loss_fn import Loss, LossInputs, loss_from_config, policy_loss, sft_loss
from sfrrl_jax.rl.microbatch import MicroBatch, validate_microbatch
from sfrrl_jax.learner.accumulator import AccStats, Accumulator, Scalars
from sfrrl_jax.learner.deferred import DeferredBuffer
from sfrrl_jax.learner.optimizer import (
    OptimizerConfig, OptState, build_optimizer, learning_rate_schedule, opt_state_shardings,
)
from sfrrl_jax.learner.train_step import TrainStep, make_train_step

__all__ = ["AccStats", "Accumulator", "DeferredBuffer", "Loss", "LossInputs", "MicroBatch", "OptState",
           "OptimizerConfig", "Scalars", "TrainStep", "build_optimizer", "learning_rate_schedule",
           "loss_from_config", "make_train_step", "opt_state_shardings", "policy_loss", "sft_loss",
           "validate_microbatch"]
