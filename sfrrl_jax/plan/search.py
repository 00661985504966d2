"""Search: which (mesh, remat policy, micro-batch rows) fit a model on N devices, best first.

    results = search(model_cfg, n_devices, trainer_cfg, loss_cfg, optimizer_cfg, PlanConfig(...),
                     SearchSpace(), limit=8)
    print(search_markdown(results, model_cfg, n_devices, plan_cfg))

Candidates: every mesh data x expert x context x tensor = N (expert dividing n_experts, tensor
dividing n_kv_heads: a tensor split the KV heads cannot take leaves attention replicated; with
latent attention, whose cache is one head, n_heads), every
remat policy of `SearchSpace.remats`, every micro-batch row count of `SearchSpace.rows` (default:
1, 2, 4, ... up to the trainer's micro-batch rows), at the trainer's length.

1. A static bound, no compile: what the micro-step holds at the least, per device, from the
   shardings (exact): params + float32 accumulator + the gradient pytree in the params' dtype
   (jax.grad returns it whole before it is summed) + optimizer state on the device + the KV
   cache when micro-steps overlap the rollout (unless TrainerConfig.swap_cache parks it in host
   memory then). Candidates above the budget are rejected here.
2. The rest, grouped by (mesh, rows), are compiled group by group in the order of a prior
   (below), `limit` compiles in all (the train micro-step only: the phase that decides
   long-context fits; run `sfrrl-plan` on the winner for every phase). In a group remat='full'
   compiles first: it keeps the least, so where it does not fit no policy does and the group
   is skipped after one compile; where it fits, the other policies follow from the least
   recompute up, until one fits. A compiled candidate fits if its micro-step peak is within the
   budget.
3. Fitting candidates are ranked by the **estimate: XLA's FLOPs per device per trained token of the
   micro-step** (`compiled.cost_analysis()`), lowest first. It counts remat's recomputation and
   work repeated on devices that hold the same rows (a row count below the batch axes, or
   tensor=1 with replicated attention); it does not model communication or kernel efficiency.
   Ties go to the lower peak.
   The prior for step 2 is the same quantity guessed without compiling: (devices holding the
   same tokens: data's replicas when the rows do not split over it; `expert` splits the rows or
   else the sequence, `context` the sequence) x (remat recompute factor: none 1,
   dots_attention_out 1.1, attention_out 1.25, dots 1.25, dots_no_batch 1.3, full 1.35).
4. The memory switches are not searched (each changes the run: transfers per micro-step); when
   nothing fits, the report names those left off (`TrainerConfig.swap_cache`,
   `OptimizerConfig.offload_state`) and what they would take off the best static bound.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import jax

from sfrrl_jax.config import ModelConfig, Remat
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.plan.abstract import TrainSetup, device_bytes, engine_abstract
from sfrrl_jax.plan.planner import GB, PlanConfig, PlanInputs, microbatch_shape, plan_memory

RECOMPUTE = {"none": 1.0, "dots_attention_out": 1.1, "attention_out": 1.25, "dots": 1.25,
             "dots_no_batch": 1.3, "full": 1.35}


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """remats: policies to try; rows: micro-batch row counts (None: powers of two up to the
    trainer's); meshes: explicit (data, expert, context, tensor) tuples (None: all of product N)."""

    remats: tuple[str, ...] = tuple(Remat.__args__)
    rows: tuple[int, ...] | None = None
    meshes: tuple[tuple[int, int, int, int], ...] | None = None

    @staticmethod
    def around(*_mesh) -> "SearchSpace":
        return SearchSpace()


@dataclasses.dataclass
class Candidate:
    mesh: tuple[int, int, int, int]
    remat: str
    rows: int
    length: int
    static: int = 0              # static bound, bytes per device
    prior: float = 0.0
    peak: int | None = None      # compiled micro-step peak per device
    flops_per_token: float | None = None
    compile_s: float = 0.0
    status: str = "not compiled"
    fits: bool = False
    # bytes per device that switches this search left off would take off the static bound
    relief: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "static_gb": self.static / GB,
                "peak_gb": None if self.peak is None else self.peak / GB}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cfg: ModelConfig, n: int):
    for d, e, c in itertools.product(_divisors(n), repeat=3):
        if n % (d * e * c):
            continue
        t = n // (d * e * c)
        # latent attention's heads split over tensor whatever its one cached KV head does
        heads = cfg.n_heads if cfg.mla_kv_rank else cfg.n_kv_heads
        if cfg.n_experts % e == 0 and heads % t == 0:
            yield (d, e, c, t)


