"""The train step (exact micro-batch accumulation + AdamW update) and the optimizer."""
from sfrrl_jax.learner.optimizer import OptimizerConfig, build_optimizer, learning_rate_schedule
from sfrrl_jax.learner.train_step import TrainStep, make_train_step, validate_microbatch

__all__ = ["OptimizerConfig", "TrainStep", "build_optimizer", "learning_rate_schedule",
           "make_train_step", "validate_microbatch"]
