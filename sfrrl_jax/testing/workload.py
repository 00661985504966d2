"""A seeded long-tail agentic workload, replayed through the real engine and real tools.

Each (prompt, sample) has a drawn number of turns and per-turn response lengths (log-normal:
a heavy tail, p99 >= 10x median), and each tool call a drawn latency (log-normal). A prompt may
have a difficulty (a log-normal factor on its medians, shared by its samples and replays), and a
prompt's later rollouts may draw fresh work around it (`redraw_each_replay`): the earlier groups
of a prompt then predict its next ones as they would in a real run, roughly. The policy's
tokens are really decoded by the engine (`max_new_tokens` = the drawn length, no stop token),
tool calls really go through a `ToolRunner` (timeouts, errors), and observations are appended
to the parked slot. Work that would overflow the engine's context is cut there
(finish_reason 'max_tokens'), the same way in every mode. Only *what* is said is scripted, so every mode replays the same work.

The reward is a pure function of the generated tokens (the share of even token ids), so it
depends on the policy and training moves it; a trajectory with a failed tool call gets 0.

A run uses it as its rollout: `ExperimentConfig(rollout=WorkloadRollout(WorkloadConfig(...)))`, in gin
`import sfrrl_jax.testing.workload` then `ExperimentConfig.rollout = @WorkloadRollout()` and
`WorkloadRollout.workload = @WorkloadConfig()` (importing this module registers both with gin).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time

import gin
import numpy as np

from sfrrl_jax.agents.protocols import GenerationRequest, Task, ToolCall
from sfrrl_jax.agents.ray_tools import tool_runner
from sfrrl_jax.agents.tools import ToolRunner, ToolRunnerConfig
from sfrrl_jax.checks import (check_bool_fields, check_int_fields, check_number, check_number_fields, check_seed,
                              check_str)
from sfrrl_jax.agents.trajectory import Trajectory, TrajectoryBuilder, Turn
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.trainer.rollout_source import RolloutSource


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """Distributions of the replayed work (medians and log-normal sigmas)."""

    num_prompts: int = 64
    prompt_len: int = 12
    turns_median: float = 2.0
    turns_sigma: float = 0.6
    max_turns: int = 6
    response_median: float = 8.0
    response_sigma: float = 1.0
    max_response: int = 96
    tool_latency_median_s: float = 0.05
    tool_latency_sigma: float = 1.0
    max_tool_latency_s: float = 5.0
    observation_len: int = 6
    vocab_size: int = 512
    seed: int = 0
    tool_name: str = "latency_tool"
    difficulty_sigma: float = 0.0     # per-prompt factor on the turn, response and latency medians
    shared_prefix_len: int = 0        # leading prompt tokens every prompt shares (a system prompt, tool schemas)
    redraw_each_replay: bool = False  # a (prompt, sample)'s n-th rollout draws its own work

    def __post_init__(self):
        own = "WorkloadConfig"
        check_int_fields(self, ("num_prompts", "prompt_len", "max_turns", "max_response", "observation_len"), 1)
        # Token ids are drawn from [3, vocab_size) (0-2 are left to special tokens).
        check_int_fields(self, ("vocab_size",), 4)
        check_int_fields(self, ("shared_prefix_len",), 0)
        if self.shared_prefix_len > self.prompt_len:
            raise ValueError(f"{own}.shared_prefix_len={self.shared_prefix_len} > prompt_len={self.prompt_len}")
        check_seed(f"{own}.seed", self.seed)
        # The medians go through log(): a negative one gives nan draws (nan tool latencies that
        # sleep for nothing or forever, nan lengths), zero gives -inf; so they must be > 0.
        # A run without tool waits sets max_tool_latency_s = 0 (every latency is clipped to it).
        check_number_fields(self, ("turns_median", "response_median", "tool_latency_median_s"), 0, lo_open=True)
        check_number_fields(self, ("turns_sigma", "response_sigma", "tool_latency_sigma", "difficulty_sigma"), 0)
        check_number(f"{own}.max_tool_latency_s", self.max_tool_latency_s, 0)
        check_str(f"{own}.tool_name", self.tool_name)
        check_bool_fields(self, ("redraw_each_replay",))


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    response_lens: tuple[int, ...]   # one per turn
    tool_latencies: tuple[float, ...]  # one per turn but the last
    sampling_seeds: tuple[int, ...]  # the engine's token-sampling seed, one per turn


def _hash(*keys, digest_size: int = 8) -> int:
    """A stable integer of the keys (the same in every process, unlike `hash`)."""
    digest = hashlib.blake2b("/".join(map(str, keys)).encode(), digest_size=digest_size).digest()
    return int.from_bytes(digest, "little")


def _rng(*keys) -> np.random.Generator:
    return np.random.default_rng(_hash(*keys))


def difficulty(cfg: WorkloadConfig, task_id: str) -> float:
    """The prompt's factor on the turn, response and latency medians (1 when difficulty_sigma=0)."""
    if not cfg.difficulty_sigma:
        return 1.0
    return float(_rng(cfg.seed, "difficulty", task_id).lognormal(0.0, cfg.difficulty_sigma))


