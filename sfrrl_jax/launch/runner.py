"""One RL experiment end to end: config -> mesh, params, trainer -> steps with checkpoints -> run dir.

    summary = run_experiment(ExperimentConfig(run_dir="/tmp/run", num_steps=20, checkpoint_every=5))

The run dir then holds:
  metrics.jsonl, tensorboard/     one row per logged step (RunLogger), incl. checkpoint timings
  checkpoints/<step>/             orbax checkpoints (Checkpointer): every `checkpoint_every` steps,
                                  at the end, and when SIGTERM/SIGINT stops the run
  operative_config.gin            the gin config the run was built from (when given)
  timeline.trace.json, busy_idle.png, summary.json

A run dir holds one run. Without `resume`, a dir that already holds metrics rows or checkpoints
is refused (`RunDirError`): the new run would append to the old run's metrics.jsonl and fail at
its first save. `resume=True` with no checkpoint at all (a new dir, or a run killed before its
first save) starts at step 0, says so, and drops the rows an earlier attempt logged (they are
redone); with checkpoints of which none restores it raises `NoRestorableCheckpointError` naming
each step and why, and moves nothing. An HF-loaded state with nan/inf in any param raises
`NonFiniteStateError` naming the tensors: every update would be skipped.

`resume=True` restores the newest restorable checkpoint and continues. A damaged newest step
(missing, truncated or unreadable files, contents that fail their checksums, nan/inf in a param
or optimizer moment) is skipped with a warning and renamed "<step>.damaged", and the newest intact
step restores (`Checkpointer.restore_latest`); `resume='strict'` (`--resume=strict`) refuses a
damaged newest step instead (`DamagedCheckpointError`, nothing moved). On resume params,
optimizer state, data position, step, longest-first history and
the one_step_off carry-over all come back (see `trainer_state`), so the resumed run repeats the
uninterrupted one from that step on. Rows of metrics.jsonl logged after that checkpoint (a run
killed between a save and the next) are dropped so every step appears once.

Exactness holds where the uninterrupted run is itself deterministic: sampling is seeded per
request, but with several micro-steps per step the gradient sum is taken in the order groups
finish (tool latencies are real), so two runs with the same seed may differ in float rounding.
One micro-step per step (groups_per_microbatch == groups_per_step, sync or pipelined) is bitwise
repeatable.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.checks import check_bool_fields, check_int, check_int_fields, check_seed, check_str
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import MESH_AXES, make_mesh
from sfrrl_jax.models.api import check_mesh_fits, init_params, param_shardings
from sfrrl_jax.models.lora import (AdaptedParams, LoraAdapter, LoraConfig, adapted_leaves, adapter_shapes,
                                   adapter_shardings, check_trainable, init_adapter)
from sfrrl_jax.models.transformer import param_shapes
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.learner.optimizer import OptState, OptimizerConfig, opt_state_shardings
from sfrrl_jax.checkpoints.orbax_store import Checkpointer, check_finite
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.evaluate import HeldOut
from sfrrl_jax.trainer.rl_trainer import RLTrainer, RolloutFn, TaskStream, shared_train_step
from sfrrl_jax.trainer.rollout_source import RolloutFactory, RolloutSource  # noqa: F401  (re-exported)
from sfrrl_jax.trainer.run_logger import RunLogger
from sfrrl_jax.trainer.stop_signal import install_sigterm_handler
from sfrrl_jax.checkpoints.trainer_state import (check_resumable, config_fingerprint, load_trainer_state,
                                             trainer_state)
from sfrrl_jax.launch.held_out_runs import HeldOutRuns

logger = logging.getLogger(__name__)

# Metric prefixes that measure time or this process (compile counts), not the run's math: they
# differ between a resumed and an uninterrupted run and are left out of exactness comparisons.
TIMING_PREFIXES = ("time/", "perf/", "checkpoint/")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything one RL run needs (bound by gin in experiments/, plain dataclass here).

    model / model_overrides: a `ModelConfig.preset` name and fields to override. With `hf_path`
      the weights and config come from that HF directory; `model` then names the expected preset
      (its shapes must match the directory's config.json), or None to skip that check; the
      overrides may then set only the fields that change how the model runs, not its weights
      (`RUNTIME_MODEL_FIELDS`: remat, a longer max_seq_len, kernels, MoE dispatch and chunking, the
      layer layout `scan_layers`, which for an HF model defaults to `default_scan_layers()`: per-layer
      params on CPU, stacked elsewhere).
    mesh_data / mesh_expert / mesh_context / mesh_tensor: the one mesh; the product must equal the
      device count (`num_devices` states it up front, so a config is validated without the
      devices). mesh_context > 1 splits each training sequence over that many devices (context
      parallelism, `models.context_parallel`).
    rollout: where trajectories come from, a factory `fn(experiment_cfg, model_cfg) -> RolloutSource`
      (`trainer.rollout_source`), required: `launch.agentic.AgenticRollout` (a task set through the
      agent loop; in gin `@AgenticRollout()`) or `testing.workload.WorkloadRollout` (the seeded
      long-tail workload of the straggler benches). A factory's `validate(experiment_cfg, model_cfg)`,
      if it has one, runs with the other checks before anything is allocated.
    num_steps: total RL steps of the run (a resumed run continues up to it).
    resume: continue from the run dir's newest intact checkpoint (True: a damaged newest step is
      renamed "<step>.damaged" and an older one restores; 'strict': a damaged newest step is refused).
    checkpoint_every: save every N steps (0: only at the end / on a stop signal).
    log_every: write a metrics row every N steps (and the last one).
    eval_every: with a held-out set (`RolloutSource.held_out`, e.g. `AgenticRollout.eval_tasks`),
      also evaluate every N steps; it is always evaluated before the first step of a fresh run and
      after the last (0: only then). See `launch.held_out_runs`.
    lora: a `LoraConfig` (in gin `@LoraConfig()`): train a LoRA adapter on the frozen base
      (`models.lora`); checkpoints then hold the adapter and its optimizer state only (the base is
      read again from `hf_path`, or re-drawn from `seed`, on resume), and a finished run writes the
      adapter as a PEFT directory, `run_dir/adapter` (`checkpoints.hf.save_adapter`). None: train
      every weight.
    """

    run_dir: str = ""
    model: str | None = "tiny-moe"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    hf_path: str | None = None
    hf_dtype: str | None = None
    mesh_data: int = 1
    mesh_expert: int = 1
    mesh_context: int = 1
    mesh_tensor: int = 1
    num_devices: int | None = None
    trainer: TrainerConfig = TrainerConfig()
    loss: LossConfig = LossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    rollout: Any = None
    num_steps: int = 10
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    resume: bool | str = False
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0
    progress_bar: bool = True
    tensorboard: bool = True
    lora: LoraConfig | None = None

    def __post_init__(self):
        own = "ExperimentConfig"
        if not isinstance(self.run_dir, (str, os.PathLike)):
            raise ValueError(f"{own}.run_dir must be a path, got {self.run_dir!r} ({type(self.run_dir).__name__})")
        if not str(self.run_dir):
            raise ValueError(f"{own}.run_dir is empty: set the directory the run writes to")
        if self.model is None and self.hf_path is None:
            raise ValueError(f"{own}: set model (a preset name) or hf_path (an HF directory)")
        for k in ("model", "hf_path", "hf_dtype"):
            check_str(f"{own}.{k}", getattr(self, k), optional=True)
        if not isinstance(self.model_overrides, dict):
            raise ValueError(f"{own}.model_overrides must be a dict of ModelConfig fields, got "
                             f"{self.model_overrides!r}")
        unknown = sorted(set(self.model_overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
        if unknown:
            raise ValueError(f"{own}.model_overrides has keys that are no ModelConfig field: {unknown}")
        fixed = sorted(set(self.model_overrides) - set(RUNTIME_MODEL_FIELDS))
        if fixed and self.hf_path is not None:
            raise ValueError(f"{own}.model_overrides sets {fixed}, which the HF directory's config.json "
                             f"fixes (they shape or define its weights); with hf_path only "
                             f"{list(RUNTIME_MODEL_FIELDS)} may be overridden")
        check_int_fields(self, ("mesh_data", "mesh_expert", "mesh_context", "mesh_tensor", "num_steps", "keep_checkpoints",
                                "log_every"), 1)
        check_int(f"{own}.checkpoint_every", self.checkpoint_every, 0)
        check_int(f"{own}.eval_every", self.eval_every, 0)
        check_int(f"{own}.num_devices", self.num_devices, 1, optional=True)
        check_seed(f"{own}.seed", self.seed)   # numpy's default_rng (the task order) rejects negatives
        check_bool_fields(self, ("async_checkpoint", "progress_bar", "tensorboard"))
        if not (isinstance(self.resume, bool) or self.resume == "strict"):
            raise ValueError(f"{own}.resume={self.resume!r}; valid: False, True (fall back past a damaged newest "
                             f"checkpoint) or 'strict' (refuse one)")
        if self.num_devices is not None and self.num_devices != self.mesh_size:
            raise ValueError(f"{own}: mesh_data={self.mesh_data} x mesh_expert={self.mesh_expert} x "
                             f"mesh_context={self.mesh_context} x mesh_tensor={self.mesh_tensor} = "
                             f"{self.mesh_size}, but num_devices="
                             f"{self.num_devices}")
        if self.rollout is not None and (isinstance(self.rollout, str) or not callable(self.rollout)):
            raise ValueError(f"{own}.rollout={self.rollout!r} is not a rollout factory: give a callable "
                             f"fn(experiment_cfg, model_cfg) -> RolloutSource, e.g. @AgenticRollout() "
                             f"(the synthetic workload, once 'workload', is @WorkloadRollout())")
        for k, cls in (("trainer", TrainerConfig), ("loss", LossConfig), ("optimizer", OptimizerConfig)):
            if not isinstance(getattr(self, k), cls):
                raise TypeError(f"{own}.{k} must be a {cls.__name__}, got {type(getattr(self, k)).__name__}")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise TypeError(f"{own}.lora must be a LoraConfig (gin: @LoraConfig()) or None, got "
                            f"{type(self.lora).__name__}")

    @property
    def mesh_size(self) -> int:
        return self.mesh_data * self.mesh_expert * self.mesh_context * self.mesh_tensor


# -- validation (no devices, no allocation) -----------------------------------------------------

# ModelConfig fields that change how a model runs, not its weights: an HF directory's config
# takes them from ExperimentConfig.model_overrides (the long-context configs raise max_seq_len
# past the checkpoint's and set remat and the MoE dispatch's chunking).
RUNTIME_MODEL_FIELDS = ("max_seq_len", "remat", "attention_impl", "attention_block_q", "attention_block_k",
                        "moe_dispatch", "llep_threshold", "moe_chunk_tokens", "grouped_matmul",
                        "router_aux_coef", "router_z_coef", "scan_layers")
_SHAPE_FIELDS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff_expert", "n_experts", "top_k", "d_ff", "dense_layers", "d_ff_shared", "shared_expert_gate")


def resolve_model_config(cfg: ExperimentConfig) -> tuple[ModelConfig, str]:
    """(ModelConfig, where it came from) without reading any weights.

    With `hf_path`, the directory's config.json when it exists (checked against the `model` preset's
    shapes), else the preset stands in for it (validating a config on a machine without the weights).
    """
    preset = ModelConfig.preset(cfg.model, **cfg.model_overrides) if cfg.model else None
    if cfg.hf_path is None:
        return preset, f"preset {cfg.model!r}"
    config_json = Path(cfg.hf_path) / "config.json"
    if not config_json.exists():
        if preset is None:
            raise FileNotFoundError(f"ExperimentConfig.hf_path={cfg.hf_path!r} has no config.json and no "
                                    "ExperimentConfig.model preset names its shapes")
        return preset, f"preset {cfg.model!r} (standing in for {cfg.hf_path}, not found here)"
    from sfrrl_jax.checkpoints.hf import config_from_hf, read_hf_config
    hf_cfg = config_from_hf(read_hf_config(cfg.hf_path), dtype=cfg.hf_dtype, where=str(config_json))
    # a real model's layer layout fits the backend unless the run says: per-layer on CPU, where a
    # scan over stacked weights copies each layer's slice before its matmuls (issue #44)
    hf_cfg = hf_cfg.replace(scan_layers=default_scan_layers())
    hf_cfg = hf_cfg.replace(**cfg.model_overrides)   # run-time fields only (checked by ExperimentConfig)
    if preset is not None:
        check_same_shapes(preset, hf_cfg, f"ExperimentConfig.model={cfg.model!r}", str(config_json))
    return hf_cfg, str(config_json)


def default_scan_layers() -> bool:
    """The layer layout (`ModelConfig.scan_layers`) an HF model runs in when
    `ExperimentConfig.model_overrides` does not say: per-layer (False) on a CPU backend, where
    XLA copies a stacked layer's weights out before each matmul (decode ~1.35x slower on
    SmolLM2-135M); stacked (True) elsewhere (compile time independent of depth)."""
    return jax.default_backend() != "cpu"


def check_same_shapes(expected: ModelConfig, got: ModelConfig, expected_name: str, got_name: str) -> None:
    diffs = [f"{k}: {getattr(expected, k)!r} vs {getattr(got, k)!r}" for k in _SHAPE_FIELDS
             if getattr(expected, k) != getattr(got, k)]
    if diffs:
        raise ValueError(f"{got_name} does not have the shapes of {expected_name}: " + "; ".join(diffs)
                         + " (set ExperimentConfig.model=None to skip this check)")


def validate_experiment(cfg: ExperimentConfig, num_devices: int | None = None) -> ModelConfig:
    """Checks that the pieces of `cfg` fit together; returns the ModelConfig. Allocates nothing.

    num_devices: the devices the run will have (default `cfg.num_devices`, else this process's
    `jax.device_count()`).
    """
    n = num_devices if num_devices is not None else cfg.num_devices
    n = n if n is not None else jax.device_count()
    if cfg.mesh_size != n:
        raise ValueError(f"ExperimentConfig mesh data={cfg.mesh_data} x expert={cfg.mesh_expert} x "
                         f"context={cfg.mesh_context} x tensor={cfg.mesh_tensor} = {cfg.mesh_size} devices, "
                         f"but the run has {n}")
    model_cfg, _ = resolve_model_config(cfg)
    if model_cfg.n_experts % cfg.mesh_expert:
        raise ValueError(f"ModelConfig.n_experts={model_cfg.n_experts} ({model_cfg.name}) is not divisible "
                         f"by ExperimentConfig.mesh_expert={cfg.mesh_expert}")
    if cfg.trainer.max_len > model_cfg.max_seq_len:
        raise ValueError(f"TrainerConfig.max_len={cfg.trainer.max_len} > ModelConfig.max_seq_len="
                         f"{model_cfg.max_seq_len} ({model_cfg.name})")
    axis = cfg.optimizer.state_shard_axis
    if axis is not None and axis not in MESH_AXES:
        raise ValueError(f"OptimizerConfig.state_shard_axis={axis!r}; valid: {list(MESH_AXES)} or None")
    if cfg.rollout is None:   # checked here, not at construction: a config may be built up in steps
        raise ValueError("ExperimentConfig.rollout is not set: give the run its rollout factory, "
                         "@AgenticRollout() (launch.agentic: a task set through the agent loop) or "
                         "@WorkloadRollout() (testing.workload: the synthetic long-tail workload)")
    if cfg.lora is not None:
        adapted_leaves(model_cfg, cfg.lora)   # raises naming a target this model does not have
        check_trainable(cfg.lora)
    check = getattr(cfg.rollout, "validate", None)   # the rollout factory's own checks
    if check is not None:
        check(cfg, model_cfg)
    return model_cfg


# -- building ------------------------------------------------------------------------------------

def build_rollout_source(cfg: ExperimentConfig, model_cfg: ModelConfig) -> RolloutSource:
    """Calls `cfg.rollout(cfg, model_cfg)` and checks it returned a `RolloutSource` (TypeError if not)."""
    source = cfg.rollout(cfg, model_cfg)
    if not isinstance(source, RolloutSource):
        raise TypeError(f"ExperimentConfig.rollout factory {cfg.rollout!r} returned a "
                        f"{type(source).__name__}, expected a RolloutSource")
    return source


def abstract_params_and_opt_state(model_cfg: ModelConfig, mesh, optimizer_cfg: OptimizerConfig, train_step,
                                  lora: LoraConfig | None = None):
    """Restore targets (shape, dtype, sharding) of params and optimizer state: nothing allocated.
    With `lora`, the trained params are the adapter (a `LoraAdapter` of ShapeDtypeStructs)."""
    if lora is None:
        shardings = param_shardings(model_cfg, mesh)
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              param_shapes(model_cfg), shardings)
    else:
        params = LoraAdapter(jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                          adapter_shapes(model_cfg, lora), adapter_shardings(model_cfg, lora, mesh)),
                             lora)
    opt_sh = opt_state_shardings(train_step.tx, params, optimizer_cfg)
    opt_shapes = OptState(step=jax.ShapeDtypeStruct((), np.int32),
                          inner=jax.eval_shape(train_step.tx.init, params))
    opt = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_shapes, opt_sh)
    return params, opt


