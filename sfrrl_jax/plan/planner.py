"""The memory planner: per-device peak of every phase of an RL step, from compiled step functions.

    plan = plan_memory(PlanInputs(model_cfg, mesh, trainer_cfg, loss_cfg, optimizer_cfg), PlanConfig())
    print(plan.to_markdown())       # per-phase peak, breakdown, verdict against the device memory

A phase is one jitted function of the run, lowered with abstract inputs (`plan.abstract`: shapes
and the run's shardings, nothing allocated) and compiled for the mesh's devices:

  train_micro   TrainStep's micro-step: forward, chunked LM-head log-probs, loss, backward, + acc
  deferred      the advantage-deferred micro-step (only with TrainerConfig.early_groups > 0)
  apply         the optimizer update (params, optimizer state donated)
  prefill       the engine's prefill of the largest prompt bucket
  append        append-prefill of the largest bucket into a parked slot (a tool observation)
  decode        one decode chunk (decode_steps tokens for every slot)

Per device, XLA's `compiled.memory_analysis()` gives the call's arguments, outputs, the outputs
aliased to donated arguments, and temps (activations, the backward's saved residuals, collective
buffers). Peak during a call = arguments (in device memory) + temps + outputs not aliased; plus
what stays alive on the device between calls without being an argument of this one (`resident`):

  optimizer state   always (device part; an offloaded one lives in pinned_host, reported apart)
  accumulator       during the rollout: the trainer allocates it when a step begins, in every mode
                    (trainer.step_schedule `begin`); with OptimizerConfig.offload_accumulator it
                    waits in host memory between micro-steps
  KV cache          during micro-steps in 'pipelined' / 'one_step_off' (they run while the engine
                    holds its cache; with TrainerConfig.swap_cache it waits in host memory
                    then); freed before the optimizer update
  deferred buffers  early_groups x 2-3 param-sized float32 group buffers, rollout and micro-steps

Arguments are split by name with the per-device shard bytes of their abstract inputs; XLA's
argument total that our parts do not explain is shown as 'other arguments'. Host-memory
arguments (offloaded optimizer state): XLA:CPU counts pinned_host arguments as device ones, so
the planner subtracts the host bytes its own shardings place there.
Units: GB = 1e9 bytes (the 141 GB of an H200), per device.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from sfrrl_jax.checks import check_bool, check_int, check_number
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.pages import check_paging, group_pages
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.models.lora import LoraConfig
from sfrrl_jax.plan.abstract import (GB, TrainSetup, device_bytes, engine_abstract, host_bytes, microbatch,
                                     request_abstract, shard_bytes)
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.trainer.config import TrainerConfig

ALL_PHASES = ("train_micro", "deferred", "apply", "prefill", "append", "decode")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What to plan, beyond the run's own configs (all optional).

    device_memory_gb: memory of one device (GB = 1e9 bytes; H200: 141).
    reserve_gb: memory the runtime keeps for itself (CUDA context, NCCL/cuBLAS workspaces) that no
      compiled step accounts for; subtracted from device_memory_gb for the verdict.
    microbatch_rows / microbatch_len: the micro-batch trained (default: TrainerConfig.microbatch_rows,
      else groups_per_microbatch x group_size rows, of TrainerConfig.max_len tokens: the longest a
      micro-batch can be).
    prefill_len: prompt bucket planned for prefill/append (default: TrainerConfig.buckets' last,
      else max_len).
    page_size / num_pages: plan a paged KV cache (engine.paged); None = what the trainer builds
      (TrainerConfig.page_size / num_pages: dense unless set).
    phases: which phases to compile (subset of ALL_PHASES; 'deferred' only runs with early_groups).
    bf16_as_f16: compile a bfloat16 model (params, compute, KV cache) as float16: the same bytes
      everywhere, planned as a GPU holds them. XLA:CPU has no bf16 arithmetic: its
      float-normalization pass widens every bf16 dot, scatter and dynamic-update-slice to f32,
      and loop-invariant code motion then hoists whole f32 copies of the weight stacks, the KV
      cache and the saved layer inputs out of the layer loops (gpt-oss-120b at 1M: 117 GB of a
      decode chunk's temp, 7.3 as f16); f16 it runs natively, as a GPU runs bf16. False plans
      what XLA:CPU itself would allocate (a CPU run: the calibration).
    """

    device_memory_gb: float = 141.0
    reserve_gb: float = 0.0
    microbatch_rows: int | None = None
    microbatch_len: int | None = None
    prefill_len: int | None = None
    page_size: int | None = None
    num_pages: int | None = None
    phases: tuple[str, ...] = ALL_PHASES
    bf16_as_f16: bool = True

    def __post_init__(self):
        own = "PlanConfig"
        check_number(f"{own}.device_memory_gb", self.device_memory_gb, 0, lo_open=True)
        check_number(f"{own}.reserve_gb", self.reserve_gb, 0)
        check_bool(f"{own}.bf16_as_f16", self.bf16_as_f16)
        for k in ("microbatch_rows", "microbatch_len", "prefill_len", "page_size", "num_pages"):
            check_int(f"{own}.{k}", getattr(self, k), 1, optional=True)
        object.__setattr__(self, "phases", tuple(self.phases))
        bad = sorted(set(self.phases) - set(ALL_PHASES))
        if bad:
            raise ValueError(f"{own}.phases has unknown phases {bad}; valid: {list(ALL_PHASES)}")


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """The run's configs and its mesh (over real or fake devices: compile needs device objects)."""

    model_cfg: ModelConfig
    mesh: Any
    trainer: TrainerConfig
    loss: LossConfig
    optimizer: OptimizerConfig
    source: str = ""   # where the configs came from (a gin file), for the report
    lora: LoraConfig | None = None   # a LoRA run (ExperimentConfig.lora): the adapter trained, the base frozen