def sample_spec(cfg: WorkloadConfig, task_id: str, sample_index: int, replay: int = 0) -> SampleSpec:
    """The (seeded) work of one trajectory; a pure function of (cfg.seed, task, sample, replay).

    replay: how many times this (task, sample) was rolled out before; it changes the draw only
    with `redraw_each_replay`."""
    replay = replay if cfg.redraw_each_replay else 0
    r = _rng(cfg.seed, task_id, sample_index) if replay == 0 else _rng(cfg.seed, task_id, sample_index, replay)
    d = difficulty(cfg, task_id)
    turns = int(np.clip(np.round(r.lognormal(np.log(cfg.turns_median * d), cfg.turns_sigma)), 1, cfg.max_turns))
    lens = np.clip(np.round(r.lognormal(np.log(cfg.response_median * d), cfg.response_sigma, turns)), 1,
                   cfg.max_response).astype(int)
    lat = np.clip(r.lognormal(np.log(cfg.tool_latency_median_s * d), cfg.tool_latency_sigma, turns - 1), 0,
                  cfg.max_tool_latency_s)
    # a fresh draw samples fresh tokens too; replay 0 keeps the key of a workload without redraws
    key = (cfg.seed, task_id, sample_index) + ((replay,) if replay else ())
    seeds = tuple(_hash(*key, turn, digest_size=4) for turn in range(turns))
    return SampleSpec(tuple(int(x) for x in lens), tuple(float(x) for x in lat), seeds)


def make_tasks(cfg: WorkloadConfig) -> list[Task]:
    """The prompts: random token ids (the workload needs no text), the first `shared_prefix_len`
    the same in every prompt."""
    out = []
    head = _rng(cfg.seed, "shared_prefix", 0).integers(3, cfg.vocab_size, cfg.shared_prefix_len).tolist()
    for i in range(cfg.num_prompts):
        r = _rng(cfg.seed, "prompt", i)
        prompt = head + r.integers(3, cfg.vocab_size, cfg.prompt_len - cfg.shared_prefix_len).tolist()
        out.append(Task(task_id=f"w{i}", kind="workload", prompt="", metadata={"prompt_tokens": prompt}))
    return out


def even_token_reward(generated: list[int]) -> float:
    return float(np.mean([t % 2 == 0 for t in generated])) if generated else 0.0


class LatencyTool:
    """An async tool that only waits: `latency_tool(latency=seconds) -> "ok <seconds>"`."""

    description = "waits `latency` seconds"
    parameters = {"type": "object", "properties": {"latency": {"type": "number"}}, "required": ["latency"]}

    def __init__(self, name: str = "latency_tool"):
        self.name = name

    async def __call__(self, latency: float) -> str:
        await asyncio.sleep(latency)
        return f"ok {latency:.3f}"


