"""Benchmark: the engine's per-token sampling against two baselines.

1. The vocabulary sort: `engine.sampling.sample` sorts the vocabulary only when some sampled row
   uses top-k / top-p; the baseline is the same function with the sort forced for every call.
2. The random draw: `sample` draws by two-stage Gumbel-max (`gumbel_max_draw`, ~2 sqrt(vocab)
   variates a row); the baseline is the same function drawing with one Gumbel variate per
   vocabulary entry (`jax.random.categorical` per row, what it did before).

Plain temperature sampling (top_k 0, top_p 1) at a Qwen3-sized vocabulary (151,936), batch 1
and 32, medians of warm jitted calls in one process.

    python experiments/bench/sampling.py [--vocab 151936 --batches 1,32 --out bench_out/sampling.json]
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sfrrl_jax.engine import sampling  # noqa: E402


def sort_always(logits, sp, token_index):
    """`sample` with the top-k/top-p sort on every call (the baseline)."""
    original = jax.lax.cond
    jax.lax.cond = lambda pred, t, f, *ops: t(*ops)  # trace-time only: take the sorting branch
    try:
        return sampling.sample(logits, sp, token_index)
    finally:
        jax.lax.cond = original


def one_variate_per_entry(seed, token_index, logits):
    """The draw's baseline: a Gumbel variate per vocabulary entry (`jax.random.categorical`)."""
    def draw(s, i, row):
        return jax.random.categorical(jax.random.fold_in(jax.random.key(s), i), row)
    return jax.vmap(draw)(seed, token_index, logits).astype(jnp.int32)


def draw_per_entry(logits, sp, token_index):
    """`sample` with the baseline draw (trace-time swap, like `sort_always`)."""
    original = sampling.gumbel_max_draw
    sampling.gumbel_max_draw = one_variate_per_entry
    try:
        return sampling.sample(logits, sp, token_index)
    finally:
        sampling.gumbel_max_draw = original


def median_ms(fn, logits, sp, iters):
    f = jax.jit(fn)
    b = logits.shape[0]
    jax.block_until_ready(f(logits, sp, jnp.zeros(b, jnp.int32)))
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(logits, sp, jnp.full((b,), i, jnp.int32)))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="bench_out/sampling.json")
    args = ap.parse_args()
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        logits = jax.random.normal(jax.random.key(0), (b, args.vocab)) * 3.0
        sp = sampling.SamplingParams(jnp.ones(b), jnp.zeros(b, jnp.int32), jnp.ones(b),
                                     jnp.arange(b, dtype=jnp.uint32))
        base = median_ms(sort_always, logits, sp, args.iters)
        per_entry = median_ms(draw_per_entry, logits, sp, args.iters)
        new = median_ms(sampling.sample, logits, sp, args.iters)
        rows.append({"batch": b, "vocab": args.vocab, "sort_always_ms": base, "draw_per_entry_ms": per_entry,
                     "sample_ms": new, "speedup_vs_sort": base / new, "speedup_vs_per_entry_draw": per_entry / new})
        print(f"batch {b:>3}  vocab {args.vocab}  sort always {base:8.2f} ms  a variate per entry {per_entry:8.2f} ms  "
              f"sample {new:8.2f} ms  ({base / new:5.1f}x, {per_entry / new:5.1f}x)", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
