"""The RL trainer: rollout and training on one mesh over the same params (DESIGN.md section 3).

One `step()`:
  1. launch `groups_per_step` groups (G samples of one prompt each) on the engine, longest
     expected first (`trainer.scheduling`); tool calls run on the event loop while other slots
     decode;
  2. as each group finishes, its advantages are final: it becomes a gradient micro-batch;
  3. `pipelined`: the engine runs those micro-steps whenever it would idle (every slot parked on a
     tool, or at most `underfull_slots` decoding), on the same params that generated them;
     `sync`: they run after the rollout; `one_step_off`: step k trains step k-1's groups;
  4. the KV cache is freed, the remaining micro-steps run, then exactly one optimizer update.
Gradient sums accumulate, so the update equals the full-batch one whatever ran when.
With `early_groups`, pipelined also trains finished samples of unfinished groups
(`trainer.early_samples`, `learner.deferred`): a straggler then holds back only itself.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import numpy as np
import optax

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.aio import run_sync
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine import Engine
from sfrrl_jax.engine.generate import fit_slots_to_budget
from sfrrl_jax.engine.lockstep import LockstepEngine
from sfrrl_jax.models.transformer import route_dims
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.loss_fn import Loss
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.deferred import advantage_free_terms, check_deferrable
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.mesh import DATA_AXIS, memory_limit
from sfrrl_jax.models.api import mesh_of
from sfrrl_jax.trainer.batching import batch_fields, row_shapes, zero_microbatch
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.health import TrainingHealth
from sfrrl_jax.trainer.memory_check import check_fits, rollout_resident_bytes
from sfrrl_jax.trainer.rollout_fn import RolloutFn, check_length_budget
from sfrrl_jax.trainer.scheduling import LongestFirst
from sfrrl_jax.trainer.process_step import Agreement, LockstepRules
from sfrrl_jax.trainer.microsteps import MicroStepUnit
from sfrrl_jax.trainer.step_rules import OneProcessRules
from sfrrl_jax.trainer.step_schedule import RLStep, StepInputs, StepResult
from sfrrl_jax.trainer.timeline import Timeline

__all__ = ["RLTrainer", "TaskStream", "MicroStepUnit", "RolloutFn", "check_memory_fits", "shared_train_step"]


@functools.lru_cache(maxsize=16)
def shared_train_step(model_cfg: ModelConfig, loss_cfg: LossConfig, optimizer_cfg: OptimizerConfig):
    """One TrainStep per configuration, so trainers built alike share compilations."""
    return make_train_step(model_cfg, loss_cfg, optimizer_cfg)


class TaskStream:
    """Endless, seeded, resumable stream of tasks: a fresh permutation each epoch."""

    def __init__(self, tasks: Sequence[Task], seed: int = 0, epoch: int = 0, index: int = 0):
        if not tasks:
            raise ValueError("TaskStream needs at least one task")
        self.tasks, self.seed, self.epoch, self.index = list(tasks), seed, epoch, index

    def _order(self):
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.tasks))

    def next(self) -> Task:
        if self.index >= len(self.tasks):
            self.epoch, self.index = self.epoch + 1, 0
        task = self.tasks[int(self._order()[self.index])]
        self.index += 1
        return task

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}


def check_memory_fits(engine_cache_bytes: int, params, device=None, param_copies: float = 3.0) -> None:
    """Up-front check that a KV cache of `engine_cache_bytes` (all slots) fits next to
    `param_copies` param-sized arrays (params, gradient sums, optimizer moments), before any
    compile. The trainer itself counts each part from its shapes and shardings
    (`trainer.memory_check`)."""
    limit, per_device = memory_limit(device)
    n = len(jax.devices()) if per_device else 1
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) / n
    check_fits({"KV cache": engine_cache_bytes / n, "params and optimizer": param_copies * params_bytes}, limit,
               per_device, "lower TrainerConfig.max_slots or max_len (or early_groups)")


class RLTrainer:
    """Rollout + training on one mesh (see the module doc); `step()` runs one RL step.

    The loss is a `LossConfig` or any `rl.Loss` value; the optimizer an `OptimizerConfig` or any
    optax `GradientTransformation` (e.g. `RLTrainer(cfg, params, tc, my_loss, optax.adamw(1e-5), ...)`).
    Prebuilt parts may be passed as values: `engine=` (an `Engine` over `model_cfg`, whose
    max_len must be `trainer_cfg.max_len`; its slots, buckets and decode_steps are its own) and
    `train_step=` (a `TrainStep`, e.g. `make_train_step(model_cfg, my_loss, optax.sgd(1e-3))`;
    then `optimizer_cfg` must be None, and `loss_cfg` None or the train step's own LossConfig).
    By default both are built from the configs. The loss trained is `self.loss` (an `rl.Loss`);
    its micro-batches carry `self.batch_fields` (`trainer.batching.batch_fields`): a loss that
    requires a field trajectories do not supply fails here, naming it.
    Across processes (multi-host: `jax.process_count() > 1`, the default engine is then a
    `LockstepEngine`; or any `LockstepEngine` passed as `engine=`): each process rolls out and
    trains its share of the groups (`trainer.process_step`); every process builds the trainer
    with the same configs, task stream and seed, and calls `step()` together.
    One length budget is checked here, once: the rollout function's declared `max_total_tokens`
    (if any, `trainer.rollout_fn`) <= `TrainerConfig.max_len` <= `ModelConfig.max_seq_len`.
    """

    def __init__(self, model_cfg: ModelConfig, params, trainer_cfg: TrainerConfig, loss_cfg: LossConfig | Loss | None,
                 optimizer_cfg: OptimizerConfig | optax.GradientTransformation | None, rollout_fn: RolloutFn,
                 tasks: TaskStream, expected_length: Callable[[Task], float] | None = None, opt_state=None, *,
                 engine: Engine | None = None, train_step=None):
        if isinstance(loss_cfg, Loss) or isinstance(optimizer_cfg, optax.GradientTransformation):
            # values in the config slots: the train step is built here from them (not shared)
            if train_step is not None:
                raise ValueError("RLTrainer: pass a loss and optimizer, or a prebuilt train_step=, not both")
            if loss_cfg is None or optimizer_cfg is None:
                raise ValueError("RLTrainer: a Loss or optax transformation needs both a loss and an optimizer")
            train_step = make_train_step(model_cfg, loss_cfg, optimizer_cfg)
            loss_cfg, optimizer_cfg = None, None
        elif optimizer_cfg is not None and not isinstance(optimizer_cfg, OptimizerConfig):
            raise TypeError(f"RLTrainer: optimizer must be an OptimizerConfig or an optax GradientTransformation, "
                            f"got {type(optimizer_cfg).__name__}")
        elif loss_cfg is not None and not isinstance(loss_cfg, LossConfig):
            raise TypeError(f"RLTrainer: loss must be a LossConfig or a sfrrl_jax.rl.Loss, got {type(loss_cfg).__name__}")
        if trainer_cfg.max_len > model_cfg.max_seq_len:
            raise ValueError(f"TrainerConfig.max_len={trainer_cfg.max_len} > ModelConfig.max_seq_len="
                             f"{model_cfg.max_seq_len}")
        check_length_budget(rollout_fn, trainer_cfg.max_len, model_cfg.max_seq_len)
        if train_step is None and optimizer_cfg is None:
            raise ValueError("RLTrainer needs optimizer_cfg (or a prebuilt train_step=)")
        if train_step is not None and optimizer_cfg is not None:
            raise ValueError("RLTrainer: pass optimizer_cfg or a prebuilt train_step=, not both "
                             "(the train step holds its own optimizer)")
        if train_step is None and loss_cfg is None:
            raise ValueError("RLTrainer needs loss_cfg (or a prebuilt train_step= holding its loss)")
        if train_step is not None:
            if loss_cfg is not None and loss_cfg != train_step.loss_cfg:
                raise ValueError(f"RLTrainer: loss_cfg={loss_cfg} is not the prebuilt train step's loss "
                                 f"({train_step.loss.name}); pass loss_cfg=None to train the train step's")
            loss_cfg = train_step.loss_cfg  # None for a custom rl.Loss
        if engine is not None:
            if engine.cfg != model_cfg:
                raise ValueError("RLTrainer: the prebuilt engine was built for another ModelConfig")
            if trainer_cfg.swap_cache and not engine.swap_cache:
                raise ValueError("RLTrainer: TrainerConfig.swap_cache=True but the prebuilt engine was built "
                                 "without it: build it with Engine(..., swap_cache=True)")
            if engine.steps.max_len != trainer_cfg.max_len:
                raise ValueError(f"RLTrainer: the prebuilt engine's max_len={engine.steps.max_len} != "
                                 f"TrainerConfig.max_len={trainer_cfg.max_len} (one length budget)")
        self.cfg, self.model_cfg, self.loss_cfg = trainer_cfg, model_cfg, loss_cfg
        self.rollout_fn, self.tasks = rollout_fn, tasks
        self.train_step = (train_step if train_step is not None
                           else shared_train_step(model_cfg, loss_cfg, optimizer_cfg))
        self.loss = self.train_step.loss
        self.batch_fields = batch_fields(self.loss)  # raises naming a required field trajectories lack
        # Routing replay trains on the engine's experts: it records them, and (as recording
        # needs) rebuilds no slot by recompute after a device fault.
        replay = self.loss.routing_replay == "r3"
        self.route_dims = route_dims(model_cfg) if replay else None
        if replay and trainer_cfg.prefix_cache_pages:
            raise ValueError(f"TrainerConfig.prefix_cache_pages={trainer_cfg.prefix_cache_pages} with "
                             "LossConfig.routing_replay='r3': a cached prefix keeps no routes to replay; set "
                             "prefix_cache_pages=0 (a group's samples still share their prompt's pages)")
        if replay and engine is not None and not engine.record_routes:
            raise ValueError("RLTrainer: the loss replays routing (routing_replay='r3') but the prebuilt engine "
                             "does not record routes: build it with Engine(..., record_routes=True, "
                             "max_consecutive_faults=0)")
        engine_cls = LockstepEngine if jax.process_count() > 1 else Engine
        build = functools.partial(
            engine_cls, model_cfg, params, max_len=trainer_cfg.max_len,
            buckets=trainer_cfg.buckets, decode_steps=trainer_cfg.decode_steps,
            decode_buckets=trainer_cfg.decode_buckets,
            page_size=trainer_cfg.page_size, num_pages=trainer_cfg.num_pages,
            prefix_cache_pages=trainer_cfg.prefix_cache_pages, paged_attention=trainer_cfg.paged_attention,
            swap_cache=trainer_cfg.swap_cache,
            **(dict(record_routes=True, max_consecutive_faults=0) if replay else {}))
        self.engine = engine if engine is not None else build(max_slots=trainer_cfg.engine_slots)
        if engine is None and trainer_cfg.max_slots is None:
            # one slot per sample unless the KV cache would outgrow its budget (the cache is
            # allocated on first use, so the first engine allocated nothing)
            self.engine = fit_slots_to_budget(self.engine, build, "RLTrainer (TrainerConfig.max_slots=None)")
        # one process, or N in lockstep (each rolling out its share): `trainer.process_step`
        self.multi_process = isinstance(self.engine, LockstepEngine)
        if jax.process_count() > 1 and not self.multi_process:
            raise ValueError(f"RLTrainer on {jax.process_count()} processes needs a LockstepEngine (got "
                             f"{type(self.engine).__name__}): every process must launch the same device steps")
        if self.multi_process:
            self.agreement = Agreement(self.engine.exchange.with_prefix("sfrrl/trainer"))
        # Packed micro-batches take row counts that split over the mesh's `data` axis (rows that
        # do not would run on every data shard alike); N processes each contribute a share of
        # the rows (`learner.process_rows`), so each process's count need only make up the rest.
        data = mesh_of(params).shape.get(DATA_AXIS, 1)
        processes = self.engine.exchange.process_count if self.multi_process else 1
        self.row_shapes = row_shapes(trainer_cfg, row_multiple=data // math.gcd(data, processes))
        early_buffers = 0
        if trainer_cfg.early_groups:
            check_deferrable(self.loss)
            # float32 param-shaped buffers per early group: h1, hc (+ k)
            early_buffers = trainer_cfg.early_groups * (3 if advantage_free_terms(self.train_step) else 2)
        limit, per_device = memory_limit()
        resident = rollout_resident_bytes(self.engine.steps, self.train_step, params, early_buffers, per_device)
        check_fits(resident, limit, per_device,
                   "lower TrainerConfig.max_slots or max_len (or early_groups), page the cache "
                   "(TrainerConfig.page_size), or keep state in host memory (OptimizerConfig.offload_state, "
                   "offload_accumulator)")
        self.params = params
        self.opt_state = opt_state if opt_state is not None else self.train_step.init_opt_state(params)
        self.params_version = 0
        self.step_index = 0
        # expected_length: optional prior `fn(task) -> tokens` for prompts not seen yet
        self.longest_first = LongestFirst(expected_tokens=expected_length)
        self.carry_over: list[MicroStepUnit] = []   # one_step_off: last step's groups
        self.timeline = Timeline()
        self.engine.set_trace(self.timeline)
        self._step: RLStep | None = None  # the step in progress (or the last one)
        self.health = TrainingHealth(trainer_cfg)   # ends a run whose every update is skipped

    # -- public -------------------------------------------------------------------------------
    def step(self) -> dict:
        """One RL step (rollout + one optimizer update); returns its metrics.

        Raises:
          trainer.health.TrainingDivergedError: `TrainerConfig.max_nonfinite_steps` updates in a
            row were skipped as non-finite (the step itself completed; params are unchanged by it).
        """
        return run_sync(self.step_async())

    async def step_async(self) -> dict:
        """One RL step: its schedule is an `RLStep` (`trainer.step_schedule`) built afresh from
        `step_inputs()`; the `StepResult` it returns is applied here (`apply_step_result`)."""
        inputs = self.step_inputs()
        # one process, or N in lockstep: the rules of the step are a value (`StepRules`)
        self._step = RLStep(inputs, LockstepRules(self.agreement) if self.multi_process else OneProcessRules())
        result = await self._step.run()
        self.apply_step_result(result)
        metrics = dict(result.metrics)
        metrics.update(self.health.observe(metrics))
        return metrics

    def step_inputs(self) -> StepInputs:
        """The explicit inputs of the next RL step: this trainer's configs and parts, and its
        current params, optimizer state, version, step index and carried-over micro-steps."""
        return StepInputs(
            cfg=self.cfg, engine=self.engine, train_step=self.train_step, rollout_fn=self.rollout_fn,
            tasks=self.tasks, longest_first=self.longest_first, timeline=self.timeline, params=self.params,
            opt_state=self.opt_state, params_version=self.params_version, step_index=self.step_index,
            carry_over=tuple(self.carry_over), batch_fields=self.batch_fields, route_dims=self.route_dims,
            row_shapes=self.row_shapes, forward_only=self.zero_advantage_forward_only)

    def apply_step_result(self, result: StepResult) -> None:
        """Takes a finished step's state as this trainer's: params, optimizer state, version,
        step index and the micro-steps it carries over (`one_step_off`)."""
        self.params, self.opt_state = result.params, result.opt_state
        self.params_version, self.step_index = result.params_version, result.step_index
        self.carry_over = list(result.carry_over)

    def compile_train_shapes(self) -> int:
        """Compiles the gradient micro-steps for every [rows, width] a step can form (the
        forward-only ones too where the step runs them, and the early-sample functions), on zero batches, so that no compile stalls a rollout later.
        Returns the number of shapes (`train_shapes`). The zero batches carry the fields real
        micro-batches carry for the train step's loss (`self.batch_fields`: its required fields
        and the optional ones trajectories supply).
        """
        cfg = self.cfg
        ts, acc = self.train_step, self.train_step.init_accumulator(self.params)
        shapes = self.train_shapes()
        forward_only = self.zero_advantage_forward_only
        for width in sorted({w for _, w in shapes}):
            zero = functools.partial(zero_microbatch, self.batch_fields, width=width, route_dims=self.route_dims)
            for n in sorted(r for r, w in shapes if w == width):
                acc = jax.block_until_ready(ts.grad_microstep(self.params, acc, zero(n)))  # one in flight
                if forward_only:   # zero-advantage micro-steps of the same shapes (step_schedule)
                    acc = jax.block_until_ready(ts.stats_microstep(self.params, acc, zero(n)))
            if cfg.early_groups:
                buf = ts.deferred_microstep(self.params, ts.init_deferred(self.params), zero(1), 0.0)
                acc = jax.block_until_ready(ts.merge_deferred(self.params, acc, buf, 1.0, 0.0))
        return len(shapes)

    def train_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, width) of a gradient micro-step a step can form, by width, then rows.
        Widths: multiples of `seq_bucket` capped at `max_len` (`batching.bucket_widths`). Rows:
        with `microbatch_rows`, 1 up to it (or the micro-batch's rows, if fewer); packed
        (`pack_rows`), the packing menu's counts at each width (`self.row_shapes`); one per row,
        the micro-batch's rows (every count up to them with early samples, whose groups train
        fewer); early samples add one-row micro-steps."""
        cfg, menu = self.cfg, self.row_shapes
        full = cfg.groups_per_microbatch * cfg.group_size
        out = set()
        for w in menu.widths:
            if cfg.microbatch_rows:
                rows = set(range(1, min(cfg.microbatch_rows, full) + 1))
            elif cfg.pack_rows:
                rows = set(menu.rows_at(w))
            else:   # early samples and zero-advantage splits train a micro-batch's rows in parts
                split = cfg.early_groups or self.zero_advantage_forward_only
                rows = set(range(1, full + 1)) if split else {full}
            if cfg.early_groups:
                rows.add(1)
            out.update((r, w) for r in rows)
        return sorted(out, key=lambda shape: (shape[1], shape[0]))

    # -- internals ----------------------------------------------------------------------------
    @property
    def zero_advantage_forward_only(self) -> bool:
        """Whether steps run zero-advantage micro-steps forward only (`RLStep.forward_only`): the
        switch is on, the train step's loss allows it, and the run is one process."""
        return bool(self.cfg.skip_zero_advantage_backward and not self.multi_process
                    and self.train_step.zero_advantage_forward_only)

