"""Policy losses, aggregation, KL, entropy, TIS/MIS and metrics against hand-computed values."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfrrl_jax.rl import (
    LossConfig, SequenceLayout, aggregate, gspo_log_ratio, kl_estimate, mismatch_weights,
    policy_objective, ppo_clip_loss, sft_objective,
)
from sfrrl_jax.rl.losses import finalize_metrics

E = math.e


def metrics_of(parts):
    return {k: float(v) for k, v in finalize_metrics(parts.sums, parts.maxes, parts.mins,
                                                     parts.denominator, parts.num_tokens).items()}


# -- PPO clip -------------------------------------------------------------------------------------

def test_ppo_clip_asymmetric_values_and_indicators():
    r = jnp.array([0.5, 1.0, 1.5, 0.7, 1.3])
    a = jnp.array([1.0, 1.0, 1.0, -1.0, -1.0])
    loss, clipped, dual = ppo_clip_loss(jnp.log(r), a, clip_low=0.2, clip_high=0.28)
    # A>0: max(-r, -clip(r, .8, 1.28)); A<0: max(r, clip(r))
    chex.assert_trees_all_close(loss, jnp.array([-0.5, -1.0, -1.28, 0.8, 1.3]), rtol=1e-6)
    chex.assert_trees_all_equal(clipped, jnp.array([0.0, 0.0, 1.0, 1.0, 0.0]))
    chex.assert_trees_all_equal(dual, jnp.zeros(5))
    # gradient w.r.t. the log-ratio: -A r where unclipped, 0 where clipped
    g = jax.grad(lambda lr: jnp.sum(ppo_clip_loss(lr, a, 0.2, 0.28)[0]))(jnp.log(r))
    chex.assert_trees_all_close(g, jnp.array([-0.5, -1.0, 0.0, 0.0, 1.3]), rtol=1e-6)


def test_dual_clip_caps_negative_advantages():
    r = jnp.array([5.0, 2.0, 5.0])
    a = jnp.array([-1.0, -1.0, 1.0])
    loss, clipped, dual = ppo_clip_loss(jnp.log(r), a, 0.2, 0.2, dual_clip=3.0)
    chex.assert_trees_all_close(loss, jnp.array([3.0, 2.0, -1.2]), rtol=1e-6)
    chex.assert_trees_all_equal(dual, jnp.array([1.0, 0.0, 0.0]))
    chex.assert_trees_all_equal(clipped, jnp.array([0.0, 0.0, 1.0]))
    g = jax.grad(lambda lr: jnp.sum(ppo_clip_loss(lr, a, 0.2, 0.2, 3.0)[0]))(jnp.log(r))
    chex.assert_trees_all_close(g, jnp.array([0.0, 2.0, 0.0]), rtol=1e-6)


# -- aggregation ----------------------------------------------------------------------------------

L = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 8.0, 9.0, 9.0]])
M = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2 fully masked


@pytest.mark.parametrize("mode,expected", [
    ("token_mean", 17 / 5), ("seq_mean_token_sum", 17 / 2), ("seq_mean_token_mean", (2 + 5.5) / 2),
    ("seq_mean_token_sum_norm", 17 / (2 * 4)),
])
def test_aggregation_modes(mode, expected):
    layout = SequenceLayout(L.shape)
    assert float(aggregate(L, M, layout, mode, norm_length=4)) == pytest.approx(expected, rel=1e-6)


def test_aggregation_all_masked_is_zero_not_nan():
    layout = SequenceLayout(L.shape)
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        assert float(aggregate(L, jnp.zeros_like(M), layout, mode)) == 0.0


def test_packed_sequences_count_separately():
    seg = jnp.array([[1, 1, 2, 2], [1, 1, 1, 0]])
    l = jnp.array([[1.0, 2.0, 3.0, 4.0], [6.0, 6.0, 6.0, 100.0]])
    m = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    layout = SequenceLayout(l.shape, seg)
    # sequences: (1, 2), (3, 4), (6, 6, 6) -> token means 1.5, 3.5, 6
    assert float(aggregate(l, m, layout, "seq_mean_token_mean")) == pytest.approx((1.5 + 3.5 + 6) / 3)
    assert float(aggregate(l, m, layout, "seq_mean_token_sum")) == pytest.approx(28 / 3)


# -- KL / IS ----------------------------------------------------------------------------------------

def test_kl_estimators():
    logp, ref = jnp.array([-1.0]), jnp.array([-2.0])
    assert float(kl_estimate(logp, ref, "k1")[0]) == pytest.approx(1.0)
    assert float(kl_estimate(logp, ref, "k2")[0]) == pytest.approx(0.5)
    assert float(kl_estimate(logp, ref, "k3")[0]) == pytest.approx(math.exp(-1.0))
    assert float(kl_estimate(ref, ref, "k3")[0]) == 0.0


BEH = jnp.array([[-1.0, -1.0, -1.0]])
ROLL = jnp.array([[-1.0, -2.0, -0.5]])  # token w = 1, e, e^-0.5
ONE = jnp.ones((1, 3))


@pytest.mark.parametrize("corr,level,weight,rejected", [
    ("tis", "token", [1.0, 2.0, math.exp(-0.5)], [0, 1, 0]),
    ("mis", "token", [1.0, 0.0, math.exp(-0.5)], [0, 1, 0]),
    ("tis", "sequence", [math.exp(0.5)] * 3, [0, 0, 0]),
    ("mis", "geo_sequence", [math.exp(0.5 / 3)] * 3, [0, 0, 0]),
    ("none", "token", [1.0, 1.0, 1.0], [0, 0, 0]),
])
def test_mismatch_weights(corr, level, weight, rejected):
    w = mismatch_weights(BEH, ROLL, ONE, SequenceLayout((1, 3)), corr, level, cap=2.0, low=0.5, high=2.0)
    chex.assert_trees_all_close(w.weight, jnp.array([weight]), rtol=1e-6)
    chex.assert_trees_all_equal(w.rejected, jnp.array([rejected], jnp.float32))


def test_sequence_mis_masks_whole_sequence():
    roll = jnp.array([[-2.0, -2.0, -1.0]])  # product w = e^2 > high
    w = mismatch_weights(BEH, roll, ONE, SequenceLayout((1, 3)), "mis", "sequence", low=0.5, high=2.0)
    chex.assert_trees_all_equal(w.weight, jnp.zeros((1, 3)))
    chex.assert_trees_all_equal(w.rejected, jnp.ones((1, 3)))


def test_tis_in_objective_weights_the_gradient_and_reports_metrics():
    cfg = LossConfig(behavior="current", is_correction="tis", is_cap=2.0)
    adv = jnp.array([[1.0, 1.0, -1.0]])
    f = lambda lp: policy_objective(lp, jnp.zeros_like(lp), ONE, adv, ROLL, SequenceLayout((1, 3)), cfg)
    parts, g = jax.jit(lambda lp: (f(lp), jax.grad(lambda x: f(x).numerator)(lp)))(BEH)
    # d/dlogp of -A * w * ratio, ratio = 1: -A * min(w, 2)
    chex.assert_trees_all_close(g, jnp.array([[-1.0, -2.0, math.exp(-0.5)]]), rtol=1e-6)
    m = metrics_of(parts)
    assert m["mismatch"] == pytest.approx(0.5)
    assert m["is_weight"] == pytest.approx((1 + E + math.exp(-0.5)) / 3, rel=1e-6)
    assert m["is_weight_max"] == pytest.approx(E, rel=1e-6)
    assert m["is_weight_min"] == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert m["is_rejected_frac"] == pytest.approx(1 / 3)
    assert m["ratio"] == pytest.approx(1.0) and m["clip_frac"] == 0.0 and m["approx_kl"] == 0.0


def test_policy_metrics_clip_fraction_and_approx_kl():
    cfg = LossConfig(behavior="old", clip_low=0.2, clip_high=0.28)
    logp = jnp.log(jnp.array([[0.5, 1.0, 1.5, 0.7, 1.3]]))  # old = 0 -> ratio = these values
    adv = jnp.array([[1.0, 1.0, 1.0, -1.0, -1.0]])
    z = jnp.zeros((1, 5))
    parts = policy_objective(logp, z, jnp.ones((1, 5)), adv, z, SequenceLayout((1, 5)), cfg, old_logp=z)
    m = metrics_of(parts)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["pg_loss"] == pytest.approx((-0.5 - 1.0 - 1.28 + 0.8 + 1.3) / 5, rel=1e-6)
    r = np.array([0.5, 1.0, 1.5, 0.7, 1.3])
    assert m["approx_kl"] == pytest.approx(float(np.mean(r - 1 - np.log(r))), rel=1e-5)
    assert m["ratio_max"] == pytest.approx(1.5, rel=1e-6) and m["ratio_min"] == pytest.approx(0.5, rel=1e-6)


def test_kl_loss_and_entropy_bonus_enter_the_numerator():
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01, aggregation="token_mean")
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.0]])
    ent = jnp.array([[2.0, 4.0]])
    adv = jnp.array([[1.0, -1.0]])
    parts = policy_objective(logp, ent, jnp.ones((1, 2)), adv, logp, SequenceLayout((1, 2)), cfg, ref_logp=ref)
    # pg: -1 + 1 = 0; kl k1: 0.5 - 1 = -0.5; entropy sum 6
    assert float(parts.numerator) == pytest.approx(0.1 * -0.5 - 0.01 * 6.0, rel=1e-6)
    assert float(parts.denominator) == 2.0
    m = metrics_of(parts)
    assert m["kl_ref"] == pytest.approx(-0.25) and m["entropy"] == pytest.approx(3.0)


# -- GSPO ------------------------------------------------------------------------------------------

def test_gspo_equals_sequence_level_objective():
    logp = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    old = jnp.array([[-1.2, -2.2, -2.9], [-0.4, -0.5, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = jnp.array([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    layout = SequenceLayout((2, 3))
    cfg = LossConfig(policy_loss="gspo", behavior="old", clip_low=0.5, clip_high=0.5,
                     aggregation="seq_mean_token_mean")

    def ours(lp):
        p = policy_objective(lp, jnp.zeros_like(lp), mask, adv, old, layout, cfg, old_logp=old)
        return p.numerator / p.denominator

    def reference(lp):  # -(1/N) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(lp - old))
        s = jnp.exp(jnp.sum((lp - old) * mask, -1) / jnp.sum(mask, -1))
        a = adv[:, 0]
        return jnp.mean(-jnp.minimum(s * a, jnp.clip(s, 0.5, 1.5) * a))

    v_ours, g_ours = jax.jit(jax.value_and_grad(ours))(logp)
    v_ref, g_ref = jax.jit(jax.value_and_grad(reference))(logp)
    assert float(v_ours) == pytest.approx(float(v_ref), rel=1e-6)
    chex.assert_trees_all_close(g_ours * mask, g_ref * mask, rtol=1e-6, atol=1e-7)
    # value of the token log-ratio is the sequence's mean log-ratio
    chex.assert_trees_all_close(gspo_log_ratio(logp, old, mask, layout)[0], jnp.full((3,), 0.1), rtol=1e-5)


# -- on-policy sanity --------------------------------------------------------------------------------

@pytest.mark.parametrize("behavior", ["rollout", "current"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_on_policy_ppo_gradient_is_vanilla_policy_gradient(behavior, aggregation):
    key = jax.random.key(0)
    theta = jax.random.normal(key, (3, 5, 7))
    targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 7)
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], jnp.float32)
    adv = jax.random.normal(jax.random.key(2), (3, 5))
    layout = SequenceLayout((3, 5))
    logp_of = lambda th: jnp.take_along_axis(jax.nn.log_softmax(th), targets[..., None], -1)[..., 0]
    rollout = logp_of(theta)  # the engine's log-probs equal the current ones
    cfg = LossConfig(behavior=behavior, is_correction="tis", aggregation=aggregation, clip_low=0.2, clip_high=0.28)

    def ppo(th):
        p = policy_objective(logp_of(th), jnp.zeros((3, 5)), mask, adv, rollout, layout, cfg)
        return p.numerator / p.denominator, p

    def vanilla(th):  # - A * logp, same aggregation
        return aggregate(-adv * logp_of(th), mask, layout, aggregation)

    (_, parts), g = jax.jit(jax.value_and_grad(ppo, has_aux=True))(theta)
    m = metrics_of(parts)
    assert m["ratio"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.0)
    assert m["clip_frac"] == 0.0 and m["is_weight"] == pytest.approx(1.0) and m["mismatch"] == 0.0
    chex.assert_trees_all_close(g, jax.jit(jax.grad(vanilla))(theta), rtol=1e-6, atol=1e-7)


def test_sft_objective_is_masked_nll():
    logp = jnp.array([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    for mode, expected in (("token_mean", 1.5), ("seq_mean_token_sum", 3.0)):
        parts = sft_objective(logp, jnp.zeros_like(logp), mask, SequenceLayout((2, 3)), LossConfig(objective="sft", aggregation=mode))
        assert float(parts.numerator / parts.denominator) == pytest.approx(expected)
        assert float(parts.num_seqs) == 1.0 and float(parts.num_tokens) == 2.0


def test_loss_config_errors_name_the_field():
    with pytest.raises(ValueError, match="LossConfig.aggregation"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="norm_length"):
        LossConfig(aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        z = jnp.zeros((1, 2))
        policy_objective(z, z, z, z, z, SequenceLayout((1, 2)), LossConfig(kl_coef=0.1))
