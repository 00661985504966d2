"""Benchmark: the experts' grouped matmul, `ragged_dot` vs the tiled loop (models/grouped_matmul.py):
time of forward + both gradients and XLA's temp memory, on this backend, per shape.

    python experiments/bench/grouped_matmul.py [--iters 3 --out bench_out/grouped_matmul.json]

Shapes: rows m (sorted by expert, a quarter of them padding past the last group, as the padded
dispatch's worst-case buffers carry), g local experts, [k, n] per expert. Group sizes are drawn
once (seeded), identical for both implementations. Times are medians over `iters` after a compile
and warm-up call; compare the two columns of one row only. Where XLA has no grouped GEMM (CPU) it
expands `ragged_dot` to a dense dot over every group, so its time and temp grow with g.
"""
import argparse
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from sfrrl_jax.models import grouped_matmul as gm
from timing import timed

SHAPES = (  # (m, g, k, n)
    (2048, 8, 64, 64),        # tiny-moe at a training micro-batch (what 'auto' keeps on ragged_dot)
    (4096, 32, 256, 256),
    (8192, 32, 512, 512),     # a scaled-down 30B-A3B layer: 32 local experts of 128 over expert=4
)


def _case(m, g, k, n, seed=0):
    rng = np.random.RandomState(seed)
    used = 3 * m // 4
    sizes = np.bincount(rng.randint(0, g, used), minlength=g).astype(np.int32)
    rows = rng.randn(m, k).astype(np.float32)
    w = (rng.randn(g, k, n) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(rows), jnp.asarray(w), jnp.asarray(sizes)


def _step(impl, sizes):
    def loss(r, w):
        return jnp.sum(gm.grouped_matmul(r, w, sizes, impl) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default="bench_out/grouped_matmul.json")
    args = ap.parse_args()
    rows_out = []
    print(f"backend {jax.default_backend()}; forward + grads of sum(out^2), f32")
    print(f"{'m x g x k x n':>22s} {'auto picks':>11s} {'ragged_dot ms':>14s} {'tiled ms':>9s} {'speed-up':>8s} "
          f"{'ragged temp MB':>15s} {'tiled temp MB':>14s} {'max |diff|':>10s}")
    for m, g, k, n in SHAPES:
        rows, w, sizes = _case(m, g, k, n)
        res = {}
        for impl in ("ragged_dot", "tiled"):
            fn = _step(impl, sizes)
            temp = fn.lower(rows, w).compile().memory_analysis().temp_size_in_bytes
            res[impl] = {"seconds": timed(fn, rows, w, iters=args.iters), "temp_bytes": int(temp),
                         "value": fn(rows, w)}
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                   zip(jax.tree.leaves(res["ragged_dot"].pop("value")), jax.tree.leaves(res["tiled"].pop("value"))))
        auto = gm.choose_impl("auto", m, g, k, n)
        r, t = res["ragged_dot"], res["tiled"]
        print(f"{f'{m} x {g} x {k} x {n}':>22s} {auto:>11s} {1e3 * r['seconds']:14.1f} {1e3 * t['seconds']:9.1f} "
              f"{r['seconds'] / t['seconds']:7.2f}x {r['temp_bytes'] / 2**20:15.1f} {t['temp_bytes'] / 2**20:14.1f} "
              f"{diff:10.2e}")
        rows_out.append({"m": m, "g": g, "k": k, "n": n, "auto": auto, "max_abs_diff": diff, **{
            f"{impl}_{key}": v for impl in res for key, v in res[impl].items()}})
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backend": jax.default_backend(), "cpu_count": os.cpu_count(), "rows": rows_out},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
