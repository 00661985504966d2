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
The cost ratio: what pipelining can hide depends on training time over the rollout's idle, and
that ratio depends on the machine (a GPU decodes and trains far faster than a tool answers). So
the tool-bound settings are fixed by the ratio, not by seconds: a calibration first replays the
measured sync steps at latency scales 0.5 and 1.5, then at interpolated scales until one lands
within --calibration_tolerance (at most --calibration_points scales), and scales every tool
latency so that sync's training takes --cost_ratio (default 1) times its rollout idle; the queued
setting gets the same scale. With --cost_ratio 0 the latencies are --tool_latency as given, times
--latency_scale (the scale an earlier run's calibration chose, to repeat it without calibrating).
The modes run interleaved: round k takes step k of every mode (rotating which goes first), so a
drift in the shared machine's speed hits every mode alike, and step k of every mode replays the
same work (the per-step hidden shares pair them).
Knobs: --cost_ratio, --tool_latency, --train_width (pads training rows, up to the 256-token
context: scales the train cost without touching the rollout), --underfull_slots (how empty the
decode batch must be before pipelined trains beside it), --microbatch_rows (rows per gradient
micro-step: a micro-step is not preempted, so smaller ones delay a returning tool's trajectory
less), --groups / --slots (every setting), --group_size, --early_groups (the 'pipelined+early'
row: up to this many unfinished groups train their finished samples before the group is done;
default a quarter of the groups).

Columns: wall time per RL step, device-busy fraction (time in device work / wall), decode slot
occupancy, on-policy fraction of trained tokens, and the share of sync's training time hidden
= (sync step time - mode step time) / sync train time. The first step of each mode compiles and
is excluded. Times are wall-clock on a shared CPU: compare rows of one run only.
Idle columns: 'idle s' = step time outside device work; 'starved' = the part of it in which no
finished group (for pipelined+early: no finished sample) was waiting to be trained (nothing
on-policy exists to fill it: e.g. before the first group of the step finishes, or while the
last straggler waits on its tool); 'ceiling' = 1 - starved / step time, the device-busy fraction
an on-policy schedule of that step could at best reach by filling the rest.
Each setting's header gives sync's measured train / rollout idle and the on-policy hidden ceiling
= sum over steps of min(train, idle with a finished group waiting) / sum of train: the most of
sync's training any on-policy schedule could hide. A step's idle is set by its slowest
trajectory, so it varies from step to step: a step with less idle than training cannot hide all
of it, one with more leaves the device idle. Through the cost ratio, the busy and the hidden
goals trade off; the sweep (--cost_ratio 0.8,1,1.25) shows where both hold, and each tool-bound
setting prints the window of ratios where an ideal on-policy schedule of its sync steps would
meet both (`goal_window`: each step's idle scaled, filled with its own training, no overhead).
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
from sfrrl_jax.agents.tools import ToolRunnerConfig  # noqa: E402
from sfrrl_jax.rl.config import LossConfig  # noqa: E402
from sfrrl_jax.learner.optimizer import OptimizerConfig  # noqa: E402
from sfrrl_jax.trainer.config import TrainerConfig  # noqa: E402
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream  # noqa: E402
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks, sample_spec  # noqa: E402

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


MAX_LEN = 256  # the engine's context and the widest training row


def tool_config(args) -> ToolRunnerConfig:
    """Where the workload's tool calls run: this process's event loop, or a Ray cluster's actors
    (--tool_backend ray: a local cluster unless RAY_ADDRESS names one)."""
    return ToolRunnerConfig(backend=args.tool_backend, ray_actor_concurrency=64)


def make_trainer(mode, early, wl, args, cfg, mesh, underfull_slots, agent=None) -> RLTrainer:
    """A trainer on fresh params, every micro-step shape compiled, one warm-up step taken."""
    groups = wl.num_prompts
    early_groups = (args.early_groups if args.early_groups is not None else max(groups // 4, 1)) if early else 0
    tc = TrainerConfig(mode=mode, groups_per_step=groups, group_size=args.group_size,
                       max_slots=args.slots, max_len=MAX_LEN, decode_steps=args.decode_steps,
                       buckets=(16, 32, 64), seq_bucket=args.train_width, underfull_slots=underfull_slots,
                       microbatch_rows=args.microbatch_rows, early_groups=early_groups,
                       longest_first=args.longest_first == "on")
    params = S.init_params(cfg, mesh, seed=0)
    trainer = RLTrainer(cfg, params, tc, LossConfig(), OptimizerConfig(learning_rate=1e-5),
                        agent or WorkloadAgent(wl, tools=tool_config(args)), TaskStream(make_tasks(wl), seed=args.seed))
    trainer.compile_train_shapes()  # every micro-step shape, so no compile lands in a measured step
    trainer.step()  # compile + warm-up, excluded
    return trainer


def summarize(rows: list[dict]) -> dict:
    keys = ("time/wall_s", "time/rollout_s", "time/train_s", "time/train_exposed_s", "perf/device_busy",
            "perf/slot_occupancy", "policy/on_policy_fraction", "reward/mean", "time/idle_s",
            "time/idle_starved_s", "perf/busy_ceiling_on_policy", "perf/compile_count")
    out = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    out["per_step"] = {k: [float(r[k]) for r in rows] for k in (
        "time/wall_s", "time/rollout_s", "time/train_s", "time/idle_s", "time/idle_starved_s", "perf/device_busy",
        "perf/busy_ceiling_on_policy")}
    out["early_microsteps"] = float(np.mean([r["train/early_microsteps"] for r in rows]))
    return out


def run_setting(wl, args, cfg, mesh, underfull_slots) -> dict:
    """Every mode on the same workload, steps interleaved: round k runs step k of each mode,
    starting one mode later each round, so a drift in machine speed hits every mode alike."""
    trainers = {row: make_trainer(mode, early, wl, args, cfg, mesh, underfull_slots) for row, mode, early in MODES}
    rows = {row: [] for row in trainers}
    names = list(trainers)
    for k in range(args.steps):
        for row in names[k % len(names):] + names[:k % len(names)]:
            rows[row].append(trainers[row].step())
    return {row: summarize(r) for row, r in rows.items()}


def scale_tool_latency(wl: WorkloadConfig, scale: float) -> WorkloadConfig:
    return dataclasses.replace(wl, tool_latency_median_s=wl.tool_latency_median_s * scale,
                               max_tool_latency_s=wl.max_tool_latency_s * scale)


def calibrate_tool_latency(wl, args, cfg, mesh, steps: int, target_ratio: float, max_points: int = 5,
                           tolerance: float = 0.03) -> dict:
    """Sync's rollout idle (every in-flight trajectory waiting on a tool) and train time at
    several scales of every tool latency: the points `latency_scale_for` interpolates.

    The ratio of train time to rollout idle decides how much pipelining can hide, and it depends
    on the machine (a GPU decodes and trains far faster than a tool answers), so the tool-bound
    setting is fixed by that ratio rather than by seconds. The same work (tasks and draws) is
    replayed at each scale: the steps the bench then measures (each mode's warm-up step, then
    steps 1..`steps`), because a step's idle depends on its slowest trajectory, a heavy tail:
    calibrated on the first 4 of 16 steps, the 16 landed at ratio 1.18 instead of 1.0.
    Sync's idle is convex in the scale (a step's rollout is its slowest trajectory's decode plus
    tool seconds, a max over trajectories), so a line between two points overestimates the idle
    between them: through scales 0.5 and 1.5 it chose x0.74 for ratio 1.0 (16 steps then measured
    1.24); a third point there, interpolated again, chose x1.04 from a point at ratio 1.28, and
    measured 1.15. So the points go on (secant steps from both sides, up to `max_points`) until
    one lands within `tolerance` of the target ratio; that point's scale is the answer. Replays
    are noisy too (x1.21 gave 1.105 and x1.236 gave 0.945 in one run: train time alone moved 5%),
    so five points usually end in a last interpolation; that run then measured 1.00."""
    agent = WorkloadAgent(wl, tools=tool_config(args))
    trainer = make_trainer("sync", False, wl, args, cfg, mesh, underfull_slots=0, agent=agent)
    stream, replays = dict(trainer.tasks.state()), dict(agent.replays)

    def measure(scale: float) -> dict:
        trainer.tasks.epoch, trainer.tasks.index = stream["epoch"], stream["index"]
        agent.load_state_dict({"replays": replays})
        agent.cfg = scale_tool_latency(wl, scale)
        ms = [trainer.step() for _ in range(steps)]
        point = {"scale": scale, "idle_s": float(np.mean([m["time/idle_s"] for m in ms])),
                 "train_s": float(np.mean([m["time/train_s"] for m in ms]))}
        print(f"calibration: latency x{scale:.3f}: sync idle {point['idle_s']:.2f} s, train "
              f"{point['train_s']:.2f} s, ratio {point['train_s'] / point['idle_s']:.3f}", flush=True)
        return point

    calibration = {"points": [measure(0.5), measure(1.5)], "target_ratio": target_ratio}
    p0, p1 = calibration["points"]
    if p1["idle_s"] <= p0["idle_s"]:
        raise RuntimeError(f"sync's rollout idle did not grow with the tool latencies ({calibration['points']}): "
                           "the setting is not tool-bound; raise --tool_latency")
    while len(calibration["points"]) < max_points:
        point = measure(latency_scale_for(calibration, target_ratio))
        calibration["points"].append(point)
        if abs(point["train_s"] / point["idle_s"] / target_ratio - 1.0) <= tolerance:
            calibration["landed"] = point["scale"]
            break
    return calibration


def latency_scale_for(calibration: dict, ratio: float) -> float:
    """The latency scale at which sync's train time is `ratio` x its rollout idle: a calibration
    point that landed within tolerance of it (`calibration['landed']`, for the ratio it aimed at),
    else piecewise-linear in the points (sorted by scale; the idle grows with it), extended past
    the ends."""
    if calibration.get("landed") is not None and calibration.get("target_ratio") == ratio:
        return float(calibration["landed"])
    points = sorted(calibration["points"], key=lambda p: p["scale"])
    train_s = float(np.mean([p["train_s"] for p in points]))  # the latencies do not touch training
    target_idle = train_s / ratio
    # the closest points on either side of the target; past the ends, the two outermost
    below = [p for p in points if p["idle_s"] < target_idle]
    above = [p for p in points if p["idle_s"] >= target_idle and (not below or p["scale"] > below[-1]["scale"])]
    a, b = ((below[-1], above[0]) if below and above else (points[-2], points[-1]) if below
            else (points[0], points[1]))
    slope = (b["idle_s"] - a["idle_s"]) / (b["scale"] - a["scale"])
    if slope <= 0:  # noise between two close points: the outer line
        a, b = points[0], points[-1]
        slope = (b["idle_s"] - a["idle_s"]) / (b["scale"] - a["scale"])
    return float(np.clip(a["scale"] + (target_idle - a["idle_s"]) / slope, 0.05, 20.0))


def goal_window(per_step: dict, hidden_goal: float = 0.8, busy_goal: float = 0.95) -> dict:
    """At which cost ratios an ideal on-policy schedule meets both goals, from sync's steps.

    Each step's idle is scaled by k (as scaling the tool latencies roughly does: the idle is what
    they add beyond the decode work) and filled with that step's training, min(train, k x (idle -
    starved)); the rest of the training runs after the rollout, the rest of the idle stays idle.
    No overhead, no preemption cost: a bound, not a prediction. per_step: sync's 'time/rollout_s',
    'time/idle_s', 'time/idle_starved_s', 'time/train_s' lists. Returns {'ratios': [lo, hi] where
    both hold (None if nowhere), 'closest': the (ratio, hidden, busy) nearest to both}.
    """
    t, i, st, ro = (np.asarray(per_step[k]) for k in ("time/train_s", "time/idle_s", "time/idle_starved_s",
                                                      "time/rollout_s"))
    decode = ro - i
    rows = []
    for k in np.geomspace(0.1, 10.0, 400):
        fill = np.minimum(t, k * (i - st))
        wall = decode + k * st + np.maximum(k * (i - st), t)
        rows.append((float(t.sum() / (k * i).sum()), float(fill.sum() / t.sum()), float((decode + t).sum() / wall.sum())))
    ok = [r for r, h, b in rows if h >= hidden_goal and b >= busy_goal]
    closest = max(rows, key=lambda x: min(x[1] / hidden_goal, x[2] / busy_goal))
    return {"ratios": [min(ok), max(ok)] if ok else None, "closest": closest}


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
    ap.add_argument("--train_width", type=int, default=MAX_LEN,
                    help=f"training rows are padded to a multiple of this, at most {MAX_LEN}")
    ap.add_argument("--tool_latency", type=float, default=1.0,
                    help="median tool latency (s) of the tool-bound settings, before --cost_ratio scales it")
    ap.add_argument("--cost_ratio", default="1.0",
                    help="tool-bound settings: scale the tool latencies so that sync's training takes this "
                         "times its rollout idle (calibrated first); several, comma-separated, run the "
                         "tool-bound setting at each (the queued one at the first); 0: --tool_latency as it is")
    ap.add_argument("--latency_scale", type=float, default=1.0,
                    help="with --cost_ratio 0: scale every tool latency by this (no calibration)")
    ap.add_argument("--calibration_steps", type=int, default=None,
                    help="steps of work replayed at each calibration latency scale "
                         "(default --steps: the very work measured, whose idle varies step to step)")
    ap.add_argument("--calibration_points", type=int, default=5,
                    help="at most this many calibration scales (two ends, then secant steps)")
    ap.add_argument("--calibration_tolerance", type=float, default=0.03,
                    help="stop calibrating once a scale gives sync this close (relative) to --cost_ratio")
    ap.add_argument("--underfull_slots", type=int, default=None,
                    help="default: 0 for tool-bound (never stretch the tail), 2 for decode-bound")
    ap.add_argument("--microbatch_rows", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tool_backend", choices=("local", "ray"), default="local",
                    help="run the tool calls on this host or on a Ray cluster's actors (ToolRunnerConfig.backend)")
    ap.add_argument("--only", choices=tuple(GROUPS_DEFAULT), default=None)
    ap.add_argument("--out", default="bench_out/stragglers.json")
    args = ap.parse_args()
    args.calibration_steps = args.calibration_steps or args.steps
    if not 0 < args.train_width <= MAX_LEN:
        ap.error(f"--train_width must be in 1..{MAX_LEN} (the widest training row), got {args.train_width}")
    try:
        ratios = [float(x) for x in args.cost_ratio.split(",")]
    except ValueError:
        ap.error(f"--cost_ratio must be numbers separated by commas, got {args.cost_ratio!r}")
    if args.calibration_points < 2 or args.calibration_tolerance <= 0:
        ap.error(f"--calibration_points must be >= 2 and --calibration_tolerance > 0, got "
                 f"{args.calibration_points} and {args.calibration_tolerance}")
    if any(r < 0 for r in ratios) or (0 in ratios and len(ratios) > 1):
        ap.error(f"--cost_ratio: each ratio must be > 0 (or a single 0: no calibration), got {args.cost_ratio!r}")
    if args.latency_scale <= 0 or (args.latency_scale != 1.0 and ratios != [0.0]):
        ap.error(f"--latency_scale={args.latency_scale} must be > 0, and needs --cost_ratio 0 (a calibrated "
                 "ratio chooses the scale itself)")
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=MAX_LEN)
    mesh = S.make_mesh(data=2, expert=4)
    report = {"args": vars(args), "settings": {}}
    wls = settings(args)
    scales = {r: args.latency_scale for r in ratios}
    if ratios != [0.0] and (args.only or "tool-bound").startswith("tool-bound"):
        calibration = report["calibration"] = calibrate_tool_latency(
            wls["tool-bound"], args, cfg, mesh, args.calibration_steps, ratios[0],
            max_points=args.calibration_points, tolerance=args.calibration_tolerance)
        scales = {r: latency_scale_for(calibration, r) for r in ratios}
        calibration["scales"] = {str(r): x for r, x in scales.items()}
        print(f"calibration (tool-bound, sync, {args.calibration_steps} steps): idle " + ", ".join(
            f"{p['idle_s']:.2f} s at latency x{p['scale']:.2f}" for p in calibration["points"])
              + f"; train {np.mean([p['train_s'] for p in calibration['points']]):.2f} s -> tool latencies "
              + ", ".join(f"x{x:.2f} for train / idle = {r}" for r, x in scales.items()))
    # (row name, setting, workload, cost ratio): tool-bound at every ratio (a sweep), queued at the first
    runs = [(f"tool-bound@{r}" if len(ratios) > 1 else "tool-bound", "tool-bound",
             scale_tool_latency(wls["tool-bound"], scales[r]), r) for r in ratios]
    runs.append(("tool-bound-queued", "tool-bound-queued",
                 scale_tool_latency(wls["tool-bound-queued"], scales[ratios[0]]), ratios[0]))
    runs.append(("decode-bound", "decode-bound", wls["decode-bound"], None))
    for name, setting, wl, ratio in runs:
        if args.only and setting != args.only:
            continue
        underfull = UNDERFULL_DEFAULT[setting] if args.underfull_slots is None else args.underfull_slots
        res = run_setting(wl, args, cfg, mesh, underfull)
        sync = res["sync"]
        sync["train_over_rollout_idle"] = sync["time/train_s"] / max(sync["time/idle_s"], 1e-9)
        # The most of sync's training an on-policy schedule could hide: per step, the idle in which a
        # finished group was waiting, capped by the training there is.
        ps = sync["per_step"]
        sync["hidden_ceiling_on_policy"] = sum(
            min(t, i - st) for t, i, st in zip(ps["time/train_s"], ps["time/idle_s"], ps["time/idle_starved_s"])
        ) / max(sum(ps["time/train_s"]), 1e-9)
        window = sync["goal_window_ideal"] = goal_window(ps)
        for m, r in res.items():
            r["hidden_share_of_sync_train"] = ((sync["time/wall_s"] - r["time/wall_s"]) / sync["time/train_s"]
                                               if sync["time/train_s"] else 0.0)
        report["settings"][name] = {"workload": dataclasses.asdict(wl),
                                    "workload_stats": workload_stats(wl, args.group_size),
                                    "underfull_slots": underfull, "cost_ratio": ratio, "modes": res}
        st = report["settings"][name]["workload_stats"]
        print(f"\n== {name}: {wl.num_prompts * args.group_size} trajectories on {args.slots} slots; "
              "median / p99 of the drawn work: "
              f"turn response {st['response_median']:.0f} / {st['response_p99']:.0f} tokens, "
              f"trajectory {st['trajectory_tokens_median']:.0f} / {st['trajectory_tokens_p99']:.0f} tokens, "
              f"trajectory tools {st['trajectory_tool_s_median']:.2f} / {st['trajectory_tool_s_p99']:.2f} s; "
              f"sync's train / rollout idle {sync['train_over_rollout_idle']:.2f}, on-policy hidden ceiling "
              f"{sync['hidden_ceiling_on_policy']:.0%}")
        print(f"{'mode':15s} {'step s':>7s} {'rollout s':>9s} {'train s':>8s} {'exposed':>8s} {'busy':>6s} "
              f"{'slots':>6s} {'on-pol':>6s} {'hidden':>7s} {'idle s':>7s} {'starved':>7s} {'ceiling':>7s}")
        for m, r in res.items():
            print(f"{m:15s} {r['time/wall_s']:7.2f} {r['time/rollout_s']:9.2f} {r['time/train_s']:8.2f} "
                  f"{r['time/train_exposed_s']:8.2f} {r['perf/device_busy']:6.1%} {r['perf/slot_occupancy']:6.1%} "
                  f"{r['policy/on_policy_fraction']:6.2f} {r['hidden_share_of_sync_train']:7.1%} "
                  f"{r['time/idle_s']:7.2f} {r['time/idle_starved_s']:7.2f} {r['perf/busy_ceiling_on_policy']:7.1%}")
        if name.startswith("tool-bound"):  # the goal, and whether the workload's ceiling allows it
            r_, h_, b_ = window["closest"]
            print("an ideal on-policy schedule on these sync steps, their idle scaled (goal_window): "
                  + (f"hidden >= 80% and busy >= 95% both hold at train / idle {window['ratios'][0]:.2f}-"
                     f"{window['ratios'][1]:.2f}" if window["ratios"] else "hidden >= 80% and busy >= 95% hold "
                     f"together at no cost ratio; closest: hidden {h_:.1%}, busy {b_:.1%} at {r_:.2f}"))
            for m in ("pipelined", "pipelined+early"):
                r = res[m]
                checks = {"hidden>=80%": r["hidden_share_of_sync_train"] >= 0.8,
                          "busy>=95%": r["perf/device_busy"] >= 0.95,
                          "on-policy=1": r["policy/on_policy_fraction"] == 1.0}
                r["goal"] = checks
                # step k of every mode replays the same work, so steps pair up
                r["per_step"]["hidden_share"] = [(a - b) / sync["time/train_s"] for a, b in
                                                 zip(sync["per_step"]["time/wall_s"], r["per_step"]["time/wall_s"])]
                print(f"goal {m}: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in checks.items())
                      + f"; per step: hidden {', '.join(f'{x:.0%}' for x in r['per_step']['hidden_share'])}, "
                      f"busy {', '.join(f'{x:.0%}' for x in r['per_step']['perf/device_busy'])}, on-policy busy "
                      f"ceiling {', '.join(f'{x:.0%}' for x in r['per_step']['perf/busy_ceiling_on_policy'])}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
