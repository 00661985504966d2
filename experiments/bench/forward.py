"""Benchmark: tiny-moe forward tokens/s for expert=1 vs expert=8 (fake CPU devices), and one MoE
layer (sort + grouped-matmul dispatch) vs a dense loop over experts. Prints a table, writes JSON.

    python experiments/bench/forward.py [--batch 16 --seq 128 --iters 5 --out bench_out/forward.json]

Times are medians over `iters` after a compile+warm-up call; compare rows of one run only.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.models import moe as moe_lib, transformer as tfm  # noqa: E402
from timing import timed  # noqa: E402


def dense_loop_moe(cfg, x, ids, weights, w):
    """Every expert applied to every token, masked by the routing: the no-dispatch baseline."""
    out = jnp.zeros_like(x)
    for e in range(cfg.n_experts):
        h = jax.nn.silu(x @ w["w_gate"][e]) * (x @ w["w_up"][e])
        gate = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=1)
        out = out + gate[:, None] * (h @ w["w_down"][e])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="bench_out/forward.json")
    args = ap.parse_args()
    cfg = S.ModelConfig.preset("tiny-moe")
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    n_tok = tokens.size
    rows = []
    meshes = {"expert=1 (1 device)": S.make_mesh(devices=jax.devices()[:1]),
              "expert=8 (8 devices)": S.make_mesh(expert=8)}
    for label, mesh in meshes.items():
        for dispatch in ("padded", "ragged"):
            c = cfg.replace(moe_dispatch=dispatch)
            params = S.init_params(c, mesh, seed=0)
            f = jax.jit(lambda p, t, c=c: tfm.forward_with_aux(c, p, t)[0])
            with jax.set_mesh(mesh):
                sec = timed(f, params, tokens, iters=args.iters)
            rows.append({"what": f"forward {label}", "dispatch": dispatch, "seconds": sec,
                         "tokens_per_s": n_tok / sec})
            if label.startswith("expert=1"):
                break  # one shard: both dispatch paths are the same local code
    # one MoE layer on one device: dispatch + grouped matmul vs the dense loop over experts
    mesh1 = meshes["expert=1 (1 device)"]
    params = S.init_params(cfg, mesh1, seed=0)
    w = {k: v[0] for k, v in params["layers"]["moe"].items() if k.startswith("w_")}
    x = jax.random.normal(jax.random.key(0), (n_tok, cfg.d_model))
    ids, weights, _ = moe_lib.route(cfg, x, params["layers"]["moe"]["router"][0])
    for name, fn in (("MoE layer: sort + grouped matmul", functools.partial(moe_lib.moe_experts, cfg)),
                     ("MoE layer: dense loop over experts", functools.partial(dense_loop_moe, cfg))):
        with jax.set_mesh(mesh1):
            sec = timed(jax.jit(fn), x, ids, weights, w, iters=args.iters)
        rows.append({"what": name, "dispatch": "-", "seconds": sec, "tokens_per_s": n_tok / sec})
    base = rows[0]["tokens_per_s"]
    print(f"{'what':44s} {'dispatch':8s} {'ms':>9s} {'tokens/s':>11s} {'vs row 1':>8s}")
    for r in rows:
        print(f"{r['what']:44s} {r['dispatch']:8s} {1e3 * r['seconds']:9.2f} {r['tokens_per_s']:11.0f} "
              f"{r['tokens_per_s'] / base:8.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": args.batch, "seq": args.seq, "cpu_count": os.cpu_count(),
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
