"""Where a run's trajectories come from: the value an `ExperimentConfig.rollout` factory returns.

A factory is any callable `factory(experiment_cfg, model_cfg) -> RolloutSource`, optionally with a
`validate(experiment_cfg, model_cfg)` method that checks the configs fit together before anything is
allocated. The runner ships none of its own: `launch.agentic.AgenticRollout` rolls a task set out
through the agent loop, and `testing.workload.WorkloadRollout` replays the seeded long-tail workload
the straggler benches use.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.trainer.evaluate import HeldOut
from sfrrl_jax.trainer.rollout_fn import RolloutFn


@dataclasses.dataclass(frozen=True)
class RolloutSource:
    """Where trajectories come from: `await rollout_fn(engine, task, sample_index) -> Trajectory`.

    Attributes:
      rollout_fn: the coroutine function that rolls one sample of one task out on the engine.
      tasks: the prompts the TaskStream cycles through (seeded permutation per epoch).
      expected_length: optional `fn(task) -> tokens` for longest-first scheduling of unseen prompts.
      stateful: optional object with `state_dict()` / `load_state_dict(d)` (JSON-exact) saved in
        checkpoints.
      held_out: optional `trainer.evaluate.HeldOut`, evaluated before, during (`eval_every`) and
        after the run (`launch.held_out_runs`).
    """

    rollout_fn: RolloutFn
    tasks: Sequence[Task]
    expected_length: Callable[[Task], float] | None = None
    stateful: Any = None
    held_out: HeldOut | None = None


# factory(experiment_cfg: launch.runner.ExperimentConfig, model_cfg) -> RolloutSource
RolloutFactory = Callable[[Any, ModelConfig], RolloutSource]
