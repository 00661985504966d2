"""Benchmark: a group's shared prompt computed once (`Engine(share_prompts=True)`, the default) vs every
sample's prompt computed (`share_prompts=False`), on the same rollouts.

    python experiments/bench/prefix_sharing.py [--hf_dir /tmp/smollm2_hf] [--workloads bfcl_like stragglers]
        [--repeats 2] [--out bench_out/prefix_sharing.json]

Issue #47 points 4-5 (the compute side). Workloads, replayed by `testing.workload.WorkloadAgent` (seeded
token ids, tool waits, multi-turn; every sample of every group at once, as a trainer step launches them):

  bfcl_like   4 prompts x G 8 samples, 1024-token prompts (a system prompt with long tool schemas),
              2-3 turns of <= 32 tokens, 32-token tool results
  stragglers  the straggler bench's work: 8 prompts x G 4, 12-token prompts, log-normal turns,
              responses and tool latencies

Per workload and mode, warm (a first untimed round compiles), `--repeats` rounds alternating the modes:
tokens the engine ran through the model to fill caches (`EngineStats.prefill_tokens`: prompts, appends,
restores), the prefix hit rate (`prefix_hit_rate`), the rollout's wall seconds and generated tok/s; the
table shows the fastest round per mode and the ratios off / on. The model: `--hf_dir`'s real weights
(fp32, one device), else the `tiny-moe` preset (random weights: prefill is then too cheap to matter).
`same tokens on/off` says whether both modes sampled the same trajectories (T 1, seeded: they do where the
batched prefill rounds a shared and an own row of one prompt alike).
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

WORKLOADS = {
    "bfcl_like": (dict(num_prompts=4, prompt_len=1024, turns_median=2.5, turns_sigma=0.3, max_turns=3,
                       response_median=20.0, response_sigma=0.4, max_response=32, tool_latency_median_s=0.02,
                       tool_latency_sigma=0.5, observation_len=32), 8),
    "stragglers": (dict(num_prompts=8), 4),
}


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
            "generated_tok_s": generated / wall, "tokens": [list(t.tokens) for t in trajs]}


def run_workload(name: str, cfg, params, repeats: int) -> dict:
    fields, group = WORKLOADS[name]
    workload = WorkloadConfig(**fields, vocab_size=min(cfg.vocab_size, 32000))
    longest = workload.prompt_len + workload.max_turns * workload.max_response + workload.max_turns * workload.observation_len
    max_len = min(cfg.max_seq_len, 1 << longest.bit_length())
    engines = {mode: S.Engine(cfg, params, max_slots=workload.num_prompts * group, max_len=max_len,
                              decode_steps=4, share_prompts=mode == "on") for mode in ("on", "off")}
    for mode, engine in engines.items():   # warm: compiles every shape the rounds meet
        rollout_round(engine, workload, group)
    rounds = {"on": [], "off": []}
    for _ in range(repeats):
        for mode in ("on", "off"):
            rounds[mode].append(rollout_round(engines[mode], workload, group))
    for engine in engines.values():
        engine.release_memory()
    same = all(a["tokens"] == b["tokens"] for a, b in zip(rounds["on"], rounds["off"]))
    best = {mode: min(rs, key=lambda r: r["wall_s"]) for mode, rs in rounds.items()}
    for r in best.values():
        r.pop("tokens")
    return {"workload": name, "group_size": group, "prompts": workload.num_prompts, "prompt_len": workload.prompt_len,
            "max_len": max_len, "same_tokens": same, **{mode: best[mode] for mode in best},
            "prefill_tokens_ratio": best["off"]["prefill_tokens"] / max(best["on"]["prefill_tokens"], 1),
            "wall_ratio": best["off"]["wall_s"] / best["on"]["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf_dir", default=None, help="an HF model directory (default: tiny-moe, random weights)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench_out/prefix_sharing.json")
    args = ap.parse_args()
    cfg, params = build_model(args.hf_dir)
    results = []
    for name in args.workloads:
        r = run_workload(name, cfg, params, args.repeats)
        results.append(r)
        print(f"[{name}] done: prompts x G = {r['prompts']} x {r['group_size']}, same tokens on/off: {r['same_tokens']}",
              flush=True)
    print(f"\nmodel: {args.hf_dir or 'tiny-moe (random weights)'}; fastest of {args.repeats} warm rounds per mode\n")
    print("| workload | sharing | prefill tokens | prefix hit rate | rollout s | generated tok/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for mode in ("on", "off"):
            m = r[mode]
            print(f"| {r['workload']} ({r['prompts']} x {r['group_size']}, prompt {r['prompt_len']}) | {mode} | "
                  f"{m['prefill_tokens']:,} | {m['prefix_hit_rate']:.1%} | {m['wall_s']:.2f} | {m['generated_tok_s']:.1f} |")
        print(f"| {r['workload']} | off / on | {r['prefill_tokens_ratio']:.2f}x | | {r['wall_ratio']:.2f}x | |")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.hf_dir or "tiny-moe", "repeats": args.repeats, "results": results},
                              indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
