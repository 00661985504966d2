"""Paged vs dense KV cache: with one fixed KV-cache memory budget, how many concurrent agentic
trajectories fit (issue #18's goal: >= 4x with the paged cache).

    python experiments/bench/paged_cache.py [--preset gpt-oss-20b] [--max_len 8192]
        [--dense_slots 16] [--page_size 64] [--draws 20] [--out bench_out/paged_cache.json]

The budget is the dense engine's cache: dense_slots x max_len tokens (bytes from the preset's
layers, kv heads, head dim and dtype; the paged pool spends one page of it on the scratch page).
The dense cache fits exactly dense_slots trajectories whatever their lengths. The paged cache
fits as many as the engine's own page table (`engine.pages.PageTable`, the allocator the driver
uses) can hold, each trajectory taking the pages for its tokens + one decode chunk, as the
driver's admission does. Trajectory lengths come from the seeded long-tail workload of
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
from sfrrl_jax.engine.pages import PageTable, check_paging
from sfrrl_jax.testing.workload import WorkloadConfig, sample_spec


def trajectory_lengths(wcfg: WorkloadConfig, n: int, max_len: int, prompt_len: int) -> np.ndarray:
    out = []
    for i in range(n):
        spec = sample_spec(wcfg, f"task{i % wcfg.num_prompts}", i)
        total = prompt_len + sum(spec.response_lens) + wcfg.observation_len * (len(spec.response_lens) - 1)
        out.append(min(total, max_len))
    return np.asarray(out)


def paged_fit(lengths, max_len: int, page_size: int, num_pages: int, slots: int, decode_steps: int) -> int:
    """Trajectories admitted in order until one no longer gets its pages."""
    pt = PageTable(slots, max_len, page_size, num_pages)
    for i, n in enumerate(lengths[:slots]):
        if not pt.ensure(i, int(n) + decode_steps):
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
    for ps in args.page_sizes:
        num_pages = budget_tokens // ps - 1  # one page of the budget is the scratch page
        check_paging(ps, num_pages, args.max_len, args.dense_slots)
        cap = num_pages  # slots are cheap in a paged engine: never the limit here
        at_end, in_flight = [], []
        for _ in range(args.draws):
            order = rng.permutation(pool)
            at_end.append(paged_fit(order, args.max_len, ps, num_pages, cap, args.decode_steps))
            progress = np.maximum(1, (order * rng.uniform(size=len(order))).astype(int))
            in_flight.append(paged_fit(progress, args.max_len, ps, num_pages, cap, args.decode_steps))
        rows.append({"page_size": ps, "num_pages": num_pages, "dense_fit": args.dense_slots,
                     "paged_at_end_mean": float(np.mean(at_end)), "paged_at_end_min": int(np.min(at_end)),
                     "paged_in_flight_mean": float(np.mean(in_flight)),
                     "paged_in_flight_min": int(np.min(in_flight)),
                     "ratio_at_end": float(np.mean(at_end)) / args.dense_slots,
                     "ratio_in_flight": float(np.mean(in_flight)) / args.dense_slots})
    q = np.percentile(pool, [50, 90, 99])
    print(f"{args.preset}: {bytes_per_token / 2**10:.0f} KiB/token; budget {budget_tokens} tokens = "
          f"{budget_tokens * bytes_per_token / 2**30:.2f} GiB (dense: {args.dense_slots} slots x {args.max_len})")
    print(f"trajectory tokens: median {q[0]:.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, max_len {args.max_len} "
          f"({np.mean(pool >= args.max_len):.1%} clipped)")
    print(f"{'page':>5s} {'pages':>6s} {'dense':>6s} {'paged end':>10s} {'(min)':>6s} {'x':>6s} "
          f"{'in flight':>10s} {'(min)':>6s} {'x':>6s}")
    for r in rows:
        print(f"{r['page_size']:5d} {r['num_pages']:6d} {r['dense_fit']:6d} {r['paged_at_end_mean']:10.1f} "
              f"{r['paged_at_end_min']:6d} {r['ratio_at_end']:6.2f} {r['paged_in_flight_mean']:10.1f} "
              f"{r['paged_in_flight_min']:6d} {r['ratio_in_flight']:6.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "bytes_per_token": bytes_per_token,
                               "budget_tokens": budget_tokens, "length_percentiles": q.tolist(),
                               "rows": rows, "cpu_count": os.cpu_count()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
