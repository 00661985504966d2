"""`sfrrl-plan`: the memory plan of a gin-configured run, without its devices.

    sfrrl-plan --gin_file=experiments/configs/gpt_oss_120b_1m_16xh200.gin [--gin_param=...]
               [--device_memory_gb=141] [--out=docs/plan.md] [--json=plan.json]
    sfrrl-plan --gin_file=... --search [--search_limit=...]     # meshes x remat x micro-batch rows

Reads the same gin files `sfrrl-train` does (`launch.gin_bindings.load_job`), builds the run's
mesh over N fake CPU devices (N = the config's mesh product; XLA reads the device count when
its backend starts, so this process sets XLA_FLAGS before JAX starts, or re-runs itself in a
fresh process when JAX has already started with fewer devices), and hands the configs to
`sfrrl_jax.plan.plan_memory` (or `plan.search`). Nothing is allocated: the step functions are
compiled for abstract inputs.

XLA:CPU's all-reduce-promotion pass aborts the process on a bf16 all-reduce of the context-
parallel backward ("Invalid binary instruction opcode copy"); the planner only compiles, and a
GPU all-reduces bf16 natively, so the pass is disabled here. For the same reason a bfloat16 model
is compiled as float16 (same bytes; `PlanConfig.bf16_as_f16`, `--keep_bf16` to turn it off).
Exit status: 0 every phase fits, 1 some phase does not (or no candidate fits, --search),
2 a bad config or argument.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

XLA_EXTRA = "--xla_disable_hlo_passes=all-reduce-promotion"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sfrrl-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--gin_file", action="append", default=[], help="a .gin file (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="one gin binding (repeatable)")
    p.add_argument("--device_memory_gb", type=float, default=141.0, help="memory per device, GB (1e9 B)")
    p.add_argument("--reserve_gb", type=float, default=0.0, help="runtime reserve per device, GB")
    p.add_argument("--phases", default=None, help="comma-separated subset of the phases")
    p.add_argument("--microbatch_rows", type=int, default=None)
    p.add_argument("--microbatch_len", type=int, default=None)
    p.add_argument("--prefill_len", type=int, default=None)
    p.add_argument("--page_size", type=int, default=None, help="plan a paged KV cache")
    p.add_argument("--num_pages", type=int, default=None)
    p.add_argument("--out", default=None, help="write the markdown report here")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    p.add_argument("--keep_bf16", action="store_true",
                   help="compile bfloat16 as XLA:CPU does (f32 copies a GPU never makes); default: as float16 "
                        "(same bytes; PlanConfig.bf16_as_f16)")
    p.add_argument("--search", action="store_true", help="search meshes, remat policies, micro-batch rows")
    p.add_argument("--search_limit", type=int, default=12, help="--search: candidates to compile at most")
    return p


def _load(args):
    from sfrrl_jax.launch import gin_bindings
    # the run dir is irrelevant to a plan; bound optionally so configs without one still load
    job = gin_bindings.load_job(args.gin_file, args.gin_param,
                                optional_params=["ExperimentConfig.run_dir = '/tmp/sfrrl-plan'"])
    if job.kind != "rl":
        raise gin_bindings.GinConfigError(f"sfrrl-plan plans 'rl' jobs; Job.kind={job.kind!r}")
    return job.experiment


def _devices_ready(n: int) -> bool:
    """Sets XLA_FLAGS for n CPU devices if JAX has not started; False if it started with fewer."""
    from jax._src import xla_bridge
    if not xla_bridge.backends_are_initialized():
        flags = os.environ.get("XLA_FLAGS", "")
        flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n} {XLA_EXTRA}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
        return True
    import jax
    return jax.device_count() >= n   # started by a caller (a test) with enough devices: plan here


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not args.gin_file and not args.gin_param:
        print("sfrrl-plan: give at least one --gin_file (see experiments/configs/)", file=sys.stderr)
        return 2
    from sfrrl_jax.launch.gin_bindings import GinConfigError
    try:
        exp = _load(args)
    except GinConfigError as e:
        print(f"sfrrl-plan: {e}", file=sys.stderr)
        return 2
    n = exp.mesh_size
    if not _devices_ready(n):
        # JAX already started (an in-process caller): plan in a fresh process with n devices
        env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
        return subprocess.call([sys.executable, "-m", "sfrrl_jax.launch.plan_cli", *argv], env=env)
    import jax
    from sfrrl_jax.launch.runner import validate_experiment
    from sfrrl_jax.mesh import make_mesh
    from sfrrl_jax.plan import PlanConfig, PlanInputs, plan_memory
    try:
        model_cfg = validate_experiment(exp, n)
        plan_cfg = PlanConfig(
            device_memory_gb=args.device_memory_gb, reserve_gb=args.reserve_gb,
            microbatch_rows=args.microbatch_rows, microbatch_len=args.microbatch_len,
            prefill_len=args.prefill_len, page_size=args.page_size, num_pages=args.num_pages,
            bf16_as_f16=not args.keep_bf16,
            **({"phases": tuple(args.phases.split(","))} if args.phases else {}))
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"sfrrl-plan: config invalid: {e}", file=sys.stderr)
        return 2
    source = " ".join(args.gin_file + [f"--gin_param={p!r}" for p in args.gin_param])
    log = lambda s: print(f"sfrrl-plan: {s}", file=sys.stderr, flush=True)  # noqa: E731
    if args.search:
        from sfrrl_jax.plan.search import SearchSpace, search, search_markdown
        space = SearchSpace.around(exp.mesh_data, exp.mesh_expert, exp.mesh_context, exp.mesh_tensor)
        results = search(model_cfg, n, exp.trainer, exp.loss, exp.optimizer, plan_cfg, space,
                         limit=args.search_limit, log=log)
        text = search_markdown(results, model_cfg, n, plan_cfg)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        if args.json:
            Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=1))
        return 0 if any(r.fits for r in results) else 1
    mesh = make_mesh(data=exp.mesh_data, expert=exp.mesh_expert, tensor=exp.mesh_tensor,
                     context=exp.mesh_context, devices=jax.devices()[:n])
    try:
        plan = plan_memory(PlanInputs(model_cfg, mesh, exp.trainer, exp.loss, exp.optimizer, source, exp.lora),
                           plan_cfg, log=log)
    except ValueError as e:
        print(f"sfrrl-plan: config invalid: {e}", file=sys.stderr)
        return 2
    text = plan.to_markdown()
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=1))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
