"""Benchmark: the engine's per-token sampling with and without the vocabulary sort.

`engine.sampling.sample` sorts the vocabulary only when some sampled row uses top-k / top-p.
The baseline here is the same function with the sort forced for every call (what it did before):
plain temperature sampling (top_k 0, top_p 1) at a Qwen3-sized vocabulary (151,936), batch 1
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
        new = median_ms(sampling.sample, logits, sp, args.iters)
        rows.append({"batch": b, "vocab": args.vocab, "sort_always_ms": base, "sort_when_needed_ms": new,
                     "speedup": base / new})
        print(f"batch {b:>3}  vocab {args.vocab}  sort always {base:8.2f} ms  sort when needed {new:8.2f} ms  "
              f"{base / new:5.1f}x", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
