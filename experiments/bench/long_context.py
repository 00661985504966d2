"""Benchmark: train-step memory and time vs sequence length, blockwise vs naive attention.

One jitted forward + backward of the next-token cross-entropy of `tiny-moe` (one sequence, one
device) per T. Memory is XLA's temp allocation from `compiled.memory_analysis()` (compiling
allocates nothing, so the naive path's memory is reported even where it could not run). The
naive path runs only up to --naive-run-max tokens and while its temp estimate is under half
the host RAM; it is compiled (for the memory column) up to --naive-compile-max.

    python experiments/bench/long_context.py [--max-seq 65536 --iters 1 --out bench_out/long_context.json]

Times are medians over `iters` warm calls after a compile + first call; compare rows of one run.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.models import transformer as tfm  # noqa: E402

MIB = 2 ** 20


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def train_step(cfg):
    """grad of the mean next-token cross-entropy w.r.t. the params (the train step's heavy part)."""

    def loss(params, tokens):
        logits, _ = tfm.forward_with_aux(cfg, params, tokens)
        logits, targets = logits[:, :-1], tokens[:, 1:]
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    return jax.jit(jax.value_and_grad(loss))


def measure(cfg, mesh, params, seq: int, run: bool, iters: int, ram_budget: int) -> dict:
    tokens = np.random.RandomState(seq).randint(0, cfg.vocab_size, (1, seq)).astype(np.int32)
    fn = train_step(cfg)
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        compiled = fn.lower(params, tokens).compile()
        compile_s = time.perf_counter() - t0
        temp = compiled.memory_analysis().temp_size_in_bytes
        row = {"impl": cfg.attention_impl, "seq": seq, "temp_mib": temp / MIB, "compile_s": compile_s,
               "step_s": None, "loss": None}
        if run and temp < ram_budget:
            loss, _ = jax.block_until_ready(compiled(params, tokens))  # first call
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                loss, _ = jax.block_until_ready(compiled(params, tokens))
                times.append(time.perf_counter() - t0)
            row["step_s"] = statistics.median(times)
            row["loss"] = float(loss)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-seq", type=int, default=1024)
    ap.add_argument("--max-seq", type=int, default=65536)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--block-q", type=int, default=None, help="default: ModelConfig's")
    ap.add_argument("--block-k", type=int, default=None)
    ap.add_argument("--naive-run-max", type=int, default=8192)
    ap.add_argument("--naive-compile-max", type=int, default=32768)
    ap.add_argument("--out", default="bench_out/long_context.json")
    args = ap.parse_args()

    mesh = S.make_mesh(devices=jax.devices()[:1])
    seqs = []
    seq = args.min_seq
    while seq <= args.max_seq:
        seqs.append(seq)
        seq *= 2
    blocks = {k: v for k, v in (("attention_block_q", args.block_q), ("attention_block_k", args.block_k)) if v}
    base = S.ModelConfig.preset("tiny-moe", max_seq_len=max(seqs), **blocks)
    params = S.init_params(base, mesh, seed=0)
    ram_budget = host_ram_bytes() // 2
    rows = []
    print(f"{'T':>7} | {'blockwise MiB':>13} {'x prev':>6} {'step s':>8} | {'naive MiB':>10} {'x prev':>6} "
          f"{'step s':>8}", flush=True)
    prev = {}
    for seq in seqs:
        line = {}
        for impl in ("blockwise", "naive"):
            if impl == "naive" and seq > args.naive_compile_max:
                line[impl] = None
                continue
            row = measure(base.replace(attention_impl=impl), mesh, params, seq,
                          run=impl == "blockwise" or seq <= args.naive_run_max, iters=args.iters,
                          ram_budget=ram_budget)
            row["growth"] = row["temp_mib"] / prev[impl] if impl in prev else None
            prev[impl] = row["temp_mib"]
            rows.append(row)
            line[impl] = row

        def cells(r, width):
            if r is None:
                return f"{'-':>{width}} {'':>6} {'-':>8}"
            growth = f"{r['growth']:.2f}" if r["growth"] else ""
            step = f"{r['step_s']:.3f}" if r["step_s"] is not None else "skip"
            return f"{r['temp_mib']:>{width}.1f} {growth:>6} {step:>8}"

        print(f"{seq:>7} | {cells(line['blockwise'], 13)} | {cells(line['naive'], 10)}", flush=True)
        # same params, same tokens: the two paths must agree where both ran
        if line["naive"] and line["naive"]["loss"] is not None:
            assert abs(line["naive"]["loss"] - line["blockwise"]["loss"]) < 1e-4, line

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": "tiny-moe", "batch": 1, "devices": 1, "backend": jax.default_backend(),
            "cpu_count": os.cpu_count(), "host_ram_gib": host_ram_bytes() / 2 ** 30,
            "block_q": base.attention_block_q, "block_k": base.attention_block_k, "iters": args.iters}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