@dataclasses.dataclass
class Phase:
    """One compiled phase, per device. XLA's numbers plus our named parts and residents (bytes)."""

    name: str
    what: str
    argument: int
    output: int
    alias: int
    temp: int
    arg_parts: dict          # named argument bytes in device memory (sum <= argument)
    host_arguments: int      # argument bytes in host memory (offloaded state)
    resident: dict           # live on the device between calls, not arguments of this one
    compile_s: float
    flops: float | None = None
    # output bytes in host memory (an offloaded optimizer state returned by the update): XLA:CPU
    # counts them among the outputs; they take no device memory
    host_outputs: int = 0
    compiled: Any = dataclasses.field(default=None, repr=False)   # the executable (calibration runs it)

    @property
    def device_arguments(self) -> int:
        # jit drops arguments the function never reads (keep_unused=False), so XLA's total can be
        # below our parts; those buffers are still alive (the caller holds them): count the larger.
        return max(self.argument - self.host_arguments, sum(self.arg_parts.values()))

    @property
    def device_outputs(self) -> int:
        """Output bytes not aliased to an argument, in device memory."""
        return max(0, self.output - self.alias - self.host_outputs)

    @property
    def peak(self) -> int:
        return self.device_arguments + self.temp + self.device_outputs + sum(self.resident.values())

    def breakdown(self) -> dict:
        """{item: bytes} summing to `peak`."""
        out = dict(self.arg_parts)
        other = self.device_arguments - sum(self.arg_parts.values())
        if other:
            out["other arguments"] = other
        out["XLA temp"] = self.temp
        if self.device_outputs:
            out["outputs (not aliased)"] = self.device_outputs
        for k, v in self.resident.items():
            out[f"{k} (resident)"] = v
        return out


