"""Straggler benchmark: one seeded long-tail agentic workload replayed through sync, pipelined
(whole groups, then with early samples) and one_step_off, in one run, on the same mesh, params and
seeds. Prints a table, writes JSON (means and per-step figures).

    python experiments/bench/stragglers.py [--steps 3] [--out bench_out/stragglers.json]

Three settings (16 groups x 4 = 64 trajectories on 64 slots unless said):
  tool-bound        short responses, long heavy-tailed tool latencies: the engine idles because
                    every in-flight trajectory waits on a tool (idle source a). The issue's goal.
  tool-bound-queued the same work at 32 groups, 128 trajectories on 64 slots, as when the KV cache
                    bounds the slots: a queue forms, starts are staggered, longest-expected-first
                    launching matters, and the idle turns into nearly empty decode batches (b).
  decode-bound      long heavy-tailed responses, fast tools: the tail keeps the decode batch nearly
                    empty (idle source b).
The workload: per-turn response lengths with p99 ~ 10x median, log-normal turns and tool
latencies, and a per-prompt difficulty (--difficulty: a log-normal factor on its medians) around
which every rollout draws fresh work. Each step replays every prompt (num_prompts = groups), so
longest-expected-first launching (--longest_first) predicts from the prompt's earlier groups,
which the warm-up step provides.
Knobs: --train_width (pads training rows: scales the train cost without touching the rollout,
i.e. the train/rollout cost ratio), tool latency median/sigma, response median/sigma,
--underfull_slots (how empty the decode batch must be before pipelined trains beside it),
--microbatch_rows (rows per gradient micro-step: a micro-step is not preempted, so smaller ones
delay a returning tool's trajectory less), --groups / --slots (every setting), --group_size,
--early_groups (the 'pipelined+early' row: up to this many unfinished groups train their finished
samples before the group is done; default a quarter of the groups).

Columns: wall time per RL step, device-busy fraction (time in device work / wall), decode slot
occupancy, on-policy fraction of trained tokens, and the share of sync's training time hidden
= (sync step time - mode step time) / sync train time. The first step of each mode compiles and
is excluded. Times are wall-clock on a shared CPU: compare rows of one run only.
Idle columns: 'idle s' = step time outside device work; 'starved' = the part of it in which no
finished group (for pipelined+early: no finished sample) was waiting to be trained (nothing
on-policy exists to fill it: e.g. before the first group of the step finishes, or while the
last straggler waits on its tool); 'ceiling' = 1 - starved / step time, the device-busy fraction
an on-policy schedule of that step could at best reach by filling the rest.
"""
import faulthandler
import os

faulthandler.enable(all_threads=True)  # an XLA abort then shows the Python stacks
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.rl.config import LossConfig  # noqa: E402
from sfrrl_jax.train.optimizer import OptimizerConfig  # noqa: E402
from sfrrl_jax.trainer.config import TrainerConfig  # noqa: E402
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream  # noqa: E402
from sfrrl_jax.trainer.workload import WorkloadAgent, WorkloadConfig, make_tasks, sample_spec  # noqa: E402

# (row name, TrainerConfig.mode, early samples on)
MODES = (("sync", "sync", False), ("pipelined", "pipelined", False),
         ("pipelined+early", "pipelined", True), ("one_step_off", "one_step_off", False))


GROUPS_DEFAULT = {"tool-bound": 16, "tool-bound-queued": 32, "decode-bound": 16}
UNDERFULL_DEFAULT = {"tool-bound": 0, "tool-bound-queued": 0, "decode-bound": 2}


def settings(args) -> dict:
    """Setting name -> workload; num_prompts = groups per step (each step replays every prompt)."""
    base = dict(prompt_len=12, max_turns=6, observation_len=6, seed=args.seed,
                difficulty_sigma=args.difficulty, redraw_each_replay=True)
    groups = {k: args.groups or v for k, v in GROUPS_DEFAULT.items()}
    tools = dict(turns_median=3.0, turns_sigma=0.5, response_median=6, response_sigma=1.0, max_response=96,
                 tool_latency_median_s=args.tool_latency, tool_latency_sigma=0.7, max_tool_latency_s=4.0)
    return {
        "tool-bound": WorkloadConfig(**base, **tools, num_prompts=groups["tool-bound"]),
        "tool-bound-queued": WorkloadConfig(**base, **tools, num_prompts=groups["tool-bound-queued"]),
        "decode-bound": WorkloadConfig(**base, num_prompts=groups["decode-bound"], turns_median=1.5,
                                       turns_sigma=0.4, response_median=16, response_sigma=1.1,
                                       max_response=200, tool_latency_median_s=0.005,
                                       tool_latency_sigma=0.5, max_tool_latency_s=0.05),
    }


def workload_stats(wl: WorkloadConfig, group_size: int, replays: int = 4) -> dict:
    """Medians and 99th percentiles of the drawn work (before the engine's context cuts it)."""
    specs = [sample_spec(wl, f"w{i}", s, r) for i in range(wl.num_prompts) for s in range(group_size)
             for r in range(replays)]
    lens = np.array([n for sp in specs for n in sp.response_lens])
    traj_tokens = np.array([sum(sp.response_lens) for sp in specs])
    traj_tools = np.array([sum(sp.tool_latencies) for sp in specs])
    q = lambda x: (float(np.median(x)), float(np.percentile(x, 99)))
    out = {}
    for name, x in (("response", lens), ("trajectory_tokens", traj_tokens), ("trajectory_tool_s", traj_tools)):
        out[f"{name}_median"], out[f"{name}_p99"] = q(x)
    return out


