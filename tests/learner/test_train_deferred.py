"""Advantage-deferred gradients: samples trained before their group's advantages exist add up to
the same accumulator as training them with their final advantages, once the group buffer is
merged (float32 summation order aside)."""
import functools

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.rl.config import AdvantageConfig, LossConfig
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.batching import Group, group_advantage_slopes, group_advantages

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=64)
G, T = 4, 32


@functools.lru_cache(maxsize=None)
def _params():
    return S.init_params(CFG, S.make_mesh(data=2, expert=4), seed=0)


def _rows(rewards, adv_cfg):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, CFG.vocab_size, (G, T)).astype(np.int32)
    mask = np.zeros((G, T), np.float32)
    for i in range(G):
        mask[i, 6:12 + 3 * i] = 1.0  # different lengths: the aggregation must weigh them right
    group = Group("g", [Trajectory("g", "g", i, 0, [], [], [], reward=float(r)) for i, r in enumerate(rewards)], 0)
    adv = group_advantages([group], adv_cfg)[0]
    slope = float(group_advantage_slopes([group], adv_cfg)[0])
    batch = {"tokens": tokens, "loss_mask": mask, "advantages": adv[:, None] * mask,
             "rollout_logprobs": rng.normal(size=(G, T)).astype(np.float32) * 0.1,
             "segment_ids": np.ones((G, T), np.int32)}
    return batch, adv, slope


@pytest.mark.parametrize("loss_cfg,adv_cfg,rewards", [
    (LossConfig(), AdvantageConfig("grpo"), [1.0, 0.0, 0.5, 1.0]),
    (LossConfig(), AdvantageConfig("grpo"), [1.0, 1.0, 1.0, 1.0]),  # all equal: every advantage 0
    (LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01, router_aux_coef=0.1,
                policy_loss="gspo"), AdvantageConfig("rloo"), [0.2, 0.9, 0.0, 0.4]),
    (LossConfig(aggregation="seq_mean_token_sum", is_correction="tis"), AdvantageConfig("dr_grpo"),
     [0.0, 0.0, 1.0, 0.0]),
])
def test_early_samples_merged_at_final_advantages_equal_the_whole_group(loss_cfg, adv_cfg, rewards):
    params = _params()
    ts = make_train_step(CFG, loss_cfg, OptimizerConfig(learning_rate=1e-3))
    rewards = np.asarray(rewards, np.float32)
    batch, adv, slope = _rows(rewards, adv_cfg)
    # reference: the same rows, each in its own micro-step (router losses are per-forward means, so
    # the split matters for them), all trained with their final advantages
    whole = ts.init_accumulator(params)
    for i in (2, 0, 3, 1):
        whole = ts.grad_microstep(params, whole, {k: v[i:i + 1] for k, v in batch.items()})

    # samples 2, 0, 3 finish first and train into the buffer, centred on sample 2's reward;
    # sample 1 finishes last and trains with its final advantage, then the buffer is merged
    buf, ref = ts.init_deferred(params), 2
    for i in (2, 0, 3):
        buf = ts.deferred_microstep(params, buf, {k: v[i:i + 1] for k, v in batch.items()},
                                    rewards[i] - rewards[ref])
    split = ts.grad_microstep(params, ts.init_accumulator(params), {k: v[1:2] for k, v in batch.items()})
    split = ts.merge_deferred(params, split, buf, slope, adv[ref])

    whole, split = jax.device_get(whole), jax.device_get(split)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(whole["grads"]))
    if np.ptp(rewards) == 0:  # every advantage is exactly 0, in the merge too (no cancellation)
        assert scale == 0 and all(np.all(g == 0) for g in jax.tree.leaves(split["grads"]))
    else:
        assert scale > 0
    for path, a in jax.tree_util.tree_flatten_with_path(whole["grads"])[0]:
        b = dict(jax.tree_util.tree_flatten_with_path(split["grads"])[0])[path]
        np.testing.assert_allclose(b, a, atol=2e-6 * scale, rtol=1e-5, err_msg=str(path))
    for k in ("denominator", "num_tokens", "num_seqs"):
        assert split["scalars"][k] == whole["scalars"][k], k
    assert split["scalars"]["num_microbatches"] == whole["scalars"]["num_microbatches"] == 4
    np.testing.assert_allclose(split["scalars"]["numerator"], whole["scalars"]["numerator"], atol=1e-5, rtol=1e-5)
    for k in whole["sums"]:
        np.testing.assert_allclose(split["sums"][k], whole["sums"][k], atol=1e-4, rtol=1e-5, err_msg=k)
    for kind in ("maxes", "mins"):
        for k in whole[kind]:
            assert split[kind][k] == whole[kind][k], k
    if np.ptp(rewards) == 0:
        assert np.all(adv == 0) and float(split["sums"]["agg/pg_loss"]) == 0.0


def test_deferral_refuses_a_loss_that_is_not_linear_in_the_advantages():
    ts = make_train_step(CFG, LossConfig(behavior="rollout"), OptimizerConfig())
    with pytest.raises(ValueError, match="behavior='current'"):
        ts.init_deferred(_params())
    with pytest.raises(ValueError, match="not a per-group affine function"):
        group_advantage_slopes([Group("g", [Trajectory("g", "g", 0, 0, [], [], [], reward=1.0)], 0)],
                               AdvantageConfig("reinforce_pp"))


def test_advantage_slopes_match_the_estimators():
    rng = np.random.RandomState(1)
    for g_size in (1, 2, 5):
        rewards = rng.rand(3, g_size).astype(np.float32)
        groups = [Group(f"g{i}", [Trajectory("g", "g", j, 0, [], [], [], reward=float(r)) for j, r in enumerate(row)], 0)
                  for i, row in enumerate(rewards)]
        for est in ("grpo", "dr_grpo", "rloo"):
            for ddof in (0, 1):
                cfg = AdvantageConfig(estimator=est, std_ddof=ddof)
                adv, slope = group_advantages(groups, cfg), group_advantage_slopes(groups, cfg)
                # A_i = slope * (r_i - r_0) + A_0 within each group
                np.testing.assert_allclose(slope[:, None] * (rewards - rewards[:, :1]) + adv[:, :1], adv,
                                           rtol=1e-5, atol=1e-5)
