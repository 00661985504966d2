"""Paged vs dense KV cache: with one fixed KV-cache memory budget, how many concurrent agentic
trajectories fit (issue #18's goal: >= 4x with the paged cache).

    python experiments/bench/paged_cache.py [--preset gpt-oss-20b] [--max_len 8192]
        [--dense_slots 16] [--page_size 64] [--draws 20] [--out bench_out/paged_cache.json]

The budget is the dense engine's cache: dense_slots x max_len tokens (bytes from the preset's
layers, kv heads, head dim and dtype; the paged pools spend one page per layer of it on scratch
pages). The dense cache fits exactly dense_slots trajectories whatever their lengths. The paged
cache fits as many as the engine's own page table (`engine.pages.PageTable`, the allocator the
driver uses) can hold within the budget, each trajectory taking the pages for its tokens + one
decode chunk, as the driver's admission does, counted two ways:
  full      every layer keeps every page (the cache before sliding-window pools)
  window    sliding-window layers keep only the pages of their window + the chunk (the
            engine's per-kind pools; gpt-oss alternates 128-token windows with full layers),
            with the budget split between the pools as the trajectories need it Trajectory lengths come from the seeded long-tail workload of
`sfrrl_jax.testing.workload` (log-normal turns and per-turn response lengths, a tool observation
between turns), scaled to --max_len and clipped to it. Two columns:
  at end    every trajectory at its final length (the worst case: all finish together)
  in flight each at a uniformly random point of its life (a continuous-batching steady state)
Each is the mean (and min) over --draws independent draws of the trajectory order.
This is memory accounting with the real allocator, not a timing: no model runs.
"""
import argparse
import json
import os
import pathlib

import numpy as np

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.pages import PageTable, check_paging, pages_for
from sfrrl_jax.testing.workload import WorkloadConfig, sample_spec


def trajectory_lengths(wcfg: WorkloadConfig, n: int, max_len: int, prompt_len: int) -> np.ndarray:
    out = []
    for i in range(n):
        spec = sample_spec(wcfg, f"task{i % wcfg.num_prompts}", i)
        total = prompt_len + sum(spec.response_lens) + wcfg.observation_len * (len(spec.response_lens) - 1)
        out.append(min(total, max_len))
    return np.asarray(out)


def paged_fit(lengths, max_len: int, page_size: int, budget_pages: int, slots: int, decode_steps: int,
              layer_windows=None) -> int:
    """Trajectories admitted in order until the pages they hold exceed budget_pages pages of every
    layer (scratch pages included). layer_windows None: every layer keeps every page (one pool)."""
    layers = layer_windows or (0,)
    paging = check_paging(page_size, None, max_len, 1, layers, decode_steps)
    per_kind = np.bincount(paging.layer_kinds, minlength=len(paging.windows))  # layers per pool
    big = slots * pages_for(max_len, page_size)  # pools never the limit: the budget is
    pt = PageTable(slots, max_len, page_size, big, paging.windows, (big,) * len(paging.windows))
    for i, n in enumerate(lengths[:slots]):
        pt.ensure(i, int(n) + decode_steps, start=int(n), cached=int(n))  # as admission does
        used = sum(c * (big - f) for c, f in zip(per_kind, pt.free_counts)) + len(layers)
        if used > budget_pages * len(layers):
            return i
    return slots


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--max_len", type=int, default=8192)
    ap.add_argument("--dense_slots", type=int, default=16)
    ap.add_argument("--page_sizes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--decode_steps", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=512)
    ap.add_argument("--response_median", type=float, default=300.0)
    ap.add_argument("--response_sigma", type=float, default=1.0)
    ap.add_argument("--observation_len", type=int, default=128)
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--out", default="bench_out/paged_cache.json")
    args = ap.parse_args()
    cfg = ModelConfig.preset(args.preset)
    bytes_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * np.dtype(cfg.compute_dtype).itemsize
    budget_tokens = args.dense_slots * args.max_len
    wcfg = WorkloadConfig(num_prompts=64, prompt_len=args.prompt_len, response_median=args.response_median,
                          response_sigma=args.response_sigma, max_response=args.max_len,
                          observation_len=args.observation_len)
    pool = trajectory_lengths(wcfg, 4096, args.max_len, args.prompt_len)
    rng = np.random.default_rng(0)
    rows = []
    windows = cfg.layer_windows
    for ps in args.page_sizes:
        num_pages = budget_tokens // ps - 1  # one page of the budget is the scratch page
        check_paging(ps, num_pages, args.max_len, args.dense_slots)
        cap = num_pages  # slots are cheap in a paged engine: never the limit here
        fits = {k: [] for k in ("full_end", "full_flight", "window_end", "window_flight")}
        for _ in range(args.draws):
            order = rng.permutation(pool)
            progress = np.maximum(1, (order * rng.uniform(size=len(order))).astype(int))
            for name, lw in (("full", None), ("window", windows)):
                budget = num_pages + 1  # pages of every layer
                fits[name + "_end"].append(paged_fit(order, args.max_len, ps, budget, cap, args.decode_steps, lw))
                fits[name + "_flight"].append(
                    paged_fit(progress, args.max_len, ps, budget, cap, args.decode_steps, lw))
        row = {"page_size": ps, "num_pages": num_pages, "dense_fit": args.dense_slots}
        for k, v in fits.items():
            row[k + "_mean"], row[k + "_min"] = float(np.mean(v)), int(np.min(v))
            row[k + "_ratio"] = float(np.mean(v)) / args.dense_slots
        rows.append(row)
    q = np.percentile(pool, [50, 90, 99])
    n_win = sum(w > 0 for w in windows)
    print(f"{args.preset}: {bytes_per_token / 2**10:.0f} KiB/token; {n_win} of {cfg.n_layers} layers with a "
          f"{cfg.sliding_window}-token window; budget {budget_tokens} tokens = "
          f"{budget_tokens * bytes_per_token / 2**30:.2f} GiB (dense: {args.dense_slots} slots x {args.max_len})")
    print(f"trajectory tokens: median {q[0]:.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, max_len {args.max_len} "
          f"({np.mean(pool >= args.max_len):.1%} clipped)")
    print(f"{'page':>5s} {'dense':>6s} | {'full: end':>10s} {'x':>5s} {'in flight':>10s} {'x':>5s} | "
          f"{'window: end':>12s} {'x':>5s} {'in flight':>10s} {'x':>5s}")
    for r in rows:
        print(f"{r['page_size']:5d} {r['dense_fit']:6d} | {r['full_end_mean']:10.1f} {r['full_end_ratio']:5.2f} "
              f"{r['full_flight_mean']:10.1f} {r['full_flight_ratio']:5.2f} | {r['window_end_mean']:12.1f} "
              f"{r['window_end_ratio']:5.2f} {r['window_flight_mean']:10.1f} {r['window_flight_ratio']:5.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "bytes_per_token": bytes_per_token,
                               "budget_tokens": budget_tokens, "length_percentiles": q.tolist(),
                               "rows": rows, "cpu_count": os.cpu_count()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
