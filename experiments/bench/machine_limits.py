"""This machine's measured limits, for benches that report their share of them (issue #44 point 4).

    python experiments/bench/machine_limits.py [--out bench_out/machine_limits.json]

- matmul FLOP/s: a warm `jnp.dot` of two [n, n] float32 matrices (2 n^3 FLOPs), the fastest of
  several calls, on the first JAX device (on CPU: XLA's own GEMM on every core it uses).
- memory read bandwidth, bytes/s: a warm jitted `jnp.sum` over a float32 array far larger than any
  cache (its bytes read once), the fastest of several calls. Reading is what decode does with
  the params; a pass that also writes measured a third of it here (each call's fresh 512 MiB
  output costs page faults), which is not the memory's limit.

A bench divides what it achieved by these: train FLOP/s (from XLA's cost analysis of the
compiled step) over matmul FLOP/s; batch-1 decode's bytes/s (every param read once per token)
over the bandwidth. Both are upper bounds of a kind a real program approaches, not a datasheet.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp


def _fastest(fn, repeats: int) -> float:
    jax.block_until_ready(fn())   # compile and warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops_per_s(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a warm float32 [n, n] x [n, n] matmul (the fastest of `repeats` calls)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    a, b = jax.random.normal(k1, (n, n), jnp.float32), jax.random.normal(k2, (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    return 2.0 * n ** 3 / _fastest(lambda: dot(a, b), repeats)


def memory_bytes_per_s(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s read by a warm reduction over a `mib` MiB float32 array (the fastest of `repeats`)."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / _fastest(lambda: total(x), repeats)


def measure(n: int = 2048, mib: int = 512, repeats: int = 5) -> dict:
    """{'matmul_flops_per_s', 'memory_bytes_per_s', 'device'} of this machine's first device."""
    return {"matmul_flops_per_s": matmul_flops_per_s(n, repeats),
            "memory_bytes_per_s": memory_bytes_per_s(mib, repeats), "device": str(jax.devices()[0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--out", default="bench_out/machine_limits.json")
    args = ap.parse_args()
    limits = measure(args.n, args.mib)
    print(f"matmul {limits['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, memory {limits['memory_bytes_per_s'] / 1e9:.1f} GB/s "
          f"({limits['device']})")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(limits, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
