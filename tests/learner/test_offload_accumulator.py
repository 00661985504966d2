"""OptimizerConfig.offload_accumulator: the gradient sums wait in host memory (`pinned_host`)
between micro-steps (while the engine rolls out beside them), come to the devices for each
micro-step, deferred merge and update, and the numbers are those of on-device sums, bit for bit."""
import jax
import numpy as np
import pytest

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.learner import OptimizerConfig, make_train_step
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.models import init_params
from sfrrl_jax.rl import LossConfig

CFG = ModelConfig.preset("tiny-moe", max_seq_len=32, n_layers=1)
B, T = 4, 16


def _batch(seed, rows=B):
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, T), np.float32)
    mask[:, :3] = 0.0
    return {"tokens": rng.integers(0, CFG.vocab_size, (rows, T)).astype(np.int32), "loss_mask": mask,
            "advantages": (rng.normal(size=(rows, T)) * mask).astype(np.float32),
            "rollout_logprobs": (-rng.random((rows, T)) * mask).astype(np.float32)}


def _kinds(acc):
    return {x.sharding.memory_kind for x in jax.tree.leaves(acc.grads)}


def _train(mesh, offload: bool):
    """Two steps of: two micro-steps, one advantage-deferred buffer merged, the update."""
    ts = make_train_step(CFG, LossConfig(behavior="current"),
                         OptimizerConfig(learning_rate=1e-2, offload_accumulator=offload))
    params = init_params(CFG, mesh, seed=0)
    opt = ts.init_opt_state(params)
    seen, metrics = [], []
    for step in range(2):
        acc = ts.init_accumulator(params)
        seen.append(_kinds(acc))
        for i in range(2):
            acc = ts.grad_microstep(params, acc, _batch(10 * step + i))
            seen.append(_kinds(acc))
        buf = ts.deferred_microstep(params, ts.init_deferred(params), _batch(10 * step + 5, rows=2), 0.5)
        acc = ts.merge_deferred(params, acc, buf, 1.0, 0.25)
        seen.append(_kinds(acc))
        params, opt, m = ts.apply(params, opt, acc)
        metrics.append(jax.device_get(m))
    return params, opt, seen, metrics


def test_offloaded_sums_live_on_host_between_calls_and_train_bit_identically():
    mesh = make_mesh(data=2, expert=2, devices=jax.devices()[:4])
    p_dev, o_dev, seen_dev, m_dev = _train(mesh, False)
    p_host, o_host, seen_host, m_host = _train(mesh, True)
    assert set().union(*seen_dev) == {"device"}
    assert all(kinds == {"pinned_host"} for kinds in seen_host), seen_host
    assert {x.sharding.memory_kind for x in jax.tree.leaves(p_host)} == {"device"}
    for a, b in zip(jax.tree.leaves((p_dev, o_dev)), jax.tree.leaves((p_host, o_host))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert m_dev == m_host


def test_the_switch_is_checked():
    with pytest.raises(ValueError, match="OptimizerConfig.offload_accumulator must be True or False"):
        OptimizerConfig(offload_accumulator=1)
