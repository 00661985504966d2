"""Benchmark: the MoE layer's expert-parallel dispatch under routing skew -- padded vs ragged vs
LLEP (models/llep.py), side by side, ratios against padded in the same run.

One MoE layer (`moe.moe_experts`: dispatch, experts, combine) forward + backward (grads of x and
the expert weights) on a mesh with `expert` = 8 fake CPU devices. Routing is drawn directly
(not by a router) so the skew is what the row says:
  uniform     -- each token's k experts uniform without replacement;
  zipf1/zipf15 -- expert e drawn with odds 1 / (e+1)^s, s = 1.0 / 1.5;
  one_hot     -- every token's first choice is expert 0, the rest uniform.
Columns:
  max load    -- the most (token, expert) rows one device computes: the native device's load for
                 padded/ragged, the plan's for LLEP (`llep.plan_spill` on the same counts).
  temp MiB    -- `compiled.memory_analysis().temp_size_in_bytes` of the fwd+bwd step (per device
                 program): the dispatch buffers and everything else the step holds.
  ffn rows x groups -- the static expert-compute buffer per device: S * a rows over n_local
                 experts for padded/ragged, R rows over n_local + Z (guest slots) for LLEP
                 (`llep.buffer_rows`). A grouped GEMM (TPU/GPU kernels) costs ~ rows; XLA:CPU lowers
                 `ragged_dot` to a dot over every group (~ rows x groups), and LLEP's R is sized so
                 that R * (n_local + Z) >= n_local * S * a: on CPU its buffers and FLOPs cannot drop
                 below padded's, whatever the skew. The measured win on CPU is the max load only.
  ms          -- median step time over `iters` warm calls (8 fake devices share the host's cores:
                 noisy; compare within one run).
'ragged' on CPU is the all-gather emulation of `ragged_all_to_all` (XLA:CPU has none), so its
time and bytes here are not the GPU path's; LLEP's token exchange uses the same emulation on CPU.

    python experiments/bench/moe_dispatch.py [--tokens 1024 --experts 32 --top-k 4 --iters 5]
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.models import llep, moe as moe_lib  # noqa: E402

ROUTINGS = ("uniform", "zipf1", "zipf15", "one_hot")
DISPATCHES = ("padded", "ragged", "llep")


def draw_ids(kind: str, n: int, e: int, k: int, rng) -> np.ndarray:
    if kind == "one_hot":
        rest = np.stack([rng.choice(np.arange(1, e), k - 1, replace=False) for _ in range(n)])
        return np.concatenate([np.zeros((n, 1), np.int64), rest], axis=1).astype(np.int32)
    p = np.ones(e) if kind == "uniform" else 1.0 / np.arange(1, e + 1) ** {"zipf1": 1.0, "zipf15": 1.5}[kind]
    return np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(n)]).astype(np.int32)


def max_loads(cfg, ids, shards: int) -> dict:
    """Per-device max computed rows of one expert-parallel group, standard EP vs the LLEP plan."""
    n = ids.shape[0] // shards
    counts = np.stack([np.bincount(ids[s * n:(s + 1) * n].ravel(), minlength=cfg.n_experts)
                       for s in range(shards)])
    n_local = cfg.n_experts // shards
    native = counts.sum(axis=0).reshape(shards, n_local).sum(axis=1)
    rows, _ = llep.plan_spill(jnp.asarray(counts), n_local, n * cfg.top_k, cfg.llep_threshold,
                              llep.CAPACITY_FACTOR, llep.default_spill_slots(cfg.n_experts, shards))
    planned = np.asarray(rows).sum(axis=0)
    return {"padded": int(native.max()), "ragged": int(native.max()), "llep": int(planned.max()),
            "mean": float(native.mean())}


def ffn_buffer(cfg, n_tokens: int, shards: int) -> dict:
    """(rows, groups) of each dispatch's static expert-compute buffer on one device."""
    a = n_tokens // shards * cfg.top_k
    n_local = cfg.n_experts // shards
    z = llep.default_spill_slots(cfg.n_experts, shards)
    r = llep.buffer_rows(a, shards, n_local, cfg.llep_threshold, llep.CAPACITY_FACTOR, z)
    return {"padded": (shards * a, n_local), "ragged": (shards * a, n_local), "llep": (r, n_local + z)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="bench_out/moe_dispatch.json")
    args = ap.parse_args()
    shards = len(jax.devices())
    mesh = S.make_mesh(expert=shards)
    base = S.ModelConfig.preset("tiny-moe", d_model=args.d_model, d_ff_expert=args.d_ff,
                                n_experts=args.experts, top_k=args.top_k)
    params = S.init_params(base, mesh, seed=0)
    w = {k: v[0] for k, v in params["layers"]["moe"].items() if k.startswith("w_")}
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(args.tokens, args.d_model).astype(np.float32))
    weights = jnp.asarray(rng.dirichlet(np.ones(args.top_k), size=args.tokens).astype(np.float32))
    routes = {kind: draw_ids(kind, args.tokens, args.experts, args.top_k, rng) for kind in ROUTINGS}

    steps, temp = {}, {}
    for d in DISPATCHES:  # one compile per dispatch: the routing is an argument
        cfg = base.replace(moe_dispatch=d)
        loss = lambda x, w, ids, cfg=cfg: jnp.sum(moe_lib.moe_experts(cfg, x, ids, weights, w) ** 2)  # noqa: E731
        with jax.set_mesh(mesh):
            steps[d] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            compiled = steps[d].lower(x, w, jnp.asarray(routes["uniform"])).compile()
        temp[d] = compiled.memory_analysis().temp_size_in_bytes

    rows = []
    for kind in ROUTINGS:
        ids = jnp.asarray(routes[kind])
        loads = max_loads(base, routes[kind], shards)
        buffers = ffn_buffer(base, args.tokens, shards)
        for d in DISPATCHES:
            with jax.set_mesh(mesh):
                fn = functools.partial(steps[d], x, w, ids)
                jax.block_until_ready(fn())
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn())
                    times.append(time.perf_counter() - t0)
            rows.append({"routing": kind, "dispatch": d, "max_load": loads[d], "mean_load": loads["mean"],
                         "ffn_rows": buffers[d][0], "ffn_groups": buffers[d][1],
                         "temp_bytes": int(temp[d]), "ms": 1e3 * statistics.median(times)})
    print(f"{shards} devices on `expert`, {args.tokens} tokens, E={args.experts}, k={args.top_k}, "
          f"d={args.d_model}, f={args.d_ff}; fwd+bwd of one MoE layer; ragged on "
          f"{jax.default_backend()}: {'all-gather emulation' if jax.default_backend() == 'cpu' else 'native'}")
    print(f"{'routing':9s} {'dispatch':8s} {'max load':>8s} {'/mean':>6s} {'ffn rows x groups':>17s} "
          f"{'temp MiB':>9s} {'ms':>9s} {'load/pad':>8s} {'mem/pad':>8s} {'time/pad':>8s}")
    for r in rows:
        pad = next(p for p in rows if p["routing"] == r["routing"] and p["dispatch"] == "padded")
        r.update(load_vs_padded=r["max_load"] / pad["max_load"], mem_vs_padded=r["temp_bytes"] / pad["temp_bytes"],
                 time_vs_padded=r["ms"] / pad["ms"])
        print(f"{r['routing']:9s} {r['dispatch']:8s} {r['max_load']:8d} {r['max_load'] / r['mean_load']:6.2f} "
              f"{str(r['ffn_rows']) + ' x ' + str(r['ffn_groups']):>17s} {r['temp_bytes'] / 2**20:9.2f} "
              f"{r['ms']:9.2f} {r['load_vs_padded']:8.2f} "
              f"{r['mem_vs_padded']:8.2f} {r['time_vs_padded']:8.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "devices": shards, "backend": jax.default_backend(),
                               "llep": {"threshold": base.llep_threshold, "capacity_factor": llep.CAPACITY_FACTOR,
                                        "spill_slots": llep.default_spill_slots(args.experts, shards)},
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
