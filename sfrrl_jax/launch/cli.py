"""`sfrrl-train` (= `python experiments/train.py`): run a gin-configured job.

    sfrrl-train --gin_file=experiments/configs/stragglers.gin \
                --gin_param="ExperimentConfig.num_steps=50" --run_dir=/tmp/run [--resume]

Job kinds besides 'rl' are recipes (experiment code, `sfrrl_jax.launch.recipes`), registered when
their module is imported. Before reading the gin files this imports, in order: the modules of every
installed `sfrrl_jax.recipes` entry point (a package of recipes declares one in its pyproject:
`[project.entry-points."sfrrl_jax.recipes"] mine = "my_pkg.recipes"`), then each --recipe_module
(repeatable; found on sys.path as Python finds it, never added to it). A gin file may also import
its recipe's module itself (`import my_pkg.recipes` at its top). The shipped recipes live in a
source checkout's experiments/recipes/, which experiments/train.py imports: a recipe Job whose kind
is not registered is refused with how to run it.

--gin_file and --gin_param repeat; bindings apply after the files, in order. --resume continues
from the newest intact checkpoint in the run dir (a damaged newest one is renamed
"<step>.damaged", with a warning; --resume=strict refuses it instead; with no checkpoint there,
it starts at step 0 and says so). Without --resume, a run dir that holds an earlier run's
metrics or checkpoints is refused. --validate_only parses and validates the job and checks the
files it reads (the HF directory's config.json, every shard its index names and their headers,
the tokenizer and its chat template, the task file, tool endpoints; `launch.preflight`),
allocating nothing; a real run runs the same file checks first. --cpu_devices=N gives a CPU run
N (fake) devices; it must be set before JAX starts its backends, so it is applied here first.
--num_processes/--process_id/--coordinator (or JAX_NUM_PROCESSES, JAX_PROCESS_ID,
JAX_COORDINATOR_ADDRESS) join an N-process run under jax.distributed (`launch.distributed`;
experiments/launch_local.py starts N on one machine): each process rolls out and trains its share
of the groups, the engine's device steps in lockstep (docs/multihost.md).
Exit status: 0 done; 2 bad config (a binding the job never uses included, a parameter bound twice
with different values in the gin files, a file the job reads missing or unreadable); 3 the run dir cannot
be used as asked (an earlier run there and no --resume; --resume with no restorable checkpoint,
or --resume=strict with a damaged newest one; nan/inf in the HF weights loaded); 4 training
cannot learn (`TrainerConfig.max_nonfinite_steps` updates in a row skipped as non-finite: the
checkpoints written before stand, none is written then); 128+signal when SIGTERM/SIGINT stopped
the run (after saving).
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import sys

# How to run a recipe whose kind is not registered.
RECIPES_HINT = ("a recipe's Job kind exists once its module is imported: the shipped recipes (e.g. Job.kind = "
                "'quickstart') are a source checkout's experiments/recipes/, which "
                "`python experiments/train.py --gin_file=experiments/configs/quickstart.gin` (from the checkout's "
                "root) imports; your own: --recipe_module my_pkg.recipes, an `sfrrl_jax.recipes` entry point, or "
                "`import my_pkg.recipes` at the top of the gin file")

RECIPE_ENTRY_POINTS = "sfrrl_jax.recipes"


def import_recipes(modules: list[str] = ()) -> list[str]:
    """Imports the recipe modules of the installed `sfrrl_jax.recipes` entry points, then `modules`,
    which registers their Job kinds (`sfrrl_jax.launch.recipes.register_recipe`).

    Args:
      modules: dotted module names (the --recipe_module flags), imported as Python finds them.
    Returns:
      The names imported, in order.
    Raises:
      ModuleNotFoundError / ImportError: a module is not found or fails to import (its own error).
    """
    from importlib.metadata import entry_points
    names = [ep.module for ep in entry_points(group=RECIPE_ENTRY_POINTS)] + list(modules)
    for name in names:
        importlib.import_module(name)
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sfrrl-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--gin_file", action="append", default=[], help="a .gin file (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="one gin binding (repeatable)")
    p.add_argument("--recipe_module", action="append", default=[],
                   help="a module that registers recipe Job kinds, imported before the gin files (repeatable)")
    p.add_argument("--resume", nargs="?", const="on", choices=("on", "strict"), default=None,
                   help="continue from the newest intact checkpoint; --resume=strict refuses a damaged newest one")
    p.add_argument("--run_dir", default=None, help="overrides ExperimentConfig.run_dir / Job.run_dir")
    p.add_argument("--cpu_devices", type=int, default=None, help="fake CPU device count (set before JAX starts)")
    p.add_argument("--validate_only", action="store_true", help="parse and validate, allocate nothing")
    p.add_argument("--num_processes", type=int, default=None, help="processes in the run (env JAX_NUM_PROCESSES)")
    p.add_argument("--process_id", type=int, default=None, help="this process's index (env JAX_PROCESS_ID)")
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (env JAX_COORDINATOR_ADDRESS)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not faulthandler.is_enabled():  # an XLA abort (a stuck collective) then shows the Python stacks
        faulthandler.enable(all_threads=True)
    if not args.gin_file and not args.gin_param:
        print("sfrrl-train: give at least one --gin_file (see experiments/configs/)", file=sys.stderr)
        return 2
    if args.cpu_devices is not None:
        from jax._src import xla_bridge  # XLA_FLAGS is read when the first backend starts
        if xla_bridge.backends_are_initialized():
            print("sfrrl-train: --cpu_devices must be set before JAX starts its backends", file=sys.stderr)
            return 2
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    from sfrrl_jax.launch.distributed import DistributedConfig, initialize
    try:
        dist = DistributedConfig.from_env(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        print(f"sfrrl-train: {e}", file=sys.stderr)
        return 2
    initialize(dist)                          # before anything starts a JAX backend
    try:
        import_recipes(args.recipe_module)    # after --cpu_devices: a recipe may import jax
    except ImportError as e:
        print(f"sfrrl-train: cannot import a recipe module: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from sfrrl_jax.launch import gin_bindings
    # Bound through gin, so the operative config records them; optional because each job kind
    # builds only one of Job.run_dir / ExperimentConfig (a recipe Job has no ExperimentConfig).
    own = []
    if args.run_dir is not None:
        own += [f"ExperimentConfig.run_dir = {args.run_dir!r}", f"Job.run_dir = {args.run_dir!r}"]
    if args.resume:
        own.append("ExperimentConfig.resume = " + ("'strict'" if args.resume == "strict" else "True"))
    try:
        job = gin_bindings.load_job(args.gin_file, args.gin_param, optional_params=own)
    except gin_bindings.GinConfigError as e:
        print(f"sfrrl-train: {e}", file=sys.stderr)
        if "Job.kind=" in str(e) or "No configurable matching" in str(e):
            print(f"sfrrl-train: {RECIPES_HINT}", file=sys.stderr)
        return 2
    operative = gin_bindings.operative_config()
    if args.resume and job.kind != "rl":
        print(f"sfrrl-train: --resume applies to rl jobs only; the {job.kind} recipe starts fresh", file=sys.stderr)
    if args.validate_only:
        try:
            # the files it reads too (HF directory, tokenizer, tasks): "valid" must mean the run can start
            model_cfg = gin_bindings.validate_job(job, check_files=True)
        except (ValueError, KeyError, FileNotFoundError) as e:   # the configs do not fit together
            print(f"sfrrl-train: config invalid: {e}", file=sys.stderr)
            return 2
        import jax
        where = f", process {jax.process_index()} of {jax.process_count()}" if jax.process_count() > 1 else ""
        print(f"sfrrl-train: config valid ({job.kind}" + (f", model {model_cfg.name}" if model_cfg else "") + where + ")")
        return 0
    from sfrrl_jax.checkpoints.orbax_store import (DamagedCheckpointError, NoRestorableCheckpointError,
                                                   NonFiniteStateError)
    from sfrrl_jax.launch.runner import RunDirError
    from sfrrl_jax.trainer.health import EXIT_DIVERGED, TrainingDivergedError
    try:
        summary = gin_bindings.run_job(job, operative)
    except gin_bindings.PreflightError as e:   # a file the job reads is missing or unreadable
        print(f"sfrrl-train: config invalid: {e}", file=sys.stderr)
        return 2
    except (RunDirError, NoRestorableCheckpointError, DamagedCheckpointError, NonFiniteStateError) as e:
        print(f"sfrrl-train: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    except TrainingDivergedError as e:   # the checkpoints written before the streak stand
        print(f"sfrrl-train: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    print("SUMMARY " + json.dumps(summary, sort_keys=True, default=str), flush=True)
    signum = summary.get("stopped_by_signal") if isinstance(summary, dict) else None
    return 128 + int(signum) if signum else 0


if __name__ == "__main__":
    sys.exit(main())
