"""The straggler bench's tool-bound setting trained as 2 processes x 4 devices vs 1 process x 8
(issue #20): what the lockstep costs a whole RL step, and whether pipelining still hides the
training across processes.

    python experiments/bench/stragglers_processes.py [--steps 3] [--groups 4] [--out bench_out/stragglers_processes.json]

Each row is `sfrrl-train` on experiments/configs/stragglers.gin with the tool-bound workload of
experiments/bench/stragglers.py (short responses, long heavy-tailed tool latencies), the same
seed and work in every row; 2-process rows go through experiments/launch_local.py. Rows: sync and
pipelined, each as 1x8 (the plain engine) and 2x4 (the lockstep engine, each process running the
agent loops and tools of its own groups). Columns, means over the steps after the first (which
compiles): wall per step, wall / the 1x8 row of the same mode, device-busy fraction, the share of
training hidden in the rollout, engine ticks per step, exchange ms per tick (wall inside the
all-gather, including waiting for the slower process) and the exchange's share of the step.
On CPU every collective of a 2x4 step crosses processes over gloo/TCP: that, not the agreement,
dominates the 2x4 wall here (experiments/bench/lockstep.py isolates the engine's part).
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


def _params(args) -> list[str]:
    p = {"ExperimentConfig.mesh_data": 2, "ExperimentConfig.mesh_expert": 4, "ExperimentConfig.num_steps": args.steps,
         "ExperimentConfig.checkpoint_every": 0, "ExperimentConfig.progress_bar": False,
         "TrainerConfig.early_groups": 0, "TrainerConfig.groups_per_step": args.groups,
         "TrainerConfig.group_size": 4, "TrainerConfig.max_slots": 4 * args.groups,
         "TrainerConfig.underfull_slots": 0, "WorkloadConfig.num_prompts": args.groups,
         "WorkloadConfig.turns_median": 3.0, "WorkloadConfig.turns_sigma": 0.5,
         "WorkloadConfig.response_median": 6.0, "WorkloadConfig.response_sigma": 1.0,
         "WorkloadConfig.max_response": 96, "WorkloadConfig.tool_latency_median_s": args.tool_latency,
         "WorkloadConfig.tool_latency_sigma": 0.7, "WorkloadConfig.max_tool_latency_s": 4.0}
    return [f"--gin_param={k}={v!r}" for k, v in p.items()]


def _run(args, mode: str, nproc: int, run_dir: pathlib.Path) -> list[dict]:
    train = [sys.executable, str(REPO / "experiments" / "train.py"),
             f"--gin_file={REPO / 'experiments' / 'configs' / 'stragglers.gin'}", *_params(args),
             f"--gin_param=TrainerConfig.mode={mode!r}", f"--run_dir={run_dir}"]
    if nproc == 1:
        cmd = train + ["--cpu_devices", "8"]
    else:
        cmd = [sys.executable, str(REPO / "experiments" / "launch_local.py"), "--num_processes", str(nproc),
               "--cpu_devices", str(8 // nproc), "--", *train]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(f"{mode} {nproc}x{8 // nproc} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--tool_latency", type=float, default=0.2, help="median tool latency, seconds")
    ap.add_argument("--out", default="bench_out/stragglers_processes.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "pipelined"):
            for nproc in (1, 2):
                t0 = time.perf_counter()
                metrics = _run(args, mode, nproc, pathlib.Path(tmp) / f"{mode}{nproc}")[1:]   # after the warm step
                mean = lambda k: sum(m.get(k, 0.0) for m in metrics) / len(metrics)   # noqa: E731
                ticks = mean("perf/engine_ticks")
                rows.append({"mode": mode, "layout": f"{nproc}x{8 // nproc}", "wall_s": mean("time/wall_s"),
                             "device_busy": mean("perf/device_busy"),
                             "hidden_train_share": mean("time/hidden_train_share"), "ticks": ticks,
                             "exchange_ms_per_tick": 1e3 * mean("time/tick_exchange_s") / ticks if ticks else None,
                             "exchange_share": mean("time/tick_exchange_s") / mean("time/wall_s"),
                             "generated_tokens": mean("rollout/generated_tokens"),
                             "run_s": time.perf_counter() - t0})
    base = {r["mode"]: r["wall_s"] for r in rows if r["layout"] == "1x8"}
    print(f"{'mode':10} {'layout':6} {'wall/step s':>11} {'x 1x8':>6} {'busy':>5} {'hidden':>6} {'ticks':>6} "
          f"{'ms/tick':>7} {'exch %':>6} {'tokens':>7}")
    for r in rows:
        r["wall_ratio"] = r["wall_s"] / base[r["mode"]]
        tick = f"{r['exchange_ms_per_tick']:7.2f}" if r["exchange_ms_per_tick"] is not None else f"{'-':>7}"
        print(f"{r['mode']:10} {r['layout']:6} {r['wall_s']:11.2f} {r['wall_ratio']:6.2f} {r['device_busy']:5.2f} "
              f"{r['hidden_train_share']:6.2f} {r['ticks']:6.0f} {tick} {100 * r['exchange_share']:6.2f} "
              f"{r['generated_tokens']:7.0f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