def _fresh_params(cfg: ExperimentConfig, model_cfg: ModelConfig, mesh):
    if cfg.hf_path is None:
        return init_params(model_cfg, mesh, seed=cfg.seed)
    from sfrrl_jax.checkpoints.hf import load_hf
    loaded_cfg, params = load_hf(cfg.hf_path, mesh, dtype=cfg.hf_dtype, scan_layers=model_cfg.scan_layers)
    check_same_shapes(model_cfg, loaded_cfg, "the validated config", cfg.hf_path)
    # nan weights would make every update non-finite, and the train step skips those: a run that
    # "finishes" having learnt nothing. Say which tensors instead.
    check_finite({"params": params}, f"the HF checkpoint {cfg.hf_path}")
    return params


class RunDirError(RuntimeError):
    """The run dir holds an earlier run and this one was not asked to resume it."""


def earlier_run_outputs(run_dir: Path) -> list[str]:
    """What in `run_dir` belongs to an earlier run: a non-empty metrics.jsonl, checkpoint entries."""
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        names = sorted(p.name for p in ckpts.iterdir())
        if names:
            found.append(f"checkpoints/ ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
    return found


def check_run_dir(cfg: ExperimentConfig) -> None:
    """Refuses a new (not resumed) run in a dir holding an earlier run's metrics or checkpoints."""
    found = earlier_run_outputs(Path(cfg.run_dir))
    if found and not cfg.resume:
        raise RunDirError(
            f"ExperimentConfig.run_dir={str(cfg.run_dir)!r} already holds an earlier run ({'; '.join(found)}); "
            "a new run there would append to its metrics and collide with its checkpoints. Either continue "
            "it with --resume (ExperimentConfig.resume=True), or give a new or empty --run_dir")


def _drop_metrics_after(path: Path, first_redone_step: int) -> int:
    """Keeps rows of steps before `first_redone_step` (and drops a half-written last line)."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if row.get("step", -1) < first_redone_step:
            kept.append(line)
        else:
            dropped += 1
    path.write_text("".join(k + "\n" for k in kept))
    return dropped


def run_fingerprint(cfg: ExperimentConfig, model_cfg: ModelConfig) -> dict:
    """The configs that decide what the run computes (not how long, how often it logs, ...)."""
    mesh = [cfg.mesh_data, cfg.mesh_expert, cfg.mesh_tensor]
    if cfg.mesh_context > 1:   # appended only when used, so runs from before the axis still resume
        mesh.append(["context", cfg.mesh_context])
    # lora only when set, so runs from before it still resume
    lora = {} if cfg.lora is None else {"lora": cfg.lora}
    return config_fingerprint(model=model_cfg, trainer=cfg.trainer, loss=cfg.loss,
                              optimizer=cfg.optimizer, seed=cfg.seed, mesh=mesh,
                              rollout=repr(cfg.rollout), **lora)


# -- the run -------------------------------------------------------------------------------------

def run_experiment(cfg: ExperimentConfig, operative_config: str | None = None,
                   log: Callable[[str], None] = print) -> dict:
    """Runs (or resumes) the experiment up to `cfg.num_steps`; returns the summary (also summary.json)."""
    t_run = time.perf_counter()
    primary = jax.process_index() == 0
    run_dir = Path(cfg.run_dir)
    check_run_dir(cfg)   # before anything is written there
    run_dir.mkdir(parents=True, exist_ok=True)
    model_cfg = validate_experiment(cfg, jax.device_count())
    mesh = make_mesh(data=cfg.mesh_data, expert=cfg.mesh_expert, tensor=cfg.mesh_tensor,
                     context=cfg.mesh_context)
    check_mesh_fits(model_cfg, mesh)
    source = build_rollout_source(cfg, model_cfg)
    fingerprint = run_fingerprint(cfg, model_cfg)
    train_step = shared_train_step(model_cfg, cfg.loss, cfg.optimizer)
    ckpt = Checkpointer(run_dir / "checkpoints", save_every=cfg.checkpoint_every,
                        keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoint)

    restored = None
    if cfg.resume:
        abstract = dict(zip(("params", "opt_state"),
                            abstract_params_and_opt_state(model_cfg, mesh, cfg.optimizer, train_step, cfg.lora)))
        # raises when checkpoints exist but none restores; nan/inf weights count as damage (training
        # from them would skip every update)
        restored = ckpt.restore_latest(abstract, strict=cfg.resume == "strict")
    if restored is not None:
        step0, state, host = restored
        check_resumable(host, fingerprint, len(source.tasks), f"checkpoint step {step0} in {ckpt.directory}")
        params, opt_state = state["params"], state["opt_state"]
        if cfg.lora is not None:   # the checkpoint holds the adapter; the base is read again
            params = AdaptedParams(_fresh_params(cfg, model_cfg, mesh), params)
    else:
        params, opt_state = _fresh_params(cfg, model_cfg, mesh), None
        if cfg.lora is not None:
            params = AdaptedParams(params, init_adapter(model_cfg, cfg.lora, mesh, seed=cfg.seed))
    # Written once the run is known to go ahead: a refused resume leaves the run's own config.
    if operative_config is not None and primary:
        (run_dir / "operative_config.gin").write_text(operative_config)

    trainer = RLTrainer(model_cfg, params, cfg.trainer, cfg.loss, cfg.optimizer, source.rollout_fn,
                        TaskStream(source.tasks, seed=cfg.seed), expected_length=source.expected_length,
                        opt_state=opt_state)
    if restored is not None:
        load_trainer_state(trainer, state, host, source.stateful)
        dropped = _drop_metrics_after(run_dir / "metrics.jsonl", trainer.step_index) if primary else 0
        log(f"resumed from checkpoint step {step0} (data epoch {trainer.tasks.epoch}, index "
            f"{trainer.tasks.index}); {dropped} metrics rows after it dropped")
    elif cfg.resume:
        # No checkpoint was ever finished here: the run starts at step 0, so rows an earlier
        # attempt logged (killed before its first save) are redone and would appear twice.
        dropped = _drop_metrics_after(run_dir / "metrics.jsonl", 0) if primary else 0
        log(f"resume: no checkpoint in {ckpt.directory}; starting at step 0"
            + (f" ({dropped} metrics rows of an earlier attempt dropped: they are redone)" if dropped else ""))
    start_step = trainer.step_index
    run_log = RunLogger(run_dir, tensorboard=cfg.tensorboard) if primary else None
    stop = (install_sigterm_handler(signals=(signal.SIGTERM, signal.SIGINT))
            if threading.current_thread() is threading.main_thread() else None)
    save_times: list[dict] = []
    last_saved = start_step if restored is not None else None
    last = {}

    def save(force: bool) -> dict:
        nonlocal last_saved
        step = trainer.step_index
        if last_saved == step or not ckpt.should_save(step, force):
            return {}
        # The previous save must be final before the next starts (orbax would wait too); the wait
        # is part of this save's stall, and it is when the previous save's total is known.
        t0 = time.perf_counter()
        ckpt.wait()
        waited = time.perf_counter() - t0
        out = finished_total()
        state, host = trainer_state(trainer, source.stateful, fingerprint)
        ckpt.maybe_save(step, state, host, force=force)
        last_saved = step
        blocking = waited + ckpt.last_save_metrics.get("blocking_s", math.nan)
        save_times.append({"step": step, "blocking_s": blocking, "waited_s": waited})
        return {**out, "checkpoint/step": step, "checkpoint/blocking_s": blocking}

    def finished_total() -> dict:
        """total_s of the newest save, once its writer has reported it (async)."""
        m = ckpt.last_save_metrics
        if save_times and "total_s" in m and m.get("step") == save_times[-1]["step"] \
                and "total_s" not in save_times[-1]:
            total = save_times[-1]["total_s"] = save_times[-1]["waited_s"] + m["total_s"]
            return {"checkpoint/total_s": total, "checkpoint/total_step": save_times[-1]["step"]}
        return {}

    held = (HeldOutRuns(source.held_out, cfg.eval_every, run_log, run_dir, log)
            if source.held_out is not None else None)
    if held is not None:
        held.check(trainer)
        if restored is None and start_step < cfg.num_steps:
            held.evaluate(trainer, "before")
    bar = _progress(cfg, start_step, primary)
    stopped_by = None
    ok = False
    try:
        while trainer.step_index < cfg.num_steps:
            # (a resumed run redoes an evaluation at its first step: the row was dropped with the step's)
            if held is not None and held.due(trainer.step_index, last=False):
                held.evaluate(trainer, f"step_{trainer.step_index}")
            metrics = trainer.step()
            metrics.update(finished_total())   # an earlier async save that has finished by now
            metrics.update(save(force=False))
            index = metrics["step"]
            if run_log is not None and (index % cfg.log_every == 0 or trainer.step_index == cfg.num_steps):
                run_log.log(index, metrics)
            last = metrics
            bar.update(1)
            bar.set_postfix({"reward": f"{metrics['reward/mean']:.3f}",
                             "loss": f"{metrics.get('train/loss', math.nan):.4f}"}, refresh=False)
            signum = stop.signum if stop is not None and stop.stop_if_requested() else None
            if trainer.multi_process and jax.process_count() > 1:
                # a signal may reach one process only: all stop at the same step (the save is collective)
                signum = next((s for s in trainer.agreement.allgather(signum) if s is not None), None)
            if signum is not None:
                stopped_by = signum
                log(f"signal {stopped_by} received: saving step {trainer.step_index} and stopping")
                break
        ok = True
    finally:
        bar.close()
        if stop is not None:
            stop.uninstall()
        if ok:   # a step that raised leaves the trainer mid-step: the last saved step stands
            save(force=True)
            if held is not None and stopped_by is None and held.due(trainer.step_index, last=True):
                held.evaluate(trainer, "after")
        try:
            ckpt.close()
            finished_total()
        finally:
            if run_log is not None:
                run_log.close()
    adapter_dir = None
    if cfg.lora is not None and trainer.step_index == cfg.num_steps:
        # a finished LoRA run leaves its adapter as a PEFT directory too (every process gathers, one writes)
        from sfrrl_jax.checkpoints.hf import save_adapter
        adapter_dir = str(save_adapter(trainer.params.adapter, model_cfg, run_dir / "adapter"))
    timeline = run_log.write_timeline(trainer.timeline) if run_log is not None else {}
    summary = {
        "run_dir": str(run_dir), "start_step": start_step, "steps_done": trainer.step_index,
        "num_steps": cfg.num_steps, "resumed_from": step0 if restored is not None else None,
        "stopped_by_signal": stopped_by, "checkpoints": ckpt.finished_steps(), "checkpoint_saves": save_times,
        "final_metrics": {k: v for k, v in last.items() if isinstance(v, (int, float))},
        "wall_s": time.perf_counter() - t_run, "metrics_path": str(run_dir / "metrics.jsonl"),
        "timeline": timeline, "model": model_cfg.name, "devices": jax.device_count(),
        **({"adapter_dir": adapter_dir} if adapter_dir is not None else {}),
        **(held.summary() if held is not None and primary else {}),
    }
    if primary:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True, default=str))
    return summary


def _progress(cfg: ExperimentConfig, start: int, primary: bool):
    from tqdm.auto import tqdm
    return tqdm(total=cfg.num_steps, initial=start, desc="rl steps", unit="step",
                disable=not (cfg.progress_bar and primary), dynamic_ncols=True)


def comparable_metrics(row: dict) -> dict:
    """A metrics row without the timing/process keys (TIMING_PREFIXES): what a resume must reproduce."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}
