"""Longest-expected-first launch order, and the workload's per-prompt difficulty and replays."""
import copy
import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.trajectory import Trajectory, Turn
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.trainer.scheduling import LongestFirst, trajectory_timing
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, difficulty, make_tasks, sample_spec


def _traj(turns):
    """turns: (generated tokens, generate seconds, tool seconds) per turn."""
    out, pos = [], 0
    for i, (n, gen_s, tool_s) in enumerate(turns):
        out.append(Turn(i, pos, pos + n, pos + n, "length", gen_s, tool_s, int(tool_s > 0), 0))
        pos += n
    return Trajectory("t", "t", 0, 0, [0] * pos, [1] * pos, [0.0] * pos, turns=out)


def _task(i):
    return Task(task_id=f"p{i}", kind="workload", prompt="")


def test_duration_is_the_slowest_sample_priced_at_the_pace_of_later_turns():
    lf = LongestFirst(smoothing=1.0)
    # the first turn's 5 s include waiting for a slot: only the later turn sets the pace (0.01 s/token)
    slow_start = _traj([(10, 5.0, 0.3), (10, 0.1, 0.0)])
    assert trajectory_timing(slow_start) == (0.3, 20, 0.1, 10)
    lf.observe("p0", [slow_start, _traj([(40, 0.2, 0.0)])])
    assert lf.pace == pytest.approx(0.01)
    assert lf.durations["p0"] == pytest.approx(max(0.3 + 20 * 0.01, 40 * 0.01))
    # tool-bound: 2 s of tools outrank 100 tokens (1 s at this pace); decode-bound ranks by tokens
    lf.observe("p1", [_traj([(5, 0.05, 2.0), (5, 0.05, 0.0)])])
    lf.observe("p2", [_traj([(100, 1.0, 0.0), (1, 0.01, 0.0)])])
    assert lf.durations["p1"] > lf.durations["p2"] > lf.durations["p0"]
    tasks = [_task(0), _task(9), _task(2), _task(1), _task(8)]
    assert lf.order(tasks) == [1, 4, 3, 2, 0]  # unseen first (ties in given order), then longest
    assert lf.predict(_task(9)) == math.inf


def test_running_average_prior_and_state_round_trip():
    lf = LongestFirst(smoothing=0.5, expected_tokens=lambda task: {"p5": 300, "p6": 50}[task.task_id])
    assert lf.order([_task(6), _task(5)]) == [1, 0]  # no pace yet: the prior ranks by tokens alone
    lf.observe("p0", [_traj([(10, 0.1, 1.0), (10, 0.1, 0.0)])])   # pace 0.01, duration 1.2
    lf.observe("p0", [_traj([(10, 0.3, 0.0), (10, 0.3, 0.0)])])   # pace 0.02, duration 0.3
    assert lf.pace == pytest.approx(0.5 * 0.01 + 0.5 * 0.03)
    assert lf.durations["p0"] == pytest.approx(0.5 * 1.2 + 0.5 * 20 * lf.pace)
    assert lf.predict(_task(5)) == pytest.approx(300 * lf.pace)
    again = LongestFirst()
    again.load_state_dict(copy.deepcopy(lf.state_dict()))
    assert again.durations == lf.durations and again.pace == lf.pace
    with pytest.raises(ValueError, match="smoothing must be in"):
        LongestFirst(smoothing=0.0)


CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=128)
WL = WorkloadConfig(num_prompts=3, response_median=5, response_sigma=0.8, max_response=16,
                    tool_latency_median_s=0.01, tool_latency_sigma=0.5, max_turns=3)


@functools.lru_cache(maxsize=None)
def _mesh():
    return S.make_mesh(data=2, expert=4)


class _Recording:
    """Wraps an agent; records the prompt of each group in the order its rollouts start."""

    def __init__(self, agent):
        self.agent, self.started = agent, []

    async def __call__(self, engine, task, sample_index):
        if sample_index == 0:
            self.started.append(task.task_id)
        return await self.agent(engine, task, sample_index)


def _trainer(longest_first):
    tc = TrainerConfig(mode="sync", groups_per_step=3, group_size=4, max_slots=4, max_len=96,
                       buckets=(16, 32), seq_bucket=32, longest_first=longest_first)
    agent = _Recording(WorkloadAgent(WL))
    params = S.init_params(CFG, _mesh(), seed=0)
    tr = RLTrainer(CFG, params, tc, LossConfig(), OptimizerConfig(learning_rate=1e-4), agent,
                   TaskStream(make_tasks(WL), seed=3))
    return tr, agent


def test_groups_launch_longest_expected_first_and_sync_trains_in_draw_order():
    by_duration, plain = (_trainer(True), _trainer(False))
    for tr, _ in (by_duration, plain):
        tr.step()
    (tr, agent), (tr_plain, agent_plain) = by_duration, plain
    assert set(tr.longest_first.durations) == {"w0", "w1", "w2"} and tr.longest_first.pace > 0
    assert agent.agent.state_dict() == {"replays": {f"w{i}/{s}": 1 for i in range(3) for s in range(4)}}
    # set the predictions so that the longest-first order reverses the next step's draw order
    draws = copy.deepcopy(tr.tasks)
    drawn = [draws.next().task_id for _ in range(3)]
    tr.longest_first.durations = {task_id: float(i) for i, task_id in enumerate(drawn)}
    for t in (tr, tr_plain):
        t.step()
    assert agent.started[3:] == drawn[::-1] and agent_plain.started[3:] == drawn
    # sync sums the gradients in draw order, so the launch order leaves the update bitwise unchanged
    for a, b in zip(jax.tree.leaves(jax.device_get(tr.params)), jax.tree.leaves(jax.device_get(tr_plain.params))):
        np.testing.assert_array_equal(a, b)


def test_workload_difficulty_is_per_prompt_and_replays_draw_fresh_work():
    base = WorkloadConfig(num_prompts=8, turns_median=3.0, max_turns=8)
    assert difficulty(base, "w0") == 1.0
    hard = dataclasses.replace(base, difficulty_sigma=1.0, redraw_each_replay=True)
    factors = [difficulty(hard, f"w{i}") for i in range(8)]
    assert len(set(factors)) == 8 and min(factors) < 1.0 < max(factors)
    # replay 0 is the draw without redraws; later replays differ; without redraws they do not
    assert sample_spec(hard, "w1", 2, 0) == sample_spec(dataclasses.replace(base, difficulty_sigma=1.0), "w1", 2, 5)
    assert len({sample_spec(hard, "w1", 2, r) for r in range(4)}) > 1
    assert sample_spec(base, "w1", 2, 3) == sample_spec(base, "w1", 2, 0)
    # a fresh draw also samples fresh tokens: per-turn sampling seeds differ across replays
    seeds = [sample_spec(hard, "w1", 2, r).sampling_seeds for r in range(4)]
    assert all(len(x) == len(sample_spec(hard, "w1", 2, r).response_lens) for r, x in enumerate(seeds))
    assert len({x[0] for x in seeds}) == 4
    # a harder prompt's samples are longer on average (its medians are scaled)
    easy, tough = (min(range(8), key=lambda i: factors[i]), max(range(8), key=lambda i: factors[i]))
    work = lambda i: np.mean([sum(sample_spec(hard, f"w{i}", s, r).response_lens) for s in range(4) for r in range(4)])
    assert work(tough) > work(easy)
    with pytest.raises(ValueError, match="difficulty_sigma must be >= 0"):
        WorkloadConfig(difficulty_sigma=-1.0)

