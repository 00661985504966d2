"""The loops around the train step: pipelined-synchronous RL (`RLTrainer`), SFT, evaluation.

    trainer = RLTrainer(model_cfg, params, TrainerConfig(...), loss, optimizer, rollout_fn, TaskStream(tasks))
    metrics = trainer.step()          # one on-policy RL step: rollout and training on one mesh
"""
from sfrrl_jax.trainer.agent_rollout import AgentRollout
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.evaluate import evaluate
from sfrrl_jax.trainer.health import TrainingDivergedError
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.trainer.rollout_fn import RolloutFn
from sfrrl_jax.trainer.run_logger import RunLogger, read_metrics
from sfrrl_jax.trainer.sft import run_sft, teacher_forced_accuracy
from sfrrl_jax.trainer.timeline import Timeline

__all__ = ["AgentRollout", "RLTrainer", "RolloutFn", "RunLogger", "TaskStream", "Timeline", "TrainerConfig",
           "TrainingDivergedError", "evaluate", "read_metrics", "run_sft", "teacher_forced_accuracy"]