def search(model_cfg: ModelConfig, n: int, trainer, loss, optimizer, plan_cfg: PlanConfig,
           space: SearchSpace = SearchSpace(), limit: int = 8, log: Callable[[str], None] | None = None):
    """Candidates (see the module doc), fitting ones first, best first."""
    say = log or (lambda s: None)
    budget = (plan_cfg.device_memory_gb - plan_cfg.reserve_gb) * GB
    max_rows, length = microbatch_shape(trainer, plan_cfg)
    rows_list = space.rows or tuple(2 ** i for i in range(int(math.log2(max_rows)) + 1))
    devices = jax.devices()[:n]
    # the KV cache beside a micro-step: pipelined / one_step_off, unless swapped out for it
    overlap = trainer.mode in ("pipelined", "one_step_off") and not trainer.swap_cache
    cands = []
    for mesh_t in (space.meshes or tuple(meshes(model_cfg, n))):
        mesh = make_mesh(*mesh_t[:2], mesh_t[3], devices=devices, context=mesh_t[2])
        setup = TrainSetup.build(model_cfg, mesh, loss, optimizer)
        grads = device_bytes(setup.params)   # jax.grad's pytree, in the params' dtype
        state = device_bytes(setup.opt_state)
        static = device_bytes(setup.params) + device_bytes(setup.acc) + grads + state
        relief = {}
        if state and isinstance(optimizer, OptimizerConfig):   # not offloaded: on the devices
            relief["OptimizerConfig.offload_state"] = state
        if overlap:
            cache = device_bytes(engine_abstract(model_cfg, mesh, trainer.engine_slots, trainer.max_len,
                                                 trainer.buckets, plan_cfg.page_size, plan_cfg.num_pages)[1])
            static += cache
            relief["TrainerConfig.swap_cache"] = cache
        d, e, c, t = mesh_t
        for remat, rows in itertools.product(space.remats, rows_list):
            # rows split over data where they divide (else data holds d replicas of them); expert
            # splits the rows where they divide over it, else the sequence (mesh.seq_axes): no replica
            same_tokens = 1 if rows % d == 0 else d
            cand = Candidate(mesh_t, remat, rows, length, static, same_tokens * RECOMPUTE[remat], relief=relief)
            if static > budget:
                cand.status = f"static bound {static / GB:.1f} GB > budget"
            cands.append(cand)
    # Compile (mesh, rows) groups in prior order; in each, remat='full' first (it saves the least:
    # where it does not fit, no policy does, and the group costs one compile), then the other
    # policies from the least recompute up, until one fits (those after it recompute more).
    groups: dict = {}
    for cand in cands:
        if cand.status == "not compiled":
            groups.setdefault((cand.mesh, cand.rows), []).append(cand)
    order = sorted(groups.values(), key=lambda g: (min(c.prior for c in g), -g[0].rows, g[0].static))
    compiled = 0

    def run(cand) -> bool:
        d, e, c, t = cand.mesh
        mesh = make_mesh(d, e, t, devices=devices, context=c)
        cfg = model_cfg.replace(remat=cand.remat)
        say(f"compiling mesh data={d} expert={e} context={c} tensor={t}, remat={cand.remat}, rows={cand.rows}")
        pc = dataclasses.replace(plan_cfg, phases=("train_micro",), microbatch_rows=cand.rows)
        try:
            plan = plan_memory(PlanInputs(cfg, mesh, trainer, loss, optimizer), pc)
        except Exception as err:  # noqa: BLE001 -- a candidate XLA refuses is reported, not fatal
            cand.status = f"compile failed: {type(err).__name__}: {str(err)[:120]}"
            return False
        ph = plan.phases[0]
        cand.peak, cand.compile_s = ph.peak, ph.compile_s
        cand.flops_per_token = None if ph.flops is None else ph.flops / (cand.rows * cand.length)
        cand.fits = ph.peak <= budget
        cand.status = "fits" if cand.fits else f"peak {ph.peak / GB:.1f} GB > budget"
        return cand.fits

    for group in order:
        ladder = sorted(group, key=lambda c: (c.remat != "full", c.prior))
        if ladder[0].remat != "full":   # 'full' not searched: no floor to test, climb from the cheapest
            ladder = sorted(group, key=lambda c: c.prior)
        for i, cand in enumerate(ladder):
            if compiled >= limit:
                break
            compiled += 1
            ok = run(cand)
            if i == 0 and cand.remat == "full" and not ok:
                for rest in ladder[1:]:
                    rest.status = "skipped: remat='full' does not fit this mesh and row count"
                break
            if ok and i > 0:
                for rest in ladder[i + 1:]:
                    rest.status = "skipped: a policy that recomputes less fits"
                break
        if compiled >= limit:
            break
    return sorted(cands, key=lambda c: (not c.fits, c.peak is None,
                                        c.flops_per_token if c.flops_per_token is not None else math.inf,
                                        c.peak or 0, c.prior, c.static))


