"""Benchmark: where the train step's time goes (issue #23 point 3), by ablation in one run.

Medians of warm calls on one device, the tiny-moe preset (fp32), random tokens, the built-in
policy loss (`LossConfig()`), AdamW (`OptimizerConfig()`). Per micro-batch shape [rows, seq]:
  step       `TrainStep.step`: forward, backward and the optimizer update, fused.
  micro      `grad_microstep` alone (forward + backward into the accumulator): step - micro is
             the update's share (AdamW over every param, the norm, the finite check).
  forward    the same objective without the gradient (one forward and the chunked log-probs):
             micro - forward is the backward pass.
  dense      `grad_microstep` of a dense twin (n_experts=0, d_ff = top_k x d_ff_expert: the same
             active FLOPs): what the MoE dispatch costs beyond its arithmetic, both passes.
  compiles   executables the step compiled over all timed calls of the shape: 1 (no
             recompilation across calls of one shape bucket).

    python experiments/bench/train_profile.py [--shapes 4x64 16x128 8x512] [--iters 10]
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
from sfrrl_jax.learner import make_train_step  # noqa: E402
from sfrrl_jax.learner.objective import microbatch_objective  # noqa: E402
from sfrrl_jax.learner.optimizer import OptimizerConfig  # noqa: E402
from sfrrl_jax.models.api import mesh_of  # noqa: E402
from sfrrl_jax.rl.config import LossConfig  # noqa: E402


def median_ms(fn, iters: int) -> float:
    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def batch(cfg, rows: int, seq: int, seed: int) -> S.MicroBatch:
    rng = np.random.RandomState(seed)
    mask = np.ones((rows, seq), np.float32)
    mask[:, : seq // 4] = 0.0  # a prompt: no loss there
    return S.MicroBatch(rng.randint(0, cfg.vocab_size, (rows, seq)).astype(np.int32), loss_mask=mask,
                        advantages=rng.randn(rows, seq).astype(np.float32) * mask,
                        rollout_logprobs=np.zeros((rows, seq), np.float32))


def profile(cfg, params, rows: int, seq: int, iters: int) -> dict:
    ts = make_train_step(cfg, LossConfig(), OptimizerConfig())
    mb = batch(cfg, rows, seq, seed=rows * seq)
    held = {"p": jax.tree.map(jnp.copy, params), "o": ts.init_opt_state(params)}

    def step():
        held["p"], held["o"], metrics = ts.step(held["p"], held["o"], mb)  # params/opt donated
        return metrics["loss"]

    def micro():
        return ts.grad_microstep(params, ts.init_accumulator(params), mb).scalars.numerator

    placed = ts._prepare(params, mb)
    objective = jax.jit(functools.partial(microbatch_objective, ts.forward_fn, ts.loss, ts.router_coefs))

    def forward():
        with jax.set_mesh(mesh_of(params)):
            return objective(params, placed)[0]

    out = {"rows": rows, "seq": seq, "step": median_ms(step, iters), "micro": median_ms(micro, iters),
           "forward": median_ms(forward, iters)}
    out["compiles"] = ts.jitted_step(params)._cache_size()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4x64", "16x128", "8x512"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="bench_out/train_profile.json")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=max(s for _, s in shapes))
    dense_cfg = cfg.replace(n_experts=0, d_ff=cfg.top_k * cfg.d_ff_expert)
    mesh = S.make_mesh(devices=jax.devices()[:1])
    params = S.init_params(cfg, mesh, seed=0)
    dense_params = S.init_params(dense_cfg, mesh, seed=0)
    rows = []
    for r, s in shapes:
        row = profile(cfg, params, r, s, args.iters)
        row["dense"] = profile(dense_cfg, dense_params, r, s, args.iters)["micro"]
        rows.append(row)
    print("tiny-moe fp32, 1 CPU device, policy loss + AdamW; ms per call")
    print(f"{'shape':>8s} {'step':>8s} {'micro':>8s} {'forward':>8s} {'dense':>8s} {'update':>7s} "
          f"{'backward':>8s} {'MoE':>6s} {'compiles':>8s}")
    for x in rows:
        print(f"{x['rows']:>3d}x{x['seq']:<4d} {x['step']:8.2f} {x['micro']:8.2f} {x['forward']:8.2f} "
              f"{x['dense']:8.2f} {1 - x['micro'] / x['step']:7.0%} {1 - x['forward'] / x['micro']:8.0%} "
              f"{1 - x['dense'] / x['micro']:6.0%} {x['compiles']:8d}")
    print("update: share of the step past the micro-step; backward: share of the micro-step past the "
          "forward; MoE: share of the micro-step past a dense twin of the same active FLOPs")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