@dataclasses.dataclass
class Plan:
    """The memory plan of a run: every compiled phase's per-device peak, and what lives between calls.

    `to_markdown()` renders the report (per-phase peak, breakdown, verdict against the device memory); `to_dict()`
    the same figures as JSON-able values (GB = 1e9 bytes).

    Attributes:
      inputs: the run's configs and mesh that were planned.
      config: what was planned (`PlanConfig`: device memory, reserve, shapes, phases).
      phases: the compiled `Phase`s, in `ALL_PHASES` order (those asked for and that apply).
      static: per-device bytes of what lives between calls: 'params', 'optimizer state (device)',
        'optimizer state (pinned_host)', 'accumulator (f32 grads)', 'KV cache', 'deferred buffers'.
      shapes: the micro-batch and engine shapes planned (micro-batch [rows, length], mode, max_slots, max_len,
        prefill_len, decode_steps, paging, mesh, early_groups, swap_cache).
      setup_s: seconds spent building the abstract inputs before compiling.
      budget: (property) the bytes a phase may peak at: device_memory_gb - reserve_gb, in bytes.
      peak: (property) the largest phase peak, in bytes (0 with no phase).
      fits: (property) whether every phase's peak is within `budget`.
      compile_s: (property) the phases' total compile seconds.
    """

    inputs: PlanInputs
    config: PlanConfig
    phases: list
    static: dict             # per-device bytes of what lives between calls
    shapes: dict             # micro-batch / engine shapes planned
    setup_s: float

    @property
    def budget(self) -> float:
        return (self.config.device_memory_gb - self.config.reserve_gb) * GB

    @property
    def peak(self) -> int:
        return max((p.peak for p in self.phases), default=0)

    @property
    def fits(self) -> bool:
        return all(p.peak <= self.budget for p in self.phases)

    @property
    def compile_s(self) -> float:
        return sum(p.compile_s for p in self.phases)

    def to_dict(self) -> dict:
        return {"fits": self.fits, "peak_gb": self.peak / GB, "budget_gb": self.budget / GB,
                "compile_s": self.compile_s, "setup_s": self.setup_s, "shapes": self.shapes,
                "static_gb": {k: v / GB for k, v in self.static.items()},
                "phases": [{"name": p.name, "peak_gb": p.peak / GB, "compile_s": p.compile_s,
                            "flops": p.flops, "breakdown_gb": {k: v / GB for k, v in p.breakdown().items()},
                            "xla": {"argument": p.argument, "output": p.output, "alias": p.alias,
                                    "temp": p.temp}} for p in self.phases]}

    def to_markdown(self) -> str:
        from sfrrl_jax.plan.report import plan_markdown
        return plan_markdown(self)


def _compile(fn: Callable, mesh, *args) -> tuple[Any, float]:
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 -- a backend without cost analysis: the plan stands without it
        return None
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    return float(cost.get("flops", 0.0)) if isinstance(cost, dict) else None


def _phase(name, what, compiled, compile_s, args: dict, resident: dict) -> Phase:
    ma = compiled.memory_analysis()
    parts = {k: device_bytes(v) for k, v in args.items()}
    host = sum(host_bytes(v) for v in args.values())
    return Phase(name, what, int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                 int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes),
                 {k: v for k, v in parts.items() if v}, host, {k: v for k, v in resident.items() if v},
                 compile_s, _flops(compiled), host_bytes(compiled.out_info), compiled)


def _paging(tc: TrainerConfig, cfg: PlanConfig) -> tuple:
    """(page_size, num_pages): PlanConfig's if set, else the trainer's own (TrainerConfig.page_size)."""
    if cfg.page_size is not None:
        return cfg.page_size, cfg.num_pages
    return getattr(tc, "page_size", None), getattr(tc, "num_pages", None)


