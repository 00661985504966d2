"""A short fault-injection soak in the default suite (the 200-step one: experiments/soak/, or
`pytest -m soak tests/adversarial`, 90 s on 2 cores): every step completes while everything
fails, nothing leaks, every rollout is accounted for."""
import pytest

from sfrrl_jax.testing.fault_soak import SoakConfig, run_fault_soak


def _check(r):
    assert r["crashes"] == 0 and r["rollouts_in_limbo"] == 0
    assert r["rollouts_started"] == r["rollouts_returned"] + r["rollouts_raised"] + r["rollouts_cancelled"]
    assert r["leaked_slots"] == r["leaked_threads"] == r["leaked_child_processes"] == 0
    assert r["engine_faults_recovered"] == r["engine_faults_injected"] > 0
    assert r["tool_pools_replaced"] >= r["tool_pool_crashes_injected"]


def test_short_soak_every_step_completes_and_nothing_leaks():
    # Fault rates far above the long soak's, so that four steps meet every kind of fault.
    r = run_fault_soak(SoakConfig(steps=4, engine_fault_p=0.02, tool_crash_p=0.1, tool_hang_p=0.05,
                                  tool_hang_s=0.6, pool_crash_p=0.5, rollout_raise_p=0.05))
    _check(r)
    assert r["rollouts_cancelled"] > 0 and r["tool_pool_crashes_injected"] > 0
    # Each counted failure is a rollout that raised (some raise in groups cancelled before they end).
    assert r["failed_samples_counted"] <= r["rollouts_raised"] == r["rollout_raises_injected"]


@pytest.mark.soak  # deselected by default (pyproject addopts); run: pytest -m soak tests/adversarial
def test_long_soak_200_steps():
    _check(run_fault_soak(SoakConfig(steps=200)))
