"""Benchmark: one MoE layer at decode sizes on one device, the sorted sparse path vs every expert
on every token (`moe.all_experts_ffn`), the choice `grouped_matmul='auto'` makes on CPU below a size.

    python experiments/bench/moe_small_batch.py [--tokens 1 8 32 64 128 256] [--out bench_out/moe_small_batch.json]

tiny-moe's layer (8 experts of 64 x 64, top-2), random weights and routing (seeded), forward only
(what decode runs). sparse: `_dispatch_compute_combine` with the grouped matmul 'auto' would pick
without the all-experts path (ragged_dot while its dense expansion is small, then the tiled loop);
all experts: `all_experts_ffn`. Times: the best of `--repeats` rounds of 50 calls, the two timed
alternately; compare within a row. `auto picks` is what the model runs at that size.
"""
import argparse
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import sfrrl_jax as S
from sfrrl_jax.models import grouped_matmul as gm
from sfrrl_jax.models import moe


def per_call(fn, args, calls: int = 50) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench_out/moe_small_batch.json")
    args = ap.parse_args()
    cfg = S.ModelConfig.preset("tiny-moe")
    e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff_expert
    rng = np.random.RandomState(0)
    w = {name: jnp.asarray(rng.randn(*shape).astype(np.float32) * 0.1)
         for name, shape in (("w_gate", (e, d, f)), ("w_up", (e, d, f)), ("w_down", (e, f, d)))}
    rows = []
    for n in args.tokens:
        x = jnp.asarray(rng.randn(n, d).astype(np.float32))
        weights, ids = jax.lax.top_k(jax.nn.softmax(x @ jnp.asarray(rng.randn(d, e).astype(np.float32))), cfg.top_k)
        ids = ids.astype(jnp.int32)
        impl = gm.choose_impl("auto", n * cfg.top_k, e, d, f)
        sparse = jax.jit(lambda x, i, wt, c=cfg.replace(grouped_matmul=impl): moe._dispatch_compute_combine(c, 1, x, i, wt, w))
        dense = jax.jit(lambda x, i, wt: moe.all_experts_ffn(cfg, x, i, wt, w))
        a, b = sparse(x, ids, weights), dense(x, ids, weights)
        t_sparse, t_dense = [], []
        for _ in range(args.repeats):
            t_sparse.append(per_call(sparse, (x, ids, weights)))
            t_dense.append(per_call(dense, (x, ids, weights)))
        picks = "all experts" if moe._all_experts_is_cheaper(cfg, n, w) else f"sparse ({impl})"
        rows.append({"tokens": n, "sparse_us": 1e6 * min(t_sparse), "all_experts_us": 1e6 * min(t_dense),
                     "speedup": min(t_sparse) / min(t_dense), "max_diff": float(jnp.max(jnp.abs(a - b))),
                     "auto_picks": picks})
    print(f"tiny-moe MoE layer forward, 1 {jax.default_backend()} device; best of {args.repeats} x 50 calls")
    print(f"{'tokens':>6} {'sparse us':>10} {'all experts us':>15} {'speed-up':>9} {'max|diff|':>10}  auto picks")
    for r in rows:
        print(f"{r['tokens']:>6} {r['sparse_us']:>10.0f} {r['all_experts_us']:>15.0f} {r['speedup']:>9.2f} "
              f"{r['max_diff']:>10.1e}  {r['auto_picks']}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "backend": jax.default_backend(), "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
