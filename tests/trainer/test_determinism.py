"""What repeats bitwise and what does not (README, "Determinism").

- sync, same seed, same machine and device count: every step's rollouts and update are bitwise
  identical, because sync trains the groups in launch order whatever order they finished in.
- pipelined: the same trajectories are drawn and trained (every sample by the weights that drew
  it), but gradients are summed in the order groups finish, which follows tool latencies and
  thread timing; float addition is not associative, so the update equals sync's only to rounding
  (~1e-7 relative), and two pipelined runs may differ in the last bits.
- across device counts or CPU models, reductions split differently: results agree to rounding,
  not bitwise (so a recipe's outcome must not hinge on one float path: see the quickstart seeds
  benchmark).
"""
import functools

import jax
import numpy as np

import sfrrl_jax as S
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=128)
WL = WorkloadConfig(num_prompts=6, response_median=5, response_sigma=0.8, max_response=16,
                    tool_latency_median_s=0.02, tool_latency_sigma=0.5, max_turns=3)
KEYS = ("reward/mean", "rollout/generated_tokens", "train/trained_tokens")


@functools.lru_cache(maxsize=None)
def _mesh():  # one device: the cheapest mesh; test_rl_trainer compares the modes on 8
    return S.make_mesh(devices=jax.devices()[:1])


def _run(mode: str, steps: int):
    tc = TrainerConfig(mode=mode, groups_per_step=2, group_size=4, max_slots=8, max_len=96,
                       buckets=(16, 32), seq_bucket=32)
    trainer = RLTrainer(CFG, S.init_params(CFG, _mesh(), seed=0), tc, LossConfig(),
                        OptimizerConfig(learning_rate=1e-3), WorkloadAgent(WL), TaskStream(make_tasks(WL), seed=1))
    metrics = [trainer.step() for _ in range(steps)]
    return metrics, jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0]


def test_sync_is_bitwise_repeatable_and_pipelined_equals_it_to_rounding():
    sync_a, params_a = _run("sync", 2)
    sync_b, params_b = _run("sync", 2)
    for m_a, m_b in zip(sync_a, sync_b):
        assert {k: m_a[k] for k in KEYS} == {k: m_b[k] for k in KEYS}
    for (path, a), (_, b) in zip(params_a, params_b):
        np.testing.assert_array_equal(a, b, err_msg=f"sync is not bitwise repeatable at {path}")

    pipe, params_p = _run("pipelined", 2)
    # step 0 samples with the same initial weights: identical trajectories
    assert {k: pipe[0][k] for k in KEYS} == {k: sync_a[0][k] for k in KEYS}
    assert all(m["policy/on_policy_fraction"] == 1.0 for m in pipe + sync_a)
    init = jax.tree.leaves(jax.device_get(S.init_params(CFG, _mesh(), seed=0)))
    moved = 0.0
    for (path, a), (_, p), a0 in zip(params_a, params_p, init):
        np.testing.assert_allclose(p, a, rtol=1e-4, atol=1e-5, err_msg=str(path))
        moved = max(moved, float(np.abs(a - a0).max()))
    assert moved > 1e-4  # two real updates happened (lr 1e-3), far above the tolerance
