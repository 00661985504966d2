"""The `RLTrainer` rollout function for real agent loops: `AgentRollout(env, tokenizer, agent_cfg)`.

    rollout = AgentRollout(calculator_environment(), tokenizer, AgentConfig(temperature=1.0))
    trainer = RLTrainer(model_cfg, params, trainer_cfg, loss_cfg, opt_cfg, rollout, TaskStream(tasks))

`await rollout(engine, task, sample_index)` runs `agents.run_agent` (multi-turn, tools on the
event loop, the slot's KV cache continued between turns) and returns its `Trajectory` with the
environment's reward set (for a `ToolEnvironment`, the weighted sum of its reward functions, each
component in `traj.metadata["rewards"]`; `agents.reward_component_means(trajs)` gives the
`reward/<name>` metrics of a batch). Sampling seeds differ per sample index (the G samples of a group are
distinct draws) *and* per visit: the k-th rollout of the same (task, sample index) uses the
agent seed folded with k, so a prompt seen again in a later epoch is sampled afresh, while a rerun
of the whole training (same order of calls) reproduces every draw.

Whatever the environment, its tools or its reward functions raise in one sample (SystemExit and
KeyboardInterrupt included: see `sfrrl_jax.aio`) is that sample's: a tool's is an error observation,
the rest a failed trajectory (`Trajectory.error`), counted in `rollout/failed_samples` (what the
environment raises before the trajectory has a prompt is raised as an Exception, which fails the
group as any rollout function's error does). Each
trajectory's metadata holds `tool_errors` and `orphaned_tool_calls` (tool calls and environment
steps abandoned still running at their timeout or the wall budget: see `agents.tools`).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib

from sfrrl_jax.agents.loop import AgentConfig, run_agent
from sfrrl_jax.agents.protocols import Environment, Task
from sfrrl_jax.agents.trajectory import Trajectory


def visit_seed(seed: int, visit: int) -> int:
    """The agent seed of the `visit`-th rollout of a (task, sample) pair (visit 0 keeps `seed`)."""
    if visit == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/visit/{visit}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


class AgentRollout:
    """`async (engine, task, sample_index) -> Trajectory` around `run_agent` (see the module doc)."""

    def __init__(self, env: Environment, tokenizer, agent_cfg: AgentConfig):
        if not isinstance(agent_cfg, AgentConfig):
            raise TypeError(f"AgentRollout: agent_cfg must be an AgentConfig, got {type(agent_cfg).__name__}")
        self.env, self.tokenizer, self.agent_cfg = env, tokenizer, agent_cfg
        self.visits: collections.Counter = collections.Counter()

    @property
    def max_total_tokens(self) -> int:
        """The token budget of one trajectory (`RolloutFn`'s optional declaration: RLTrainer checks
        it is <= TrainerConfig.max_len)."""
        return self.agent_cfg.max_total_tokens

    def config_for(self, task: Task, sample_index: int) -> AgentConfig:
        """The AgentConfig of the next rollout of (task, sample_index); counts the visit."""
        if sample_index < 0:
            raise ValueError(f"AgentRollout: sample_index must be >= 0, got {sample_index}")
        key = (task.task_id, sample_index)
        visit = self.visits[key]
        self.visits[key] += 1
        return dataclasses.replace(self.agent_cfg, seed=visit_seed(self.agent_cfg.seed, visit))

    def state_dict(self) -> dict:
        """The visit counts (checkpointed: a resumed run draws the seeds an unbroken one would)."""
        return {"visits": [[task_id, sample, n] for (task_id, sample), n in sorted(self.visits.items())]}

    def load_state_dict(self, state: dict) -> None:
        self.visits = collections.Counter({(str(t), int(s)): int(n) for t, s, n in state["visits"]})

    def visited_elsewhere(self, task: Task, sample_index: int) -> None:
        """Counts a rollout of (task, sample_index) that another process ran (multi-host: each
        process counts every visit, so the k-th visit's seed is the same whichever runs it)."""
        self.config_for(task, sample_index)

    async def __call__(self, engine, task: Task, sample_index: int) -> Trajectory:
        cfg = self.config_for(task, sample_index)
        traj = await run_agent(engine, self.env, task, self.tokenizer, cfg, sample_index=sample_index,
                               group_id=task.task_id)
        traj.metadata["tool_errors"] = traj.num_tool_errors
        traj.metadata.setdefault("orphaned_tool_calls", 0)
        traj.metadata["agent_seed"] = cfg.seed
        return traj
