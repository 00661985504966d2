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

Second table, routing replay (R3) in bf16: a bf16 MoE (the dispatch table's expert width, two
layers) rolls out multi-turn workload trajectories on an engine recording routes (many in
flight: the decode batches mix trajectories); the train forward then sees them as one padded
batch of another shape. Without replay, the share of (token, layer, choice) routing decisions
and of tokens with any decision that differ from the engine's; with and without replay, the
mean and max |train - engine| log-prob of the generated tokens (the policy-gradient ratio's
error), and the train router's agreement with the replayed experts.

    python experiments/bench/moe_dispatch.py [--tokens 1024 --experts 32 --top-k 4 --iters 5]
                                             [--replay-prompts 8 --replay-samples 4]
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
from sfrrl_jax.models import llep, moe as moe_lib, transformer as tfm  # noqa: E402

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


def replay_table(args, mesh) -> list[dict]:
    """Routing decisions and log-prob mismatch, engine vs train forward, R3 off / on (bf16)."""
    import asyncio
    from sfrrl_jax.engine import Engine
    from sfrrl_jax.rl.config import LossConfig
    from sfrrl_jax.rl.loss_fn import policy_loss
    from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
    from sfrrl_jax.trainer.batching import batch_fields, microbatch_from_trajectories

    cfg = S.ModelConfig.preset("tiny-moe", n_experts=args.experts, top_k=args.top_k, d_ff_expert=args.d_ff,
                               max_seq_len=128, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = S.init_params(cfg, mesh, seed=0)
    wl = WorkloadConfig(num_prompts=args.replay_prompts, response_median=12, response_sigma=0.6, max_response=32,
                        tool_latency_median_s=0.001, tool_latency_sigma=0.1, max_turns=3)
    engine = Engine(cfg, params, max_slots=16, max_len=128, buckets=(16, 32, 64), decode_steps=4,
                    max_consecutive_faults=0, record_routes=True)
    agent = WorkloadAgent(wl, temperature=1.0)

    async def rollouts():
        return await asyncio.gather(*(agent(engine, t, s) for t in make_tasks(wl) for s in range(args.replay_samples)))
    trajs = asyncio.run(rollouts())
    dims = tfm.route_dims(cfg)
    mb = microbatch_from_trajectories(trajs, np.zeros(len(trajs)), 32, 128, batch_fields(policy_loss(
        LossConfig(routing_replay="r3"))), dims)
    held, gen = mb.routes_mask.astype(bool), mb.loss_mask.astype(bool)

    def forward(p, tokens, seg, routes, mask):
        hidden, aux, used = tfm.forward_hidden(cfg, p, tokens, seg, routes=routes, routes_mask=mask, return_routes=True)
        logp = jax.nn.log_softmax(tfm.logits_from_hidden(cfg, p, hidden).astype(jnp.float32), -1)
        # the log-prob of token t comes from position t - 1
        picked = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
        return jnp.pad(picked, ((0, 0), (1, 0))), aux, used

    rows = []
    with jax.set_mesh(mesh):
        run = jax.jit(forward)
        for replay in (False, True):
            mask = mb.routes_mask if replay else np.zeros_like(mb.routes_mask)
            logp, aux, used = run(params, mb.tokens, mb.segment_ids, mb.routes, mask)
            used, engine_ids = np.sort(np.asarray(used)[held], -1), np.sort(mb.routes[held], -1)
            diff = np.abs(np.asarray(logp) - mb.rollout_logprobs)[gen]
            rows.append({"replay": "r3" if replay else "off", "decisions_differ": float(np.mean(used != engine_ids)),
                         "tokens_touched": float(np.mean(np.any(used != engine_ids, axis=(1, 2)))),
                         "mismatch_mean": float(diff.mean()), "mismatch_max": float(diff.max()),
                         "agreement": float(aux["routing_agreement"]) if replay else None,
                         "tokens": int(held.sum()), "generated": int(gen.sum()), "rows": len(trajs)})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--replay-prompts", type=int, default=8)
    ap.add_argument("--replay-samples", type=int, default=4)
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
    replay = replay_table(args, mesh)
    r = replay[0]
    print(f"\nrouting replay, bf16, E={args.experts}, k={args.top_k}: {r['rows']} trajectories, {r['tokens']} fed "
          f"tokens ({r['generated']} generated); engine decode batches vs one train batch")
    print(f"{'replay':6s} {'decisions differ':>16s} {'tokens touched':>14s} {'|dlogp| mean':>12s} "
          f"{'|dlogp| max':>11s} {'agreement':>9s}")
    for r in replay:
        agree = "-" if r["agreement"] is None else f"{r['agreement']:.4f}"
        print(f"{r['replay']:6s} {r['decisions_differ']:16.2%} {r['tokens_touched']:14.2%} {r['mismatch_mean']:12.3e} "
              f"{r['mismatch_max']:11.3e} {agree:>9s}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "devices": shards, "backend": jax.default_backend(),
                               "llep": {"threshold": base.llep_threshold, "capacity_factor": llep.CAPACITY_FACTOR,
                                        "spill_slots": llep.default_spill_slots(args.experts, shards)},
                               "rows": rows, "routing_replay": replay}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
