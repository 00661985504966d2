"""Abstract (never allocated) inputs of the real step functions, and their per-device bytes.

Every array here is a `jax.ShapeDtypeStruct` carrying the `NamedSharding` the run would give it,
so `jax.jit(...).lower(...)` partitions the step exactly as the run does while no byte of the
model exists: gpt-oss-120b's 117B params are shapes, not memory.

    setup = TrainSetup.build(model_cfg, mesh, loss_cfg, optimizer_cfg)
    setup.params      {..: SDS}  the shared param pytree (models.api.param_shardings)
    setup.opt_state   OptState of SDS (OptimizerConfig: moments' extra `data` split, pinned_host)
    setup.acc         Accumulator of SDS (float32 gradient sums, sharded like the params)
    microbatch(setup, rows, length)                     MicroBatch of SDS [rows, length]
    engine_abstract(model_cfg, mesh, ...)               (EngineSteps, DecodeState of SDS)

`device_bytes(tree)` / `host_bytes(tree)` (from `sfrrl_jax.mesh`) sum the per-device shard bytes
(`sharding.shard_shape`) of the leaves held in device memory / in a host memory kind: exact
arithmetic on shapes, the same numbers the allocator would see for these buffers.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.pages import check_paging
from sfrrl_jax.engine.paged import engine_steps
from sfrrl_jax.engine.slot_state import SlotRequest
from sfrrl_jax.engine.steps import EngineSteps
from sfrrl_jax.learner.deferred import DeferredBuffer, advantage_free_terms
from sfrrl_jax.learner.optimizer import OptimizerConfig, OptState
from sfrrl_jax.learner.train_step import TrainStep, make_train_step
# the byte counts are mesh.py's; planner and search name them from here
from sfrrl_jax.mesh import device_bytes, host_bytes, shard_bytes, sharding_for  # noqa: F401
from sfrrl_jax.models.api import param_shardings
from sfrrl_jax.models.lora import (AdaptedParams, LoraAdapter, LoraConfig, adapter_shapes, adapter_shardings,
                                   frozen_part, trained_part)
from sfrrl_jax.models.transformer import param_shapes, route_dims
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.microbatch import MicroBatch
from sfrrl_jax.trainer.batching import ROUTE_FIELDS, TRAJECTORY_FIELDS, batch_fields

GB = 1e9   # report unit: the decimal GB of a device's datasheet (H200: 141 GB)


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@dataclasses.dataclass
class TrainSetup:
    """The train step of a run and abstract params / optimizer state / accumulator for it."""

    train_step: TrainStep
    params: Any
    opt_state: OptState
    acc: Any
    route_dims: tuple[int, int] | None = None   # (moe layers, top_k) under routing replay

    @staticmethod
    def build(model_cfg: ModelConfig, mesh, loss_cfg: LossConfig, optimizer_cfg: OptimizerConfig,
              lora: LoraConfig | None = None) -> "TrainSetup":
        """The abstract train state of a run; with `lora`, its params are `AdaptedParams` (the base
        frozen, the adapter trained: gradient sums and optimizer state adapter-sized)."""
        # A fresh TrainStep (not trainer.rl_trainer.shared_train_step's cached one): the planner
        # builds many configurations in one process and must not pin their executables.
        ts = make_train_step(model_cfg, loss_cfg, optimizer_cfg)
        shardings = param_shardings(model_cfg, mesh)
        params = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), param_shapes(model_cfg), shardings)
        if lora is not None:
            adapter = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), adapter_shapes(model_cfg, lora),
                                   adapter_shardings(model_cfg, lora, mesh))
            params = AdaptedParams(params, LoraAdapter(adapter, lora))
        opt_state = ts.abstract_opt_state(params)
        # eval_shape of the jitted init carries its out_shardings: the accumulator's real layout
        acc = jax.eval_shape(ts._fns(params)["init_acc"], trained_part(params))
        dims = route_dims(model_cfg) if ts.loss.routing_replay == "r3" else None
        return TrainSetup(ts, params, opt_state, acc, dims)

    def deferred_buffer(self) -> DeferredBuffer:
        """Abstract advantage-deferred group buffer (h1, hc, and k if the loss has such terms)."""
        return jax.eval_shape(self.train_step._deferred(self.params)["init"], self.trained)

    @property
    def trained(self):
        """The pytree the train step differentiates (the adapter of a LoRA run, else the params)."""
        return trained_part(self.params)

    @property
    def frozen(self):
        """The pytree the train step reads but never updates (a LoRA run's base, else None)."""
        return frozen_part(self.params)

    def deferred_param_copies(self) -> int:
        return 3 if advantage_free_terms(self.train_step) else 2


def microbatch_fields(train_step: TrainStep) -> tuple[str, ...]:
    """The fields a trajectory micro-batch carries into the jitted step (what `_prepare` keeps)."""
    reads = set(train_step.loss.fields) | set(train_step.loss.forward_fields)
    return tuple(k for k in batch_fields(train_step.loss) if k in reads)


def microbatch(setup: TrainSetup, rows: int, length: int) -> MicroBatch:
    """Abstract micro-batch, batch-sharded like `TrainStep._prepare` places it.

    Args:
      setup: the train setup (its train step's loss picks the fields, `microbatch_fields`).
      rows: the row count.
      length: the row width in tokens.
    Returns:
      A `MicroBatch` of `jax.ShapeDtypeStruct`s with shardings: each field `[rows, length]` (dtypes of
      `TRAJECTORY_FIELDS`), under routing replay 'routes' `[rows, length, moe layers, top_k]`; the
      fields the step does not read are None.
    """
    mesh = jax.tree.leaves(setup.params)[0].sharding.mesh
    out = {}
    for k in microbatch_fields(setup.train_step):
        shape = (rows, length) + (tuple(setup.route_dims) if k == "routes" else ())
        dtype = ROUTE_FIELDS[k] if k in ROUTE_FIELDS else TRAJECTORY_FIELDS[k]
        out[k] = _sds(shape, dtype, sharding_for(mesh, ("batch", "seq") + (None,) * (len(shape) - 2), shape))
    return MicroBatch.from_mapping(out)


def engine_abstract(model_cfg: ModelConfig, mesh, max_slots: int, max_len: int, buckets,
                    page_size: int | None = None, num_pages: int | None = None,
                    decode_steps: int = 1) -> tuple[EngineSteps, Any]:
    """The engine's jitted steps (as `engine.Engine` builds them) and an abstract DecodeState."""
    paging = check_paging(page_size, num_pages, max_len, max_slots)
    steps = engine_steps(model_cfg, mesh, max_slots, max_len, None if buckets is None else tuple(buckets),
                         None, paging)
    state = jax.eval_shape(steps._init)
    return steps, state


def request_abstract() -> SlotRequest:
    """One request's settings as abstract scalars (their values do not change memory)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), SlotRequest.make())