def run_mode(mode, early, wl, args, cfg, mesh, underfull_slots):
    groups = wl.num_prompts
    early_groups = (args.early_groups if args.early_groups is not None else max(groups // 4, 1)) if early else 0
    tc = TrainerConfig(mode=mode, groups_per_step=groups, group_size=args.group_size,
                       max_slots=args.slots, max_len=256, decode_steps=args.decode_steps,
                       buckets=(16, 32, 64), seq_bucket=args.train_width, underfull_slots=underfull_slots,
                       microbatch_rows=args.microbatch_rows, early_groups=early_groups,
                       longest_first=args.longest_first == "on")
    params = S.init_params(cfg, mesh, seed=0)
    trainer = RLTrainer(cfg, params, tc, LossConfig(), OptimizerConfig(learning_rate=1e-5),
                        WorkloadAgent(wl), TaskStream(make_tasks(wl), seed=args.seed))
    trainer.compile_train_shapes()  # every micro-step shape, so no compile lands in a measured step
    trainer.step()  # compile + warm-up, excluded
    rows = [trainer.step() for _ in range(args.steps)]
    keys = ("time/wall_s", "time/rollout_s", "time/train_s", "time/train_exposed_s", "perf/device_busy",
            "perf/slot_occupancy", "policy/on_policy_fraction", "reward/mean", "time/idle_s",
            "time/idle_starved_s", "perf/busy_ceiling_on_policy", "perf/compile_count")
    out = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    out["per_step"] = {k: [float(r[k]) for r in rows] for k in ("time/wall_s", "perf/device_busy",
                                                               "perf/busy_ceiling_on_policy")}
    out["early_microsteps"] = float(np.mean([r["train/early_microsteps"] for r in rows]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=None,
                    help="groups (prompts) per step, every setting; default 16 (32 tool-bound-queued)")
    ap.add_argument("--group_size", type=int, default=4)
    ap.add_argument("--early_groups", type=int, default=None,
                    help="pipelined+early: unfinished groups that may train finished samples early "
                         "(default: a quarter of the groups)")
    ap.add_argument("--difficulty", type=float, default=0.3,
                    help="sigma of the per-prompt log-normal difficulty factor")
    ap.add_argument("--longest_first", choices=("on", "off"), default="on")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--decode_steps", type=int, default=2)
    ap.add_argument("--train_width", type=int, default=512)
    ap.add_argument("--tool_latency", type=float, default=1.0)
    ap.add_argument("--underfull_slots", type=int, default=None,
                    help="default: 0 for tool-bound (never stretch the tail), 2 for decode-bound")
    ap.add_argument("--microbatch_rows", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=tuple(GROUPS_DEFAULT), default=None)
    ap.add_argument("--out", default="bench_out/stragglers.json")
    args = ap.parse_args()
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=256)
    mesh = S.make_mesh(data=2, expert=4)
    report = {"args": vars(args), "settings": {}}
    for name, wl in settings(args).items():
        if args.only and name != args.only:
            continue
        underfull = UNDERFULL_DEFAULT[name] if args.underfull_slots is None else args.underfull_slots
        res = {row: run_mode(mode, early, wl, args, cfg, mesh, underfull) for row, mode, early in MODES}
        sync = res["sync"]
        for m, r in res.items():
            r["hidden_share_of_sync_train"] = ((sync["time/wall_s"] - r["time/wall_s"]) / sync["time/train_s"]
                                               if sync["time/train_s"] else 0.0)
        report["settings"][name] = {"workload": dataclasses.asdict(wl),
                                    "workload_stats": workload_stats(wl, args.group_size),
                                    "underfull_slots": underfull, "modes": res}
        st = report["settings"][name]["workload_stats"]
        print(f"\n== {name}: {wl.num_prompts * args.group_size} trajectories on {args.slots} slots; "
              "median / p99 of the drawn work: "
              f"turn response {st['response_median']:.0f} / {st['response_p99']:.0f} tokens, "
              f"trajectory {st['trajectory_tokens_median']:.0f} / {st['trajectory_tokens_p99']:.0f} tokens, "
              f"trajectory tools {st['trajectory_tool_s_median']:.2f} / {st['trajectory_tool_s_p99']:.2f} s")
        print(f"{'mode':15s} {'step s':>7s} {'rollout s':>9s} {'train s':>8s} {'exposed':>8s} {'busy':>6s} "
              f"{'slots':>6s} {'on-pol':>6s} {'hidden':>7s} {'idle s':>7s} {'starved':>7s} {'ceiling':>7s}")
        for m, r in res.items():
            print(f"{m:15s} {r['time/wall_s']:7.2f} {r['time/rollout_s']:9.2f} {r['time/train_s']:8.2f} "
                  f"{r['time/train_exposed_s']:8.2f} {r['perf/device_busy']:6.1%} {r['perf/slot_occupancy']:6.1%} "
                  f"{r['policy/on_policy_fraction']:6.2f} {r['hidden_share_of_sync_train']:7.1%} "
                  f"{r['time/idle_s']:7.2f} {r['time/idle_starved_s']:7.2f} {r['perf/busy_ceiling_on_policy']:7.1%}")
        if name.startswith("tool-bound"):  # the goal, and whether the workload's ceiling allows it
            for m in ("pipelined", "pipelined+early"):
                r = res[m]
                checks = {"hidden>=80%": r["hidden_share_of_sync_train"] >= 0.8,
                          "busy>=95%": r["perf/device_busy"] >= 0.95,
                          "on-policy=1": r["policy/on_policy_fraction"] == 1.0}
                r["goal"] = checks
                print(f"goal {m}: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in checks.items())
                      + f" (on-policy busy ceiling of these steps: {r['perf/busy_ceiling_on_policy']:.1%}, "
                      f"per step {', '.join(f'{x:.0%}' for x in r['per_step']['perf/busy_ceiling_on_policy'])})")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
