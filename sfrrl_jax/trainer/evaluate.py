"""Held-out evaluation: real agent rollouts through the real engine, scored by the environment.

`evaluate(...)` builds an `Engine` over `params` (no copy), rolls out every task once with
`agents.run_many` (greedy when `agent_cfg.temperature == 0`), frees the KV cache and returns the
success rate (share of reward >= 1), the mean reward and how the trajectories ended. Engines
built with the same (model_cfg, mesh, max_slots, max_len, buckets) share their compilations,
so evaluating with the trainer's engine settings costs no extra compile.
"""
from __future__ import annotations

import collections
import time
from typing import Sequence

import numpy as np

from sfrrl_jax.agents.loop import AgentConfig, run_many
from sfrrl_jax.agents.protocols import Environment, Task
from sfrrl_jax.agents.reward_fns import reward_component_means
from sfrrl_jax.aio import run_sync
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine import Engine


def evaluate(model_cfg: ModelConfig, params, env: Environment, tokenizer, tasks: Sequence[Task],
             agent_cfg: AgentConfig, max_slots: int = 16, max_len: int = 320,
             buckets: Sequence[int] | None = None, decode_steps: int = 4, samples_per_task: int = 1,
             return_trajectories: bool = False) -> dict:
    """Scores `tasks` -> {'success_rate', 'mean_reward', 'num_tasks', 'num_trajectories',
    'mean_generated_tokens', 'mean_tool_calls', 'tool_error_rate', 'finish/<reason>' (shares),
    'wall_s', 'reward/<name>' (each reward function's mean, as the trainer logs them)}
    (+ 'trajectories' with `return_trajectories`)."""
    if not tasks:
        raise ValueError("evaluate: no tasks")
    if agent_cfg.max_total_tokens > max_len:
        raise ValueError(f"evaluate: AgentConfig.max_total_tokens={agent_cfg.max_total_tokens} > engine "
                         f"max_len={max_len}; a trajectory could outgrow its KV cache slot")
    engine = Engine(model_cfg, params, max_slots=max_slots, max_len=max_len, buckets=buckets,
                    decode_steps=decode_steps)
    t0 = time.perf_counter()
    try:
        # run_sync, not asyncio.run: it does not wait at exit for a tool call abandoned at its
        # timeout (one that ignores cancellation), and it works inside a notebook's running loop
        trajs = run_sync(run_many(engine, env, list(tasks), tokenizer, agent_cfg,
                                  samples_per_task=samples_per_task, max_concurrency=max_slots))
    finally:
        engine.release_memory()
    wall = time.perf_counter() - t0
    rewards = np.array([t.reward for t in trajs], np.float64)
    calls = sum(t.num_tool_calls for t in trajs)
    finish = collections.Counter(t.finish_reason for t in trajs)
    out = {
        "success_rate": float(np.mean(rewards >= 1.0)),
        "mean_reward": float(rewards.mean()),
        "num_tasks": len(tasks),
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
