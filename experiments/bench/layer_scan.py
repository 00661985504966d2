"""Where batch-1 decode's time goes on XLA:CPU: a layer loop over stacked weights (issue #44).

    python experiments/bench/layer_scan.py [--layers 30 --d 576 --f 1536] [--out bench_out/layer_scan.json]

One token through `--layers` MLP-shaped layers ([1, d] @ [d, f] -> tanh -> @ [f, d]), SmolLM2-135M's
sizes by default: every weight is read once per token, so the time is memory-bound and its
bytes/s can be set against the machine's read bandwidth (`machine_limits.py`). Four ways:

  scan        `lax.scan` over weights stacked [layers, ...] (how `models.transformer` runs layers)
  unrolled    the same scan with `unroll=True` (static slices of the stacked arrays)
  separate    a Python loop over one array per layer (no slicing at all)
  torch       the same loop in torch on the same weights (what transformers' decode does)

Fastest of `--repeats` warm calls each; compare rows of one run only.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import machine_limits  # beside this script


def _fastest(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _layer(h, a, b):
    return jnp.tanh(h @ a) @ b * 0.01


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--f", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="bench_out/layer_scan.json")
    args = ap.parse_args()
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = jax.random.normal(k1, (args.layers, args.d, args.f), jnp.float32)
    w2 = jax.random.normal(k2, (args.layers, args.f, args.d), jnp.float32)
    x = jnp.ones((1, args.d), jnp.float32)
    per_layer = ([w1[i] for i in range(args.layers)], [w2[i] for i in range(args.layers)])

    def body(h, w):
        return _layer(h, *w), None

    scan = jax.jit(lambda x, a, b: jax.lax.scan(body, x, (a, b))[0])
    unrolled = jax.jit(lambda x, a, b: jax.lax.scan(body, x, (a, b), unroll=True)[0])

    def chain(x, a_list, b_list):
        for a, b in zip(a_list, b_list):
            x = _layer(x, a, b)
        return x
    separate = jax.jit(chain)
    ways = {"scan": lambda: jax.block_until_ready(scan(x, w1, w2)),
            "unrolled": lambda: jax.block_until_ready(unrolled(x, w1, w2)),
            "separate": lambda: jax.block_until_ready(separate(x, *per_layer))}
    try:
        import torch
        ta = [torch.from_numpy(np.array(a)) for a in per_layer[0]]
        tb = [torch.from_numpy(np.array(b)) for b in per_layer[1]]
        tx = torch.ones(1, args.d)

        def torch_chain():
            h = tx
            for a, b in zip(ta, tb):
                h = torch.tanh(h @ a) @ b * 0.01
            return h
        ways["torch"] = torch_chain
    except ImportError:
        pass
    weight_bytes = w1.nbytes + w2.nbytes
    bandwidth = machine_limits.memory_bytes_per_s()
    rows = []
    for name, fn in ways.items():
        t = _fastest(fn, args.repeats)
        rows.append({"way": name, "ms": 1e3 * t, "bytes_per_s": weight_bytes / t,
                     "bandwidth_share": weight_bytes / t / bandwidth})
    print(f"{args.layers} layers, {weight_bytes / 2**20:.0f} MiB of weights, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'way':>9s} {'ms/token':>9s} {'GB/s':>6s} {'share':>6s}")
    for r in rows:
        print(f"{r['way']:>9s} {r['ms']:9.2f} {r['bytes_per_s'] / 1e9:6.1f} {r['bandwidth_share']:6.0%}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "read_bandwidth": bandwidth}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