def microbatch_shape(trainer: TrainerConfig, cfg: PlanConfig) -> tuple[int, int]:
    rows = cfg.microbatch_rows or trainer.microbatch_rows or trainer.groups_per_microbatch * trainer.group_size
    length = cfg.microbatch_len or -(-trainer.max_len // trainer.seq_bucket) * trainer.seq_bucket
    return rows, length


def compiled_model_cfg(model_cfg: ModelConfig, cfg: PlanConfig) -> ModelConfig:
    """The model config the planner compiles: bfloat16 fields as float16 with cfg.bf16_as_f16."""
    if not cfg.bf16_as_f16:
        return model_cfg
    swap = {k: "float16" for k in ("param_dtype", "compute_dtype") if getattr(model_cfg, k) == "bfloat16"}
    return model_cfg.replace(**swap) if swap else model_cfg


def plan_memory(inputs: PlanInputs, cfg: PlanConfig = PlanConfig(), log: Callable[[str], None] | None = None) -> Plan:
    """Compiles the phases in `cfg.phases` for `inputs` and returns the Plan (see the module doc).

    Inputs are abstract (shapes and the run's shardings): nothing the size of the model is allocated.

    Args:
      inputs: the run's configs and its mesh (over real or fake devices).
      cfg: what to plan beyond the run's configs (default `PlanConfig()`: an H200's 141 GB, every phase).
      log: called with one line of progress per phase compiled (None: silent).
    Returns:
      The `Plan`.
    Raises:
      ValueError: when the micro-batch length exceeds `ModelConfig.max_seq_len`.
    """
    say = log or (lambda s: None)
    t0 = time.perf_counter()
    model_cfg, mesh, tc = compiled_model_cfg(inputs.model_cfg, cfg), inputs.mesh, inputs.trainer
    setup = TrainSetup.build(model_cfg, mesh, inputs.loss, inputs.optimizer, inputs.lora)
    fns = setup.train_step._fns(setup.params)
    rows, length = microbatch_shape(tc, cfg)
    if length > model_cfg.max_seq_len:
        raise ValueError(f"micro-batch length {length} (TrainerConfig.max_len / PlanConfig.microbatch_len) > "
                         f"ModelConfig.max_seq_len={model_cfg.max_seq_len}")
    mb = microbatch(setup, rows, length)
    want = set(cfg.phases)
    engine_phases = want & {"prefill", "append", "decode"}
    steps = state = None
    if engine_phases:
        steps, state = engine_abstract(model_cfg, mesh, tc.engine_slots, tc.max_len, tc.buckets,
                                       *_paging(tc, cfg), tc.decode_steps)
    # The engine always adds max_len as a last bucket, but only a prompt that long would use it:
    # plan the largest bucket the config names (a longer prompt is the caller's choice to plan).
    prefill_len = cfg.prefill_len or (tc.buckets[-1] if tc.buckets else tc.max_len)
    deferred = None
    if tc.early_groups and "deferred" in want:
        deferred = setup.deferred_buffer()
    static = {
        "params": device_bytes(setup.params),
        "optimizer state (device)": device_bytes(setup.opt_state),
        "optimizer state (pinned_host)": host_bytes(setup.opt_state),
        "accumulator (f32 grads)": device_bytes(setup.acc),
        "KV cache": device_bytes(state) if state is not None else 0,
        "deferred buffers": tc.early_groups * (device_bytes(deferred) if deferred is not None else
                                               setup.deferred_param_copies() * device_bytes(setup.acc.grads)),
    }
    opt_dev, cache, dfr, acc_b = (static["optimizer state (device)"], static["KV cache"],
                                  static["deferred buffers"], static["accumulator (f32 grads)"])
    # offload_accumulator: between micro-steps (the rollout) the sums wait in host memory
    acc_between = 0 if inputs.optimizer.offload_accumulator else acc_b
    overlap = tc.mode in ("pipelined", "one_step_off")
    page_size, num_pages = _paging(tc, cfg)
    paged_groups = None
    if page_size is not None:
        # groups of G whose prompt (prefill_len tokens) and turns fill max_len that the pool holds
        # at once: a group's prompt pages are held once (`Engine(share_prompts=True)`), or G times
        pool = check_paging(page_size, num_pages, tc.max_len, tc.engine_slots).num_pages
        paged_groups = {"group_size": tc.group_size, **{
            k: pool // group_pages(min(prefill_len, tc.max_len), tc.max_len, tc.group_size, page_size, shared)
            for k, shared in (("shared", True), ("unshared", False))}}
    shapes = {"microbatch": [rows, length], "mode": tc.mode, "max_slots": tc.engine_slots, "max_len": tc.max_len,
              "prefill_len": prefill_len, "decode_steps": tc.decode_steps,
              "paging": None if page_size is None else [page_size, num_pages], "paged_groups": paged_groups,
              "mesh": dict(mesh.shape), "early_groups": tc.early_groups, "swap_cache": tc.swap_cache,
              "lora": None if inputs.lora is None else {
                  "rank": inputs.lora.rank, "targets": list(inputs.lora.targets),
                  "adapter_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(setup.trained))}}
    setup_s = time.perf_counter() - t0
    phases = []
    train_resident = {"optimizer state": opt_dev, "KV cache": cache if overlap and not tc.swap_cache else 0,
                      "deferred buffers": dfr}

    if "train_micro" in want:
        say(f"compiling train_micro [{rows} x {length}] ...")
        c, s = _compile(fns["micro"], mesh, setup.trained, setup.frozen, setup.acc, mb)
        phases.append(_phase("train_micro", f"grad micro-step, micro-batch [{rows} x {length}] tokens", c, s,
                             {"params": setup.params, "accumulator": setup.acc, "micro-batch": mb},
                             train_resident))
    if deferred is not None:
        say("compiling deferred ...")
        dfns = setup.train_step._deferred(setup.params)
        c, s = _compile(dfns["micro"], mesh, setup.trained, setup.frozen, deferred, mb, np.float32(0.0))
        # one of the early_groups buffers is this call's argument; the others stay resident
        res = dict(train_resident, **{"deferred buffers": dfr - device_bytes(deferred)})
        phases.append(_phase("deferred", f"advantage-deferred micro-step [{rows} x {length}]", c, s,
                             {"params": setup.params, "group buffer": deferred, "micro-batch": mb},
                             dict(res, accumulator=acc_between)))
    if "apply" in want:
        say("compiling apply ...")
        c, s = _compile(fns["apply"], mesh, setup.trained, setup.opt_state, setup.acc)
        # a LoRA run updates its adapter; the frozen base stays resident beside the call
        frozen = {} if setup.frozen is None else {"frozen base params": device_bytes(setup.frozen)}
        phases.append(_phase("apply", "optimizer update (KV cache freed before it)", c, s,
                             {"params": setup.trained, "optimizer state": setup.opt_state,
                              "accumulator": setup.acc}, frozen))
    if steps is not None:
        rollout = {"optimizer state": opt_dev, "accumulator": acc_between, "deferred buffers": dfr}
        req = request_abstract()
        tokens = jax.ShapeDtypeStruct((1, prefill_len), np.int32)
        scalar = jax.ShapeDtypeStruct((), np.int32)
        if "prefill" in want:
            say(f"compiling prefill [{prefill_len}] ...")
            c, s = _compile(steps._prefill, mesh, setup.params, tokens, scalar, req)
            phases.append(_phase("prefill", f"prefill of a {prefill_len}-token prompt", c, s,
                                 {"params": setup.params}, dict(rollout, **{"KV cache": cache})))
        if "append" in want:
            say(f"compiling append [{prefill_len}] ...")
            c, s = _compile(steps._append, mesh, setup.params, state, scalar, tokens, scalar, req)
            phases.append(_phase("append", f"append-prefill of {prefill_len} tokens into a slot", c, s,
                                 {"params": setup.params, "KV cache": state}, rollout))
        if "decode" in want:
            say(f"compiling decode [{tc.engine_slots} slots x {tc.decode_steps} steps] ...")
            # the largest decode bucket: the chunk that reads the whole cache
            c, s = _compile(steps._generate, mesh, setup.params, state, tc.decode_steps, steps.max_len)
            phases.append(_phase("decode", f"decode chunk: {tc.engine_slots} slots x {tc.decode_steps} tokens, "
                                 f"cache {tc.max_len} tokens/slot", c, s,
                                 {"params": setup.params, "KV cache": state}, rollout))
    return Plan(inputs, cfg, phases, static, shapes, setup_s)
