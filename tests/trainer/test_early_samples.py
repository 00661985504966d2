"""Early samples: the bookkeeping of which finished samples train before their group does, and
the trainer giving sync's update with them on."""
import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.early_samples import EarlySamples
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks


def _traj(reward):
    return Trajectory("g", "g", 0, 0, [], [], [], reward=reward)


def test_bookkeeping_caps_buffers_unqueues_finished_groups_and_refills():
    es = EarlySamples(max_groups=1, group_size=3)
    assert es.sample_finished(0, 2, _traj(1.0))         # group 0 takes the one buffer
    assert es.sample_finished(0, 0, _traj(0.25))
    assert not es.sample_finished(1, 0, _traj(0.5))     # no buffer left: group 1 waits
    assert es.buffers_held == 1 and len(es) == 2
    first = es.pop()
    assert (first.sample, first.centred_reward) == (2, 0.0)  # the first queued sample is the reference
    assert first.progress.claimed == [2] and len(es) == 1
    # group 0 completes: its queued sample 0 goes back to the group, its buffer slot to group 1
    assert not es.sample_finished(0, 1, _traj(0.0))     # the last sample never trains early
    prog = es.group_complete(0)
    assert prog is first.progress and prog.claimed == [2] and prog.reference == 2
    assert [(u.progress.launch_index, u.sample) for u in es.queue] == [(1, 0)] and es.buffers_held == 1
    assert es.sample_finished(1, 1, _traj(1.5))
    unit = es.queue[-1]
    assert unit.centred_reward == 1.0                    # 1.5 - reference 0.5
    # a group none of whose samples was claimed needs no merge; a discarded one frees its slot
    es.discard(1)
    assert len(es) == 0 and es.buffers_held == 0
    assert es.group_complete(7) is None
    off = EarlySamples(max_groups=0, group_size=3)
    assert not off.sample_finished(0, 0, _traj(1.0)) and len(off) == 0
    # before the tail nothing trains early; activate() queues the samples finished so far
    late = EarlySamples(max_groups=1, group_size=3, active=False)
    assert not late.sample_finished(4, 1, _traj(1.0)) and not late.sample_finished(4, 0, _traj(0.0))
    assert not late.sample_finished(5, 0, _traj(0.0)) and len(late) == 0
    assert late.activate() and not late.activate()
    assert [(u.progress.launch_index, u.sample, u.centred_reward) for u in late.queue] == [(4, 0, 0.0), (4, 1, 1.0)]
    assert late.buffers_held == 1  # group 5 waits for a free buffer


CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=128)
# Samples of a group differ in turns and tool latency, so they finish apart.
WL = WorkloadConfig(num_prompts=6, response_median=5, response_sigma=0.8, max_response=16,
                    tool_latency_median_s=0.02, tool_latency_sigma=1.0, max_turns=3)


def _trainer(mode, loss=LossConfig(), **kw):
    # max_len 64: the workload's longest trajectory here is 60 tokens, so nothing is cut, and the
    # train widths are 32 and 64 (each width is one compile per micro-step function)
    tc = TrainerConfig(mode=mode, groups_per_step=2, group_size=4, max_slots=8, max_len=64,
                       buckets=(16, 32), seq_bucket=32, **kw)
    params = S.init_params(CFG, S.make_mesh(data=2, expert=4), seed=0)
    return RLTrainer(CFG, params, tc, loss, OptimizerConfig(learning_rate=1e-4), WorkloadAgent(WL),
                     TaskStream(make_tasks(WL), seed=1))


def test_pipelined_with_early_samples_equals_sync():
    # sync trains one row per micro-step too, so both use the micro-steps compiled below
    sync = _trainer("sync", microbatch_rows=1)
    # underfull_slots=8: idle work runs before every decode chunk, so finished samples are
    # popped while their group is still decoding
    early = _trainer("pipelined", early_groups=2, underfull_slots=8, microbatch_rows=1)
    assert early.compile_train_shapes() == 2  # widths 32, 64 x one row
    m_sync = sync.step()  # the same TrainStep (shared per config): compiles `apply` too
    compiled = early.train_step.compile_count()
    m_early = early.step()
    assert early.train_step.compile_count() == compiled  # every shape the step formed was ready
    for k in ("reward/mean", "rollout/generated_tokens", "train/trained_tokens"):
        assert m_sync[k] == m_early[k], k
    assert m_early["train/early_microsteps"] > 0
    assert m_early["train/microsteps"] == 8  # one row each: every sample trained exactly once
    assert m_early["policy/on_policy_fraction"] == 1.0
    assert m_early["train/num_tokens"] == m_sync["train/num_tokens"]
    np.testing.assert_allclose(m_early["train/loss"], m_sync["train/loss"], rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(jax.device_get(sync.params)), jax.tree.leaves(jax.device_get(early.params))):
        np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-5)


def test_early_samples_need_pipelined_and_a_loss_linear_in_the_advantages():
    with pytest.raises(ValueError, match="only mode='pipelined'"):
        TrainerConfig(mode="one_step_off", early_groups=1)
    with pytest.raises(ValueError, match="behavior='current'"):
        _trainer("pipelined", loss=LossConfig(behavior="rollout"), early_groups=1)
