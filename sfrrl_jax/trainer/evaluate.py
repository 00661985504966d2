"""Held-out evaluation: real agent rollouts through the real engine, scored by the environment.

`evaluate(...)` builds an `Engine` over `params` (no copy), rolls out every task once with
`agents.run_many` (greedy when `agent_cfg.temperature == 0`), frees the KV cache and returns the
success rate (share of reward >= 1), the mean reward and how the trajectories ended. Engines
built with the same (model_cfg, mesh, max_slots, max_len, buckets) share their compilations,
so evaluating with the trainer's engine settings costs no extra compile.

`HeldOut(env, tokenizer, tasks, agent_cfg)` is a held-out set as a value (what `launch.runner`
evaluates during a run, `ExperimentConfig.eval_every`); `held_out.run(engine, params)` scores it
on an existing engine (the trainer's: no second KV cache, no extra compile), frees that engine's
KV cache after, and returns the same dict as `evaluate` plus 'examples': the first `EXAMPLES`
tasks' gold answer, final text (cut to 300 characters) and reward.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from sfrrl_jax.agents.loop import AgentConfig, run_many
from sfrrl_jax.agents.protocols import Environment, Task
from sfrrl_jax.agents.tasks.reward_fns import reward_component_means
from sfrrl_jax.aio import run_sync
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine import Engine

if TYPE_CHECKING:
    from sfrrl_jax.models.transformer import Params
    from sfrrl_jax.tokenizer.protocol import TokenizerProtocol

EXAMPLES = 4


def evaluate(model_cfg: ModelConfig, params: Params, env: Environment, tokenizer: TokenizerProtocol,
             tasks: Sequence[Task],
             agent_cfg: AgentConfig, max_slots: int = 16, max_len: int = 320,
             buckets: Sequence[int] | None = None, decode_steps: int = 4, samples_per_task: int = 1,
             return_trajectories: bool = False) -> dict:
    """Scores `tasks` with real agent rollouts through an `Engine` over `params` (module docstring).

    Args:
      model_cfg: the model config.
      params: the model's (sharded) params, a nested dict of `jax.Array` (not copied).
      env: the environment (tools and reward functions; a trajectory succeeds at reward >= 1).
      tokenizer: the model's tokenizer, with its chat template.
      tasks: the tasks to score (at least one).
      agent_cfg: the agent loop's settings (greedy when `agent_cfg.temperature == 0`).
      max_slots: the engine's slots, also the most trajectories rolled out at once.
      max_len: the engine's KV cache length per slot; at least `agent_cfg.max_total_tokens`.
      buckets: the engine's prompt bucket lengths (None: its default).
      decode_steps: tokens per decode chunk.
      samples_per_task: trajectories per task.
      return_trajectories: also return the scored trajectories.
    Returns:
      {'success_rate', 'mean_reward', 'num_tasks', 'num_trajectories', 'mean_generated_tokens',
      'mean_tool_calls', 'tool_error_rate', 'finish/<reason>' (shares), 'wall_s', 'reward/<name>' (each
      reward function's mean, as the trainer logs them)} (+ 'trajectories' with `return_trajectories`).
    Raises:
      ValueError: when `tasks` is empty, or `agent_cfg.max_total_tokens > max_len` (a trajectory could outgrow
        its KV cache slot).
    """
    if not tasks:
        raise ValueError("evaluate: no tasks")
    if agent_cfg.max_total_tokens > max_len:
        raise ValueError(f"evaluate: AgentConfig.max_total_tokens={agent_cfg.max_total_tokens} > engine "
                         f"max_len={max_len}; a trajectory could outgrow its KV cache slot")
    engine = Engine(model_cfg, params, max_slots=max_slots, max_len=max_len, buckets=buckets,
                    decode_steps=decode_steps)
    trajs, wall = _roll_out(engine, env, tokenizer, tasks, agent_cfg, samples_per_task, max_slots)
    return summarise(trajs, wall, len(tasks), return_trajectories)


def _roll_out(engine: Engine, env: Environment, tokenizer, tasks: Sequence[Task], agent_cfg: AgentConfig,
              samples_per_task: int, max_concurrency: int) -> tuple[list, float]:
    """Every task's trajectories on `engine` (task-major), and the wall seconds; frees its KV cache."""
    t0 = time.perf_counter()
    try:
        # run_sync, not asyncio.run: it does not wait at exit for a tool call abandoned at its
        # timeout (one that ignores cancellation), and it works inside a notebook's running loop
        trajs = run_sync(run_many(engine, env, list(tasks), tokenizer, agent_cfg,
                                  samples_per_task=samples_per_task, max_concurrency=max_concurrency))
    finally:
        engine.release_memory()
    return trajs, time.perf_counter() - t0


def summarise(trajs, wall: float, num_tasks: int, return_trajectories: bool = False) -> dict:
    """`evaluate`'s result dict from the scored trajectories of `num_tasks` tasks and the wall time."""
    rewards = np.array([t.reward for t in trajs], np.float64)
    calls = sum(t.num_tool_calls for t in trajs)
    finish = collections.Counter(t.finish_reason for t in trajs)
    out = {
        "success_rate": float(np.mean(rewards >= 1.0)),
        "mean_reward": float(rewards.mean()),
        "num_tasks": num_tasks,
        "num_trajectories": len(trajs),
        "mean_generated_tokens": float(np.mean([t.num_generated for t in trajs])),
        "mean_tool_calls": calls / len(trajs),
        "tool_error_rate": sum(t.num_tool_errors for t in trajs) / calls if calls else 0.0,
        **{f"finish/{k}": v / len(trajs) for k, v in sorted(finish.items())},
        **reward_component_means(trajs),
        "wall_s": wall,
    }
    if return_trajectories:
        out["trajectories"] = trajs
    return out


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """A held-out task set and how to score it: greedy when `agent_cfg.temperature == 0`.

    env: the environment (reward functions; a trajectory succeeds at reward >= 1); tokenizer: the
    model's, with its chat template; tasks: the held-out tasks (none of them a training prompt:
    the builder checks, e.g. `launch.agentic.AgenticRollout`); agent_cfg: the agent's limits and
    sampling; samples_per_task: trajectories per task (> 1 only when sampling).
    """

    env: Environment
    tokenizer: object
    tasks: Sequence[Task]
    agent_cfg: AgentConfig
    samples_per_task: int = 1

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("HeldOut: no tasks")
        if not isinstance(self.agent_cfg, AgentConfig):
            raise TypeError(f"HeldOut.agent_cfg must be an AgentConfig, got {type(self.agent_cfg).__name__}")
        if isinstance(self.samples_per_task, bool) or not isinstance(self.samples_per_task, int) \
                or self.samples_per_task < 1:
            raise ValueError(f"HeldOut.samples_per_task must be an int >= 1, got {self.samples_per_task!r}")

    def run(self, engine: Engine, params, max_concurrency: int | None = None) -> dict:
        """Scores the set on `engine` with `params` (set on it first); frees its KV cache after.
        Returns `evaluate`'s dict. The engine must be idle (no request in flight)."""
        if self.agent_cfg.max_total_tokens > engine.steps.max_len:
            raise ValueError(f"HeldOut: AgentConfig.max_total_tokens={self.agent_cfg.max_total_tokens} > engine "
                             f"max_len={engine.steps.max_len}")
        engine.set_params(params)
        trajs, wall = _roll_out(engine, self.env, self.tokenizer, self.tasks, self.agent_cfg, self.samples_per_task,
                                max_concurrency or engine.steps.max_slots)
        out = summarise(trajs, wall, len(self.tasks))
        # what the scores are of: a few answers as the verifier saw them
        out["examples"] = [{"task_id": t.task_id, "gold": task.answer, "final_text": t.final_text[:300],
                            "reward": t.reward}
                           for task, t in zip(self.tasks, trajs[::self.samples_per_task][:EXAMPLES])]
        return out