def search_markdown(results, model_cfg: ModelConfig, n: int, plan_cfg: PlanConfig, top: int = 20) -> str:
    fit = [r for r in results if r.fits]
    compiled = [r for r in results if r.peak is not None]
    lines = [f"Search: {model_cfg.name} on {n} devices x {plan_cfg.device_memory_gb:g} GB; "
             f"{len(results)} candidates, {sum(r.status.startswith('static') for r in results)} rejected by the "
             f"static bound, {len(compiled)} compiled ({sum(r.compile_s for r in compiled):.0f} s), "
             f"{len(fit)} fit. Ranked by XLA FLOPs per device per trained token (lower is better).", "",
             "| # | data x expert x context x tensor | remat | rows x len | static bound (GB) | "
             "micro-step peak (GB) | GFLOP / device / token | status |",
             "|---:|---|---|---|---:|---:|---:|---|"]
    shown = (fit + [r for r in results if not r.fits and r.peak is not None]
             + [r for r in results if r.peak is None])[:top]
    for i, r in enumerate(shown, 1):
        lines.append(f"| {i} | {' x '.join(map(str, r.mesh))} | {r.remat} | {r.rows} x {r.length:,} | "
                     f"{r.static / GB:.1f} | {'-' if r.peak is None else f'{r.peak / GB:.1f}'} | "
                     f"{'-' if r.flops_per_token is None else f'{r.flops_per_token / 1e9:.2f}'} | {r.status} |")
    if results and not fit:
        lines += ["", _relief_hint(results, plan_cfg)]
    return "\n".join(lines) + "\n"


def _relief_hint(results, plan_cfg: PlanConfig) -> str:
    """Nothing fits: which switches the search left off, and what they would take off the static
    bound (the micro-step's floor: they do not lower its temporaries)."""
    names = sorted({n for r in results for n in r.relief})
    if not names:
        return "Nothing fits, and no memory switch is left off (swap_cache, offload_state): a bigger mesh is needed."
    best = min(results, key=lambda r: r.static - sum(r.relief.values()))
    parts = ", ".join(f"{n}=True ({best.relief[n] / GB:.1f} GB)" for n in names if n in best.relief)
    budget = plan_cfg.device_memory_gb - plan_cfg.reserve_gb
    return (f"Nothing fits. Left off in this search: {parts} off the static bound of mesh "
            f"{' x '.join(map(str, best.mesh))}: {best.static / GB:.1f} -> "
            f"{(best.static - sum(best.relief.values())) / GB:.1f} GB against a budget of {budget:g} GB. "
            "Set them in the config and search again.")
