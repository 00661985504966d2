"""Benchmark: the quickstart recipe over seeds x device counts. Prints a table, writes JSON.

    python experiments/bench/quickstart_seeds.py [--seeds 0,1,2,3,4 --devices 1,8 --recipe full
                                                  --out bench_out/quickstart_seeds.json]

Each (seed, devices) run is its own subprocess, because the number of (fake) CPU devices is fixed
when jax starts: devices 8 sets `--xla_force_host_platform_device_count=8` and the recipe's mesh
is data 2 x expert 4 over them; devices 1 runs on one device. `--recipe reduced` runs the CI-size
recipe (`QuickstartRecipe.reduced()`). `--set key=value` (repeatable) overrides a recipe field,
e.g. `--set rl_steps=30`. Runs go one after another: they would only share the same cores.

The table: seed, devices, held-out greedy success before and after RL, the gain in points, SFT
steps taken (the warm start stops at its probe accuracy), RL reward first/last step, wall seconds;
then the gain's min / median / max per device count. The JSON holds every run's result.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

_REPO = str(pathlib.Path(__file__).resolve().parents[2])  # the recipe is experiment code: import it from here

_CHILD = r"""
import json, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["repo"])
import jax
jax.config.update("jax_default_matmul_precision", "highest")
from experiments.recipes.quickstart import QuickstartRecipe, run_quickstart
make = QuickstartRecipe.reduced if spec["recipe"] == "reduced" else QuickstartRecipe
recipe = make(**spec["overrides"])
r = run_quickstart(recipe, spec["run_dir"], log=lambda line: print(line, flush=True))
keep = ("success_before", "success_after", "success_gain", "wall_s", "sft_s", "rl_s", "sft_steps",
        "sft_probe_accuracy", "rl_reward_first", "rl_reward_last")
print("RESULT " + json.dumps({k: r[k] for k in keep}), flush=True)
"""


def run_one(seed: int, devices: int, recipe: str, overrides: dict, run_dir: str, tokenizer_dir: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    spec = {"recipe": recipe, "run_dir": run_dir, "repo": _REPO,
            "overrides": {**overrides, "seed": seed, "mesh_devices": devices, "tokenizer_dir": tokenizer_dir}}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    result = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
    if proc.returncode or not result:
        raise RuntimeError(f"seed {seed}, {devices} devices failed (exit {proc.returncode}):\n"
                           + "\n".join(lines[-20:]) + "\n" + proc.stderr[-4000:])
    return {"seed": seed, "devices": devices, **result[0]}


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key=value")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--devices", default="1,8")
    ap.add_argument("--recipe", choices=("full", "reduced"), default="full")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="bench_out/quickstart_seeds.json")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    device_counts = [int(d) for d in args.devices.split(",")]
    overrides = parse_sets(args.set)
    from sfrrl_jax.tokenizer import build_tiny_tokenizer  # after the arguments: --help stays fast

    rows = []
    with tempfile.TemporaryDirectory(prefix="quickstart_seeds_") as tmp:
        tok_dir = str(build_tiny_tokenizer(pathlib.Path(tmp) / "tokenizer"))
        header = (f"{'seed':>4} {'dev':>3} {'before':>7} {'after':>7} {'gain':>7} {'sft':>5} {'probe':>6} "
                  f"{'rew0':>6} {'rewN':>6} {'wall s':>7}")
        print(header, flush=True)
        for devices in device_counts:
            for seed in seeds:
                r = run_one(seed, devices, args.recipe, overrides, f"{tmp}/s{seed}_d{devices}", tok_dir)
                rows.append(r)
                print(f"{seed:>4} {devices:>3} {r['success_before']:>7.3f} {r['success_after']:>7.3f} "
                      f"{100 * r['success_gain']:>+7.1f} {r['sft_steps']:>5} {r['sft_probe_accuracy']:>6.2f} "
                      f"{r['rl_reward_first']:>6.3f} {r['rl_reward_last']:>6.3f} {r['wall_s']:>7.0f}", flush=True)
    summary = {}
    for devices in device_counts:
        gains = [100 * r["success_gain"] for r in rows if r["devices"] == devices]
        summary[devices] = {"min_gain": min(gains), "median_gain": statistics.median(gains), "max_gain": max(gains),
                            "max_wall_s": max(r["wall_s"] for r in rows if r["devices"] == devices)}
        print(f"devices {devices}: gain min {min(gains):+.1f}, median {statistics.median(gains):+.1f}, "
              f"max {max(gains):+.1f} points; slowest run {summary[devices]['max_wall_s']:.0f} s")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"recipe": args.recipe, "overrides": overrides, "runs": rows,
                               "summary": {str(k): v for k, v in summary.items()}}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