class WorkloadAgent:
    """`await agent(engine, task, sample_index) -> Trajectory`, replaying the seeded work.

    Counts the rollouts of each (task, sample) (the replay index of `sample_spec`); the count is
    its state (`state_dict`), saved in checkpoints so that a resumed run replays the same work."""

    def __init__(self, cfg: WorkloadConfig, runner: ToolRunner | None = None, temperature: float = 1.0,
                 tools: ToolRunnerConfig = ToolRunnerConfig()):
        self.cfg = cfg
        # `tools`: where the latency tool's calls run when no runner is given (backend 'ray': a pool of actors)
        self.runner = runner or tool_runner([LatencyTool(cfg.tool_name)], tools)
        self.temperature = temperature
        self.replays: dict[str, int] = {}  # "task/sample" -> rollouts started

    def state_dict(self) -> dict:
        return {"replays": dict(self.replays)}

    def load_state_dict(self, state: dict) -> None:
        self.replays = {str(k): int(v) for k, v in state["replays"].items()}

    def _observation(self, content: str) -> list[int]:
        data = content.encode()[: self.cfg.observation_len].ljust(self.cfg.observation_len, b" ")
        return [3 + b % (self.cfg.vocab_size - 3) for b in data]

    def visited_elsewhere(self, task: Task, sample_index: int) -> None:
        """A rollout another process ran (multi-host): counted, so replay indices stay global."""
        key = f"{task.task_id}/{sample_index}"
        self.replays[key] = self.replays.get(key, 0) + 1

    async def __call__(self, engine, task: Task, sample_index: int) -> Trajectory:
        key = f"{task.task_id}/{sample_index}"
        replay = self.replays.get(key, 0)
        self.replays[key] = replay + 1
        spec = sample_spec(self.cfg, task.task_id, sample_index, replay)
        prompt = list(task.metadata["prompt_tokens"])
        builder = TrajectoryBuilder(task.task_id, task.task_id, sample_index, prompt)
        traj = builder.trajectory
        start, handle, pending, errors, generated = time.perf_counter(), None, prompt, 0, []
        limit = engine.steps.max_len - 1  # the context: a drawn length that overflows it is cut
        traj.finish_reason = "answer"
        try:
            for turn, drawn in enumerate(spec.response_lens):
                n = min(drawn, limit - len(builder))
                if n <= 0:
                    traj.finish_reason = "max_tokens"
                    break
                t0 = time.perf_counter()
                c = await engine.complete(GenerationRequest(
                    tokens=pending, max_new_tokens=n, temperature=self.temperature, seed=spec.sampling_seeds[turn],
                    slot_handle=handle))
                handle = c.slot_handle
                gen_start, gen_end = builder.append_completion(c)
                generated += c.tokens
                t1 = time.perf_counter()
                obs_end, n_err, n_calls = gen_end, 0, 0
                if n < drawn or (turn + 1 < len(spec.response_lens)
                                 and len(builder) + self.cfg.observation_len >= limit):
                    traj.finish_reason = "max_tokens"  # cut, or no room for the tool's answer and a reply
                elif turn + 1 < len(spec.response_lens):
                    call = ToolCall(self.cfg.tool_name, {"latency": spec.tool_latencies[turn]}, f"c{turn}")
                    (result,) = await self.runner.run([call])
                    n_calls, n_err = 1, int(result.is_error)
                    if result.queue_s > 0.0:
                        traj.metadata.setdefault("tool_queue_s", []).append(result.queue_s)
                    pending = self._observation(result.content)
                    obs_end = builder.append_observation(pending)
                errors += n_err
                traj.turns.append(Turn(turn, gen_start, gen_end, obs_end, c.finish_reason, t1 - t0,
                                       time.perf_counter() - t1, n_calls, n_err))
                if traj.finish_reason == "max_tokens":
                    break
        finally:
            await engine.release(handle)
        traj.wall_s = time.perf_counter() - start
        traj.reward = 0.0 if errors else even_token_reward(generated)
        traj.metadata["tool_errors"] = errors
        return traj


@dataclasses.dataclass(frozen=True)
class WorkloadRollout:
    """`ExperimentConfig.rollout` factory of the synthetic workload: `factory(experiment_cfg, model_cfg)`
    returns a `RolloutSource` of `make_tasks(workload)` rolled out by a `WorkloadAgent` (its replay
    counts are the source's checkpointed state).

    Attributes:
      workload: the distributions of the replayed work.
      tools: how its tool calls run (`ToolRunnerConfig`; backend 'ray' puts them on a Ray cluster).
    """

    workload: WorkloadConfig = WorkloadConfig()
    tools: ToolRunnerConfig = ToolRunnerConfig()

    def __post_init__(self):
        if not isinstance(self.workload, WorkloadConfig):
            raise TypeError(f"WorkloadRollout.workload must be a WorkloadConfig, got {type(self.workload).__name__}")

    def validate(self, experiment_cfg, model_cfg: ModelConfig) -> None:
        """Raises ValueError if the workload emits token ids the model lacks, or its longest trajectory
        exceeds `experiment_cfg.trainer.max_len`."""
        w = self.workload
        if w.vocab_size > model_cfg.vocab_size:
            raise ValueError(f"WorkloadConfig.vocab_size={w.vocab_size} > ModelConfig.vocab_size="
                             f"{model_cfg.vocab_size}: the workload would emit ids the model lacks")
        longest = w.prompt_len + w.max_turns * w.max_response + (w.max_turns - 1) * w.observation_len
        if longest > experiment_cfg.trainer.max_len:
            raise ValueError(f"the longest workload trajectory (WorkloadConfig prompt_len + max_turns x "
                             f"max_response + observations = {longest} tokens) exceeds "
                             f"TrainerConfig.max_len={experiment_cfg.trainer.max_len}")

    def __call__(self, experiment_cfg, model_cfg: ModelConfig) -> RolloutSource:
        """The run's rollout source (see the class doc); `validate` is the runner's to call first."""
        agent = WorkloadAgent(self.workload, tools=self.tools)
        return RolloutSource(agent, make_tasks(self.workload), stateful=agent)


# A gin file that imports this module may bind both (registering again is harmless).
for _cls in (WorkloadConfig, WorkloadRollout):
    gin.external_configurable(_cls, module="sfrrl")
