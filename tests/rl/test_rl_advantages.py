"""Advantage estimators against hand-computed values, incl. G=1 and all-equal groups."""
import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from sfrrl_jax.rl import (
    AdvantageConfig, broadcast_to_tokens, compute_advantages, dr_grpo_advantages, grpo_advantages,
    kl_shaped_rewards, reinforce_pp_advantages, reinforce_pp_token_advantages, rloo_advantages,
)

S = math.sqrt(2.0 / 3.0)  # population std of (1, 2, 3)


def test_grpo_hand_values():
    r = jnp.array([[1.0, 2.0, 3.0], [1.0, 0.0, 0.0]])
    chex.assert_trees_all_close(grpo_advantages(r, eps=0.0),
                                jnp.array([[-1 / S, 0.0, 1 / S], [2 / math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]]),
                                rtol=1e-6)
    # unbiased std of (1, 2, 3) is 1
    chex.assert_trees_all_close(grpo_advantages(r[:1], eps=0.0, std_ddof=1), jnp.array([[-1.0, 0.0, 1.0]]), rtol=1e-6)


def test_dr_grpo_and_rloo_hand_values():
    r = jnp.array([[1.0, 2.0, 3.0]])
    chex.assert_trees_all_close(dr_grpo_advantages(r), jnp.array([[-1.0, 0.0, 1.0]]))
    # r_i - mean of the others: 1 - 2.5, 2 - 2, 3 - 1.5
    chex.assert_trees_all_close(rloo_advantages(r), jnp.array([[-1.5, 0.0, 1.5]]), rtol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_no_contrast_groups_give_zero(estimator, ddof):
    single = jnp.array([[3.0], [-1.0]])          # G = 1
    equal = jnp.array([[2.0, 2.0, 2.0, 2.0]])    # all-equal rewards
    cfg = AdvantageConfig(estimator=estimator, std_ddof=ddof)
    for r in (single, equal):
        a = compute_advantages(r, cfg)
        assert np.all(np.isfinite(a))
        chex.assert_trees_all_equal(a, jnp.zeros_like(r))


def test_reinforce_pp_batch_whitening_with_mask():
    r = jnp.array([[1.0, 2.0], [3.0, 6.0]])
    std = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + 0 + (6 - 3) ** 2) / 4)
    chex.assert_trees_all_close(reinforce_pp_advantages(r, eps=0.0),
                                (r - 3.0) / std, rtol=1e-6)
    mask = jnp.array([[1, 1], [1, 0]])
    chex.assert_trees_all_close(reinforce_pp_advantages(r, mask, eps=0.0),
                                jnp.array([[-1 / S, 0.0], [1 / S, 0.0]]), rtol=1e-6)
    # baseline variant: group-centred (-.5, .5, -1.5, 1.5), batch std sqrt(1.25)
    chex.assert_trees_all_close(
        compute_advantages(r, AdvantageConfig("reinforce_pp_baseline", eps=0.0)),
        jnp.array([[-0.5, 0.5], [-1.5, 1.5]]) / math.sqrt(1.25), rtol=1e-6)


def test_reinforce_pp_all_equal_is_zero():
    r = jnp.full((2, 3), 5.0)
    chex.assert_trees_all_equal(compute_advantages(r, AdvantageConfig("reinforce_pp")), jnp.zeros_like(r))


def test_broadcast_to_tokens():
    adv = jnp.array([[2.0, -1.0]])  # [groups=1, G=2]
    mask = jnp.array([[0, 1, 1], [1, 1, 0]], jnp.float32)
    chex.assert_trees_all_equal(broadcast_to_tokens(adv, mask), jnp.array([[0.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]))
    with pytest.raises(ValueError, match="advantages"):
        broadcast_to_tokens(jnp.ones((3,)), mask)


def test_kl_shaped_rewards_k1_and_k3():
    logp = jnp.array([[-1.0, -2.0, -5.0]])
    ref = jnp.array([[-1.5, -1.0, -0.1]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    # k1: (0.5) + (-1.0) = -0.5 -> 1 - 0.1 * (-0.5)
    chex.assert_trees_all_close(kl_shaped_rewards(jnp.array([1.0]), logp, ref, mask, 0.1, "k1"),
                                jnp.array([1.05]), rtol=1e-6)
    k3 = (math.exp(-0.5) - 1 + 0.5) + (math.exp(1.0) - 1 - 1.0)
    chex.assert_trees_all_close(kl_shaped_rewards(jnp.array([1.0]), logp, ref, mask, 0.1, "k3"),
                                jnp.array([1.0 - 0.1 * k3]), rtol=1e-6)


def test_reinforce_pp_token_returns():
    rewards = jnp.array([1.0, 0.0])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
    kl = jnp.array([[0.1, 0.2, 0.3], [0.1, 0.1, 0.1]])
    # returns-to-go over loss tokens: row0 (1-.3, 1-.2), row1 (-.3, -.2, -.1)
    vals = np.array([0.7, 0.8, -0.3, -0.2, -0.1])
    white = (vals - vals.mean()) / vals.std()
    expected = jnp.array([[white[0], white[1], 0.0], [white[2], white[3], white[4]]])
    chex.assert_trees_all_close(reinforce_pp_token_advantages(rewards, mask, kl, 1.0, eps=0.0),
                                expected, rtol=1e-5, atol=1e-6)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"\[groups, G\]"):
        grpo_advantages(jnp.ones((4,)))
    with pytest.raises(ValueError, match="AdvantageConfig.estimator"):
        AdvantageConfig(estimator="ppo")


@pytest.mark.parametrize("cfg", [AdvantageConfig("grpo"), AdvantageConfig("grpo", std_ddof=1, eps=1e-3),
                                 AdvantageConfig("dr_grpo"), AdvantageConfig("rloo")])
def test_advantage_slopes_are_each_estimators_own(cfg):
    """Each group estimator's slope (kept with it in `ESTIMATORS`) is the A_i - A_j = slope * (r_i - r_j)
    of its own advantages, group by group, for groups with and without contrast."""
    from sfrrl_jax.rl import advantage_slopes
    rewards = np.array([[1.0, 0.0, 0.5, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 0.0, 0.0]], np.float32)
    adv = np.asarray(compute_advantages(jnp.asarray(rewards), cfg))
    slopes = advantage_slopes(rewards, cfg)
    assert slopes.shape == (3,) and slopes.dtype == np.float32
    np.testing.assert_allclose(adv - adv[:, :1], slopes[:, None] * (rewards - rewards[:, :1]), rtol=1e-5, atol=1e-6)


def test_advantage_slopes_refuse_batch_normalised_estimators():
    from sfrrl_jax.rl import ESTIMATORS, advantage_slopes
    assert ESTIMATORS["reinforce_pp"].slope is None
    with pytest.raises(ValueError, match="reinforce_pp.*not a per-group affine.*grpo"):
        advantage_slopes(np.ones((2, 3), np.float32), AdvantageConfig("reinforce_pp"))
