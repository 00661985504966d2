"""Dynamic-sampling and overlong filters: masks and counts."""
import chex
import jax.numpy as jnp
import pytest

from sfrrl_jax.rl import OverlongConfig, apply_sample_mask, overlong_filter, zero_variance_groups


def test_zero_variance_groups_dropped():
    r = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    f = zero_variance_groups(r)
    chex.assert_trees_all_equal(f.keep_groups, jnp.array([False, True, False]))
    chex.assert_trees_all_equal(f.keep_samples, jnp.array([[False] * 3, [True] * 3, [False] * 3]))
    assert int(f.num_kept) == 1 and int(f.num_dropped) == 2


def test_single_sample_groups_have_no_variance():
    f = zero_variance_groups(jnp.array([[1.0], [2.0]]))
    assert int(f.num_kept) == 0 and int(f.num_dropped) == 2


def test_overlong_mask_mode():
    cfg = OverlongConfig(mode="mask", max_length=100, buffer=20)
    out = overlong_filter(jnp.array([1.0, 1.0, 0.0]), jnp.array([10, 100, 120]), cfg)
    chex.assert_trees_all_equal(out.keep_samples, jnp.array([True, False, False]))
    chex.assert_trees_all_equal(out.rewards, jnp.array([1.0, 1.0, 0.0]))
    assert int(out.num_overlong) == 2
    # an explicit truncation flag wins over the length rule
    out = overlong_filter(jnp.array([1.0, 1.0]), jnp.array([10, 100]), cfg, truncated=jnp.array([True, False]))
    chex.assert_trees_all_equal(out.keep_samples, jnp.array([False, True]))


def test_overlong_soft_penalty_is_linear_in_the_buffer():
    cfg = OverlongConfig(mode="soft", max_length=100, buffer=20, penalty=1.0)
    out = overlong_filter(jnp.ones(5), jnp.array([70, 80, 90, 100, 130]), cfg)
    chex.assert_trees_all_close(out.rewards, jnp.array([1.0, 1.0, 0.5, 0.0, 0.0]))
    chex.assert_trees_all_equal(out.keep_samples, jnp.ones(5, bool))
    assert int(out.num_overlong) == 3


def test_apply_sample_mask_zeroes_dropped_rows():
    mask = jnp.ones((4, 3))
    keep = jnp.array([[True, False], [False, True]])  # [groups, G]
    chex.assert_trees_all_equal(apply_sample_mask(mask, keep),
                                jnp.array([[1.0] * 3, [0.0] * 3, [0.0] * 3, [1.0] * 3]))
    with pytest.raises(ValueError, match="keep bits"):
        apply_sample_mask(mask, jnp.ones((3,), bool))


def test_overlong_config_errors():
    with pytest.raises(ValueError, match="OverlongConfig.mode"):
        OverlongConfig(mode="drop")
    with pytest.raises(ValueError, match="buffer"):
        OverlongConfig(max_length=10, buffer=20)
