"""Benchmark: tool calls at scale on one asyncio loop.

1. N concurrent calls of a latency-only tool (heavy-tailed log-normal latency) through `ToolRunner`
   (validation, concurrency bound, per-call timeout): throughput and overhead beyond the tool's
   own time (end-to-end minus the time measured inside the tool body).
2. M sandboxed Python calls (`PythonSandbox`, one jailed process each): throughput, queueing
   latency, and per-call overhead beyond the code's own run time (slot wall minus `exec_s`,
   i.e. interpreter start, namespaces, mounts, rlimits, teardown).
Peak RSS of this process and of the largest child. Prints a table and writes JSON.

    python experiments/bench/tools.py [--quick] [--backend ray] [--out bench_out/tools.json]

With --backend ray, the latency workload and a call-rate workload (instant calculator calls) also
run on a local Ray cluster's actor pool (`ToolRunnerConfig(backend='ray')`), printed beside the
local thread pool's: calls/s and the per-call overhead the round trip adds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sfrrl_jax.agents.protocols import ToolCall  # noqa: E402
from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox, SandboxConfig  # noqa: E402
from sfrrl_jax.agents.ray_tools import tool_runner  # noqa: E402
from sfrrl_jax.agents.tools import CalculatorTool, ToolRunnerConfig  # noqa: E402


class LatencyTool:
    """Sleeps for `latency_s`; records the time its own body took."""

    name = "wait"
    description = "Wait for latency_s seconds."
    parameters = {"type": "object", "properties": {"latency_s": {"type": "number", "minimum": 0}},
                  "required": ["latency_s"]}

    def __init__(self):
        self.own_time: dict[str, float] = {}

    async def __call__(self, latency_s: float, tag: str = "") -> str:
        start = time.perf_counter()
        await asyncio.sleep(latency_s)
        self.own_time[tag] = time.perf_counter() - start
        return "ok"


def percentile(values, q):
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def _stats_ms(values):
    return {"p50_ms": 1e3 * percentile(values, 50), "p99_ms": 1e3 * percentile(values, 99),
            "max_ms": 1e3 * max(values)}


async def bench_latency_tool(n: int, median_s: float, sigma: float, seed: int, backend: str = "local",
                             ray_actors: int | None = None) -> dict:
    """N concurrent calls of the latency tool through the runner of `backend`. Overhead is each
    call's end-to-end time beyond the tool's own time: measured inside the tool body on this host,
    or the actor's report of the call (its `elapsed_s`) on Ray, where the body runs elsewhere."""
    rng = random.Random(seed)
    latencies = [min(median_s * math.exp(rng.gauss(0, sigma)), 10.0) for _ in range(n)]
    tool = LatencyTool()
    if backend == "ray":
        # slots for every call at once, as the local runner's max_concurrency=n gives: no queueing in either
        actors = ray_actors or max(1, os.cpu_count() or 1)
        cfg = ToolRunnerConfig(timeout_s=30.0, backend="ray", ray_actors=actors,
                               ray_actor_concurrency=-(-n // actors))
    else:
        cfg = ToolRunnerConfig(timeout_s=30.0, max_concurrency=n)
    runner = tool_runner([tool], cfg)
    if backend == "ray":
        await runner.started()   # actors up (process start, imports) before the clock starts
        await runner.run([ToolCall("wait", {"latency_s": 0.0, "tag": "warm"}) for _ in range(2 * actors)])
    done_at: dict[str, float] = {}
    own: dict[str, float] = {}
    queued: list[float] = []

    async def one(i: int):
        tag = f"c{i}"
        start = time.perf_counter()
        result = await runner.run_one(ToolCall("wait", {"latency_s": latencies[i], "tag": tag}, tag))
        done_at[tag] = time.perf_counter() - start
        assert not result.is_error, result.content
        own[tag] = tool.own_time[tag] if backend == "local" else latencies[i]
        queued.append(result.queue_s)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - start
    runner.close()
    overhead = [done_at[k] - own[k] for k in done_at]
    return {"backend": backend, "calls": n, "wall_s": wall, "calls_per_s": n / wall,
            "tool_latency": _stats_ms(latencies), "overhead": _stats_ms(overhead), "queue": _stats_ms(queued),
            "latency_p99_over_median": percentile(latencies, 99) / percentile(latencies, 50)}


async def bench_call_rate(n: int, backend: str, ray_actors: int | None = None) -> dict:
    """Throughput of instant calls (the calculator): what the runner itself sustains per second."""
    if backend == "ray":
        actors = ray_actors or max(1, os.cpu_count() or 1)
        cfg = ToolRunnerConfig(backend="ray", ray_actors=actors, ray_actor_concurrency=64)
    else:
        cfg = ToolRunnerConfig(max_concurrency=n)
    runner = tool_runner([CalculatorTool()], cfg)
    if backend == "ray":
        await runner.started()
        await runner.run([ToolCall("calculator", {"expression": "1+1"}) for _ in range(64)])
    start = time.perf_counter()
    results = await runner.run([ToolCall("calculator", {"expression": f"{i}*7"}, str(i)) for i in range(n)])
    wall = time.perf_counter() - start
    assert [r.content for r in results] == [str(i * 7) for i in range(n)]
    # one call at a time: the round trip itself, with nothing queued before it
    trips = []
    for i in range(min(n, 300)):
        t0 = time.perf_counter()
        await runner.run_one(ToolCall("calculator", {"expression": f"{i}+1"}))
        trips.append(time.perf_counter() - t0)
    runner.close()
    return {"backend": backend, "calls": n, "wall_s": wall, "calls_per_s": n / wall, "round_trip": _stats_ms(trips)}


async def bench_sandbox(n: int, concurrency: int) -> dict:
    sandbox = PythonSandbox(SandboxConfig(wall_timeout_s=10.0, cpu_seconds=5, max_concurrency=concurrency))
    code = "print(sum(i * i for i in range(20000)))"
    expected = f"{sum(i * i for i in range(20000))}\n"

    async def one():
        start = time.perf_counter()
        result = await sandbox.run(code)
        assert result.ok and result.stdout == expected, result
        return time.perf_counter() - start, result

    start = time.perf_counter()
    outcomes = await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - start
    latency = [t for t, _ in outcomes]
    own = [r.exec_s for _, r in outcomes]
    overhead = [r.wall_s - r.exec_s for _, r in outcomes]
    caps = sandbox.capabilities
    return {"calls": n, "concurrency": concurrency, "wall_s": wall, "calls_per_s": n / wall,
            "code_peak_rss_mb": max(r.peak_rss_kb for _, r in outcomes) / 1024,
            "end_to_end_incl_queue": _stats_ms(latency), "code_own_time": _stats_ms(own),
            "overhead": _stats_ms(overhead),
            "isolation": {"separate_uid": caps.separate_uid, "network_namespace": caps.network_namespace,
                          "mount_namespace": caps.mount_namespace, "pid_namespace": caps.pid_namespace}}


def _vm_kb(field: str) -> float:
    with open("/proc/self/status") as f:
        return float(next(line for line in f if line.startswith(field + ":")).split()[1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 latency calls and 100 sandbox calls")
    parser.add_argument("--out", default="bench_out/tools.json")
    parser.add_argument("--latency-calls", type=int, default=None)
    parser.add_argument("--sandbox-calls", type=int, default=None)
    parser.add_argument("--sandbox-concurrency", type=int, default=max(2, 2 * (os.cpu_count() or 1)))
    parser.add_argument("--median-latency-s", type=float, default=0.05)
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma (1.0: p99 ~ 10x median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("local", "ray"), default="local",
                        help="ray: the latency and call-rate workloads also on a local Ray cluster's actors "
                             "(RAY_ADDRESS: an existing one), side by side with the local thread pool")
    parser.add_argument("--ray-actors", type=int, default=None, help="actors in the pool (default: CPUs)")
    args = parser.parse_args(argv)
    n_latency = args.latency_calls or (1000 if args.quick else 10_000)
    n_sandbox = args.sandbox_calls or (100 if args.quick else 1000)

    baseline_rss = _vm_kb("VmRSS") / 1024
    latency = asyncio.run(bench_latency_tool(n_latency, args.median_latency_s, args.sigma, args.seed))
    rss_after_latency = _vm_kb("VmHWM") / 1024
    rate = asyncio.run(bench_call_rate(n_latency, "local"))
    remote = {}
    if args.backend == "ray":
        import ray
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=False,
                     **({} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False}))
        remote = {"latency_tool": asyncio.run(bench_latency_tool(n_latency, args.median_latency_s, args.sigma,
                                                                  args.seed, "ray", args.ray_actors)),
                  "call_rate": asyncio.run(bench_call_rate(n_latency, "ray", args.ray_actors))}
    sandbox = asyncio.run(bench_sandbox(n_sandbox, args.sandbox_concurrency))
    report = {
        "latency_tool": latency, "call_rate": rate, "sandbox": sandbox, "ray": remote,
        "peak_rss_mb": {"host_baseline_before_bench": baseline_rss,
                        "host_peak_after_latency_bench": rss_after_latency,
                        "host_peak": _vm_kb("VmHWM") / 1024,
                        "sandboxed_code_peak": sandbox["code_peak_rss_mb"]},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "args": vars(args),
    }
    rows = [
        ("latency tool", latency["calls"], latency["wall_s"], latency["calls_per_s"],
         latency["overhead"]["p50_ms"], latency["overhead"]["p99_ms"]),
        (f"sandbox x{sandbox['concurrency']}", sandbox["calls"], sandbox["wall_s"], sandbox["calls_per_s"],
         sandbox["overhead"]["p50_ms"], sandbox["overhead"]["p99_ms"]),
    ]
    rows.insert(1, ("instant calls", rate["calls"], rate["wall_s"], rate["calls_per_s"],
                    rate["round_trip"]["p50_ms"], rate["round_trip"]["p99_ms"]))
    if remote:
        rl, rr = remote["latency_tool"], remote["call_rate"]
        rows.insert(1, ("latency on ray", rl["calls"], rl["wall_s"], rl["calls_per_s"], rl["overhead"]["p50_ms"],
                        rl["overhead"]["p99_ms"]))
        rows.insert(3, ("instant on ray", rr["calls"], rr["wall_s"], rr["calls_per_s"], rr["round_trip"]["p50_ms"],
                        rr["round_trip"]["p99_ms"]))
    print(f"{'workload':<16}{'calls':>8}{'wall s':>9}{'calls/s':>10}{'ovh p50 ms':>12}{'ovh p99 ms':>12}")
    for name, calls, wall, rate_, p50, p99 in rows:
        print(f"{name:<16}{calls:>8}{wall:>9.2f}{rate_:>10.1f}{p50:>12.2f}{p99:>12.2f}")
    if remote:
        print(f"ray vs local: latency-bound calls/s x{rl['calls_per_s'] / latency['calls_per_s']:.2f}, "
              f"instant calls/s x{rr['calls_per_s'] / rate['calls_per_s']:.2f}; per-call overhead p50 "
              f"+{rl['overhead']['p50_ms'] - latency['overhead']['p50_ms']:.2f} ms, p99 "
              f"+{rl['overhead']['p99_ms'] - latency['overhead']['p99_ms']:.2f} ms; queue p99 "
              f"{rl['queue']['p99_ms']:.2f} ms; one call at a time, round trip p50 "
              f"{rr['round_trip']['p50_ms']:.2f} ms (local {rate['round_trip']['p50_ms']:.3f} ms)")
    print("(instant rows: 'ovh' is the round trip of one call at a time, nothing queued before it)")
    lt = latency["tool_latency"]
    print(f"tool latency: p50 {lt['p50_ms']:.1f} ms, p99 {lt['p99_ms']:.1f} ms, max {lt['max_ms']:.1f} ms; "
          f"sandbox code own time p50 {sandbox['code_own_time']['p50_ms']:.1f} ms; "
          f"end-to-end incl. queue p99 {sandbox['end_to_end_incl_queue']['p99_ms']:.0f} ms")
    rss = report["peak_rss_mb"]
    print(f"peak RSS: host {rss['host_peak']:.0f} MB (baseline {rss['host_baseline_before_bench']:.0f} MB, after "
          f"latency bench {rss['host_peak_after_latency_bench']:.0f} MB), sandboxed code "
          f"{rss['sandboxed_code_peak']:.1f} MB; isolation {sandbox['isolation']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
