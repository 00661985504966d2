"""OptimizerConfig.offload_state (issue #18 point 4): the optimizer state lives in host memory
(`pinned_host`) between updates and the numbers are those of the on-device state, bit for bit;
the switch is refused where the backend has no such memory; checkpoints restore into it."""
import jax
import numpy as np
import pytest

from sfrrl_jax.checkpoints import Checkpointer
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.learner import OptimizerConfig, make_train_step
from sfrrl_jax.learner.optimizer import with_memory_kind
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.models import init_params
from sfrrl_jax.rl import LossConfig

CFG = ModelConfig.preset("tiny-moe", max_seq_len=32, n_layers=1)
B, T = 4, 16


def _batch(seed):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), np.float32)
    mask[:, :3] = 0.0
    return {"tokens": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32), "loss_mask": mask,
            "advantages": (rng.normal(size=(B, T)) * mask).astype(np.float32),
            "rollout_logprobs": (-rng.random((B, T)) * mask).astype(np.float32)}


def _train(mesh, offload: bool, fused: bool):
    ts = make_train_step(CFG, LossConfig(), OptimizerConfig(learning_rate=1e-2, offload_state=offload))
    params = init_params(CFG, mesh, seed=0)
    opt = ts.init_opt_state(params)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(opt)}
    for i in range(3):
        if fused:
            params, opt, _ = ts.step(params, opt, _batch(i))
        else:
            acc = ts.grad_microstep(params, ts.init_accumulator(params), _batch(i))
            params, opt, _ = ts.apply(params, opt, acc)
    return ts, params, opt, kinds


@pytest.mark.parametrize("fused", [False, True], ids=["microstep+apply", "fused_step"])
def test_offloaded_state_lives_on_host_and_trains_bit_identically(fused):
    mesh = make_mesh(data=2, devices=jax.devices()[:2])  # moments split over data (ZeRO-1)
    _, p_dev, o_dev, kinds_dev = _train(mesh, False, fused)
    _, p_host, o_host, kinds_host = _train(mesh, True, fused)
    assert kinds_dev == {"device"} and kinds_host == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(o_host)} == {"pinned_host"}  # stays there
    assert {x.sharding.memory_kind for x in jax.tree.leaves(p_host)} == {"device"}
    for a, b in zip(jax.tree.leaves(p_dev) + jax.tree.leaves(o_dev), jax.tree.leaves(p_host) + jax.tree.leaves(o_host)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_offloaded_state_checkpoints_and_restores_into_host_memory(tmp_path):
    mesh = make_mesh(devices=jax.devices()[:1])
    ts, params, opt, _ = _train(mesh, True, fused=True)
    ckpt = Checkpointer(tmp_path, save_every=1, async_save=False)
    ckpt.maybe_save(3, {"params": params, "opt_state": opt}, {"note": "offload"}, force=True)
    ckpt.wait()
    target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params),
              "opt_state": ts.abstract_opt_state(params)}
    step, state, host = ckpt.restore_latest(target)
    ckpt.close()
    assert step == 3 and host == {"note": "offload"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state["opt_state"])} == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(state["opt_state"])):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    params2, opt2, _ = ts.step(state["params"], state["opt_state"], _batch(9))  # and trains on
    assert {x.sharding.memory_kind for x in jax.tree.leaves(opt2)} == {"pinned_host"}


def test_the_switch_is_checked_and_a_missing_memory_is_named():
    with pytest.raises(ValueError, match="OptimizerConfig.offload_state must be True or False"):
        OptimizerConfig(offload_state="yes")
    mesh = make_mesh(devices=jax.devices()[:1])
    sh = {"w": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())}
    with pytest.raises(ValueError, match=r"OptimizerConfig.offload_state: cpu devices have no 'hbm_of_mars' memory"):
        with_memory_kind(sh, "hbm_of_mars")
