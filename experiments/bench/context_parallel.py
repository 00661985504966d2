"""Benchmark: per-device train-step memory with the sequence split over the `context` mesh axis.

One jitted gradient of the RL objective (the library's own `microbatch_objective`: forward,
chunked LM-head log-probs, clipped policy-gradient loss) of `tiny-moe` for one sequence of T
tokens, on meshes of `context` = 1, 2, 4, 8 fake CPU devices (one sequence, so no other axis
could split it). Memory is XLA's per-device temp allocation from `compiled.memory_analysis()`
(compile only: nothing is allocated, so long T is cheap to measure). The table also lists the
largest collective of each kind in the optimized HLO, to show that no device gathers the
sequence's hidden states: only K/V (all-gather, one layer at a time) and zig-zag chunks
(collective-permute) move.

    python experiments/bench/context_parallel.py [--seqs 4096,16384,65536 --out bench_out/context_parallel.json]

The baseline is context=1 in the same run (same model, same compiler); the goal of splitting the
sequence over c devices is per-device memory close to 1/c of it.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.learner.objective import microbatch_objective  # noqa: E402
from sfrrl_jax.mesh import sharding_for  # noqa: E402
from sfrrl_jax.models import transformer as tfm  # noqa: E402
from sfrrl_jax.rl.loss_fn import as_loss  # noqa: E402

MIB = 2 ** 20
COLLECTIVES = ("all-gather", "collective-permute", "reduce-scatter", "all-reduce", "all-to-all")


def grad_fn(cfg):
    loss = as_loss(S.LossConfig())

    def objective(params, batch):
        def forward_fn(p, tokens, segment_ids, positions):
            hidden, aux = tfm.forward_hidden(cfg, p, tokens, segment_ids, positions)
            return hidden, tfm.unembedding(cfg, p), aux
        return microbatch_objective(forward_fn, loss, (0.0, 0.0), params, batch)[0]

    return jax.jit(jax.grad(objective))


def largest_collectives(hlo: str) -> dict:
    """{kind: (count, largest result shape)} over the optimized HLO text."""
    out = {}
    for op in COLLECTIVES:
        shapes = re.findall(r"= (\w+\[[\d,]*\])\S* " + op + r"(?:-start)?\(", hlo)
        size = lambda s: eval("*".join(re.findall(r"\d+", s.split("[")[1])) or "1")  # noqa: E731
        out[op] = (len(shapes), max(shapes, key=size) if shapes else "-")
    return out


def measure(seq: int, context: int, block: int) -> dict:
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=seq, attention_block_q=block, attention_block_k=block)
    mesh = S.make_mesh(context=context, devices=jax.devices()[:context])
    params = S.init_params(cfg, mesh)   # tiny: real arrays are cheaper than abstract bookkeeping
    sh = sharding_for(mesh, ("batch", "seq"), (1, seq))
    batch = S.MicroBatch(**{k: jax.ShapeDtypeStruct((1, seq), dt, sharding=sh) for k, dt in
                            (("tokens", jnp.int32), ("loss_mask", jnp.int32), ("advantages", jnp.float32))})
    with jax.set_mesh(mesh):
        compiled = grad_fn(cfg).lower(params, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {"seq": seq, "context": context, "temp_mib": temp / MIB,
            "collectives": largest_collectives(compiled.as_text())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,16384,65536")
    ap.add_argument("--contexts", default="1,2,4,8")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--out", default="bench_out/context_parallel.json")
    args = ap.parse_args()
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        base = None
        for c in (int(x) for x in args.contexts.split(",")):
            r = measure(seq, c, args.block)
            base = r["temp_mib"] if c == 1 else base
            r["vs_context_1"] = None if base is None else base / r["temp_mib"]
            rows.append(r)
            coll = r["collectives"]
            print(f"T={seq:>6}  context={c}  temp/device {r['temp_mib']:8.1f} MiB"
                  + (f"  ({r['vs_context_1']:.2f}x less than context=1)" if c > 1 and base else "")
                  + f"  largest all-gather {coll['all-gather'][1]}, permute {coll['collective-permute'][1]}",
                  flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
