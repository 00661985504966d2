"""Benchmark: a prompt's pages computed and held once, on the same rollouts (issue #47 point 5).

    python experiments/bench/prefix_sharing.py [--hf_dir /tmp/smollm2_hf] [--workloads bfcl_like bfcl_waves stragglers]
        [--repeats 1] [--page_size 16] [--out bench_out/prefix_sharing.json]

Three settings of one paged engine (`page_size`, the pool as large as the dense cache):

  off     every sample computes and stores its own prompt (`share_prompts=False`)
  shared  the default: a group's samples admitted together compute their prompt once and hold its
          full pages once (`share_prompts=True`)
  cached  shared + the prefix cache across requests (`prefix_cache_pages` = the pool): a later prompt
          maps the cached pages of the head it shares with earlier ones (a system prompt, tool schemas)

Workloads, replayed by `testing.workload.WorkloadAgent` (seeded token ids, tool waits, multi-turn):

  bfcl_like   8 prompts x G 4 samples on 32 slots (every sample at once, as a trainer step launches
              them), 1024-token prompts whose first 768 tokens every prompt shares (system prompt +
              tool schemas), 2-3 turns of <= 32 tokens, 32-token tool results
  bfcl_waves  the same on 16 slots: later samples are admitted one by one as slots free up, apart
              from their group
  stragglers  the straggler bench's work: 8 prompts x G 4 on 32 slots, 12-token prompts, log-normal
              turns, responses and tool latencies

Per workload and setting, warm (a first untimed round compiles), `--repeats` rounds alternating the
settings: tokens the engine ran through the model to fill caches (`EngineStats.prefill_tokens`:
prompts, appends, restores), the prefix hit rate, KV pages held at peak (`EngineStats.peak_pages`, a
shared page once; every round runs the same work), trajectories per 1,000 pages at that peak (how
many such trajectories one page budget holds at once), the rollout's wall seconds and generated
tok/s; the fastest round per setting, and the ratios off / shared and off / cached. The model:
`--hf_dir`'s real weights (fp32, one device), else the `tiny-moe` preset (random weights: prefill is
then too cheap to matter). `same tokens as off` says whether a setting sampled the trajectories `off`
did (T 1, seeded; where a batched prefill rounds a row differently, or the prefix cache's rest of a
prompt reads cached keys, a sample may differ by float rounding).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import time

import jax

import sfrrl_jax as S
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks

BFCL_LIKE = dict(num_prompts=8, prompt_len=1024, shared_prefix_len=768, turns_median=2.5, turns_sigma=0.3,
                 max_turns=3, response_median=20.0, response_sigma=0.4, max_response=32, tool_latency_median_s=0.02,
                 tool_latency_sigma=0.5, observation_len=32)
# name: (WorkloadConfig fields, group size, engine slots)
WORKLOADS = {
    "bfcl_like": (BFCL_LIKE, 4, 32),
    "bfcl_waves": (BFCL_LIKE, 4, 16),
    "stragglers": (dict(num_prompts=8), 4, 32),
}
SETTINGS = ("off", "shared", "cached")


def build_model(hf_dir: str | None):
    """(cfg, params) on a one-device mesh: an HF directory's weights, else tiny-moe's random ones."""
    mesh = S.make_mesh(devices=jax.devices()[:1])
    if hf_dir:
        return S.load_hf(hf_dir, mesh)
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=2048)
    return cfg, S.init_params(cfg, mesh, seed=0)


def rollout_round(engine, workload: WorkloadConfig, group: int) -> dict:
    """Every sample of every prompt at once, on a fresh agent (same seeded work each round)."""
    agent, tasks = WorkloadAgent(workload), make_tasks(workload)
    before = dataclasses.replace(engine.stats)

    async def main():
        return await asyncio.gather(*(agent(engine, t, s) for t in tasks for s in range(group)))
    t0 = time.perf_counter()
    trajs = asyncio.run(main())
    wall = time.perf_counter() - t0
    s = engine.stats
    prefill = s.prefill_tokens - before.prefill_tokens
    hits = s.prefix_hit_tokens - before.prefix_hit_tokens
    generated = sum(int(sum(t.loss_mask)) for t in trajs)
    return {"wall_s": wall, "prefill_tokens": prefill, "prefix_hit_tokens": hits,
            "prefix_hit_rate": hits / max(hits + prefill, 1), "generated_tokens": generated,
            "generated_tok_s": generated / wall, "peak_pages": s.peak_pages,
            "trajectories_per_1k_pages": 1000 * len(trajs) / max(s.peak_pages, 1),
            "tokens": [list(t.tokens) for t in trajs]}


def run_workload(name: str, cfg, params, repeats: int, page_size: int) -> dict:
    fields, group, slots = WORKLOADS[name]
    workload = WorkloadConfig(**fields, vocab_size=min(cfg.vocab_size, 32000))
    longest = workload.prompt_len + workload.max_turns * workload.max_response + workload.max_turns * workload.observation_len
    max_len = min(cfg.max_seq_len, 1 << longest.bit_length())
    pool = slots * -(-max_len // page_size)   # as many tokens as the dense cache
    settings = {"off": dict(share_prompts=False), "shared": {}, "cached": dict(prefix_cache_pages=pool)}
    engines = {mode: S.Engine(cfg, params, max_slots=slots, max_len=max_len, decode_steps=4, page_size=page_size,
                              **kw) for mode, kw in settings.items()}
    for engine in engines.values():   # warm: compiles every shape the rounds meet
        rollout_round(engine, workload, group)
    rounds = {mode: [] for mode in engines}
    for _ in range(repeats):
        for mode, engine in engines.items():
            engine.set_params(params)   # as at a trainer step: the prefix cache forgets (new weights)
            rounds[mode].append(rollout_round(engine, workload, group))
    for engine in engines.values():
        engine.release_memory()
    same = {mode: all(a["tokens"] == b["tokens"] for a, b in zip(rounds[mode], rounds["off"])) for mode in engines}
    best = {mode: min(rs, key=lambda r: r["wall_s"]) for mode, rs in rounds.items()}
    for r in best.values():
        r.pop("tokens")
    ratios = {f"off_over_{mode}": {k: best["off"][k] / max(best[mode][k], 1e-9)
                                   for k in ("prefill_tokens", "peak_pages", "wall_s")}
              for mode in ("shared", "cached")}
    return {"workload": name, "group_size": group, "prompts": workload.num_prompts, "slots": slots,
            "prompt_len": workload.prompt_len, "shared_prefix_len": workload.shared_prefix_len, "max_len": max_len,
            "page_size": page_size, "pool_pages": pool, "same_tokens_as_off": same, **best, **ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf_dir", default=None, help="an HF model directory (default: tiny-moe, random weights)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--out", default="bench_out/prefix_sharing.json")
    args = ap.parse_args()
    cfg, params = build_model(args.hf_dir)
    results = []
    for name in args.workloads:
        r = run_workload(name, cfg, params, args.repeats, args.page_size)
        results.append(r)
        print(f"[{name}] done: prompts x G = {r['prompts']} x {r['group_size']} on {r['slots']} slots, "
              f"same tokens as off: {r['same_tokens_as_off']}", flush=True)
    print(f"\nmodel: {args.hf_dir or 'tiny-moe (random weights)'}; page_size {args.page_size}; fastest of "
          f"{args.repeats} warm rounds per setting\n")
    print("| workload | setting | prefill tokens | prefix hit rate | peak pages | trajectories / 1k pages "
          "| rollout s | generated tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for mode in SETTINGS:
            m = r[mode]
            print(f"| {r['workload']} ({r['prompts']} x {r['group_size']}, prompt {r['prompt_len']}) | {mode} | "
                  f"{m['prefill_tokens']:,} | {m['prefix_hit_rate']:.1%} | {m['peak_pages']:,} | "
                  f"{m['trajectories_per_1k_pages']:.1f} | {m['wall_s']:.2f} | {m['generated_tok_s']:.1f} |")
        for mode in ("shared", "cached"):
            q = r[f"off_over_{mode}"]
            print(f"| {r['workload']} | off / {mode} | {q['prefill_tokens']:.2f}x fewer | | {q['peak_pages']:.2f}x "
                  f"fewer | {q['peak_pages']:.2f}x more | {q['wall_s']:.2f}x | |")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.hf_dir or "tiny-moe", "repeats": args.repeats,
                               "page_size": args.page_size, "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
