"""The trainer's up-front memory check: what stays in device memory while the engine rolls out.

Beside the engine's KV cache, each device holds during a rollout: the params, the optimizer
state (unless `OptimizerConfig.offload_state` keeps it in host memory), the float32 gradient sums
of the micro-steps run so far (unless `offload_accumulator`), and the early-sample groups'
float32 buffers. `rollout_resident_bytes` counts them from shapes and shardings (nothing is
allocated or compiled); `check_fits` compares their sum with the device's memory limit and names
every part when it does not fit. A training micro-step's own temporaries are not known before a
compile: `sfrrl-plan` compiles the steps and counts those too.

Per device where the device reports a limit (GPU, TPU): each leaf's shard bytes (a replicated
leaf counts whole on every device). On CPU, where every (fake) device shares the host's memory,
the logical bytes of each tree against the host's available memory, as before this module.
"""
from __future__ import annotations

import math

import jax
import numpy as np

from sfrrl_jax.mesh import device_bytes, in_device_memory
from sfrrl_jax.models.lora import trained_part


def tree_bytes(tree, per_device: bool) -> int:
    """Bytes of the device-memory leaves of `tree` (arrays, or ShapeDtypeStructs with shardings):
    one device's shards (per_device: `mesh.device_bytes`) or the logical arrays. Host-memory
    leaves count 0."""
    if per_device:
        return device_bytes(tree)
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if in_device_memory(x))


def rollout_resident_bytes(engine_steps, train_step, params, early_group_buffers: int = 0,
                           per_device: bool = True) -> dict[str, int]:
    """name -> bytes held in device memory throughout a rollout (see the module docstring).

    engine_steps: the engine's `EngineSteps` (its key and value caches' shapes and shardings); train_step:
    a `learner.TrainStep`; early_group_buffers: float32 param-shaped buffers of early-sample
    groups (`TrainerConfig.early_groups` x 2 or 3), shaped like the trained part of `params`."""
    cache = [jax.ShapeDtypeStruct(shape, engine_steps.cache_dtype, sharding=sharding)   # keys, values
             for shape, sharding in ((engine_steps.cache_shape, engine_steps.cache_sharding),
                                     (engine_steps.value_cache_shape, engine_steps.value_cache_sharding))]
    # gradient sums exist for the trained part only (a LoRA run's adapter: `models.lora.AdaptedParams`)
    f32_like_params = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, np.float32, sharding=getattr(p, "sharding", None)),
        trained_part(params))
    sums = tree_bytes(f32_like_params, per_device)
    parts = {
        "KV cache": tree_bytes(cache, per_device),
        "params": tree_bytes(params, per_device),
        "optimizer state": tree_bytes(train_step.abstract_opt_state(params), per_device),
        "gradient sums": 0 if train_step.offloads_accumulator else sums,
    }
    if early_group_buffers:
        parts["early-sample buffers"] = early_group_buffers * sums
    return parts


def _size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{int(b)} B"


def check_fits(parts: dict[str, float], limit: float, per_device: bool, advice: str) -> None:
    """Raises ValueError naming each part when their sum exceeds `limit`."""
    need = sum(parts.values())
    if need <= limit:
        return
    where = "per device" if per_device else "in host memory"
    listed = ", ".join(f"{name} {_size(b)}" for name, b in parts.items() if b)
    raise ValueError(f"a rollout holds {_size(need)} {where} ({listed}), more than the {_size(limit)} "
                     f"available: {advice}")
