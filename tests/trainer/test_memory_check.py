"""The trainer's up-front memory check (`trainer.memory_check`): each part a rollout keeps in
device memory, counted per device from shapes and shardings; offloaded state counts nothing; a
sum over the limit is refused naming every part."""
import types

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.engine.paged import engine_steps
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.mesh import memory_limit
from sfrrl_jax.trainer.memory_check import check_fits, rollout_resident_bytes, tree_bytes

from model_fixtures import TINY


def _setup(**opt):
    mesh = S.make_mesh(data=2, expert=4)
    params = S.init_params(TINY, mesh, seed=0)
    steps = engine_steps(TINY, mesh, 8, 64)
    return params, steps, make_train_step(TINY, LossConfig(), OptimizerConfig(**opt))


def test_parts_are_counted_per_device_from_shardings():
    params, steps, ts = _setup()
    parts = rollout_resident_bytes(steps, ts, params)
    shard = lambda a: int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
    per_device_params = sum(shard(a) for a in jax.tree.leaves(params))
    f32_params = sum(int(np.prod(a.sharding.shard_shape(a.shape))) * 4 for a in jax.tree.leaves(params))
    # the dense cache: 8 slots over the 8 devices' slot axes, keys and values
    cache_elems = int(np.prod(steps.cache_shape))
    assert parts["KV cache"] == 2 * cache_elems * steps.cache_dtype.itemsize // 8
    assert parts["params"] == per_device_params < sum(a.nbytes for a in jax.tree.leaves(params))
    assert parts["gradient sums"] == f32_params
    opt = ts.init_opt_state(params)
    assert parts["optimizer state"] == sum(shard(a) for a in jax.tree.leaves(opt)) > 0
    # logical bytes (the CPU accounting): the arrays' own sizes
    assert rollout_resident_bytes(steps, ts, params, per_device=False)["params"] == \
        sum(a.nbytes for a in jax.tree.leaves(params))
    # early-sample groups: float32 param-shaped buffers
    assert rollout_resident_bytes(steps, ts, params, early_group_buffers=3)["early-sample buffers"] == 3 * f32_params


def test_offloaded_state_and_sums_take_no_device_memory():
    params, steps, ts = _setup(offload_state=True, offload_accumulator=True)
    parts = rollout_resident_bytes(steps, ts, params)
    assert parts["optimizer state"] == 0 and parts["gradient sums"] == 0
    host_state = ts.abstract_opt_state(params)
    assert tree_bytes(host_state, per_device=True) == 0
    assert any(a.sharding.memory_kind == "pinned_host" for a in jax.tree.leaves(host_state))


def test_over_the_limit_names_every_part():
    parts = {"KV cache": 3 * 2**30, "params": 2**30, "optimizer state": 0, "gradient sums": 2**31}
    check_fits(parts, 6 * 2**30, True, "advice")   # exactly fits
    with pytest.raises(ValueError, match=r"6\.00 GiB per device \(KV cache 3\.00 GiB, params 1\.00 GiB, gradient "
                                         r"sums 2\.00 GiB\), more than the 5\.00 GiB available: lower it"):
        check_fits(parts, 5 * 2**30, True, "lower it")


def test_memory_limit_reads_the_device_or_the_host():
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 80 * 2**30})
    assert memory_limit(device) == (80 * 2**30, True)
    limit, per_device = memory_limit(types.SimpleNamespace(memory_stats=lambda: None))
    assert limit > 0 and per_device is False


def test_the_trainer_refuses_what_only_fits_with_offloaded_state(monkeypatch):
    """A device limit that holds cache + params but not the optimizer state and gradient sums:
    RLTrainer refuses up front, naming them; with both offloaded to host memory it is built."""
    from sfrrl_jax.trainer import rl_trainer
    from sfrrl_jax.trainer.config import TrainerConfig
    from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks

    params, steps, ts = _setup()
    parts = rollout_resident_bytes(steps, ts, params)
    monkeypatch.setattr(rl_trainer, "memory_limit",
                        lambda device=None: (parts["KV cache"] + parts["params"] + 1024, True))
    wl = WorkloadConfig(num_prompts=2, max_response=8)

    def build(**opt):
        tc = TrainerConfig(mode="pipelined", groups_per_step=1, group_size=2, max_slots=8, max_len=64)
        return rl_trainer.RLTrainer(TINY, params, tc, LossConfig(), OptimizerConfig(**opt), WorkloadAgent(wl),
                                    rl_trainer.TaskStream(make_tasks(wl)))
    named = r"optimizer state [0-9.]+ KiB, gradient sums [0-9.]+ KiB\).*OptimizerConfig.offload_state"
    with pytest.raises(ValueError, match=named):
        build()
    trainer = build(offload_state=True, offload_accumulator=True)
    assert trainer.engine.steps is steps   # the same engine layout the limit was computed for


def test_check_memory_fits_counts_the_cache_and_param_copies():
    """The public one-call form: a cache of all slots plus `param_copies` x the params, per device
    (8 devices here), against the device's limit."""
    from sfrrl_jax.trainer.rl_trainer import check_memory_fits
    params, _, _ = _setup()
    per_device = sum(a.nbytes for a in jax.tree.leaves(params)) / 8
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 2**20 + 3 * per_device})
    check_memory_fits(8 * 2**20, params, device)   # 1 MiB of cache a device: exactly fits
    with pytest.raises(ValueError, match=r"KV cache 1\.00 MiB, params and optimizer .* lower TrainerConfig.max_slots"):
        check_memory_fits(8 * 2**20 + 8, params, device)
