"""Benchmark: where the engine's decode time goes (issue #23 point 1), by ablation in one run.

Every figure is a median of warm calls on one device, the tiny-moe preset (fp32), every slot
active: the same executable the engine runs, timed with nothing else around it; the variants are
called round-robin (one call of each per round), so the machine's drift during a run falls on
all of them alike. Per batch size:
  chunk      `EngineSteps.generate` of `--decode_steps` tokens (sampling at temperature 1, as in
             RL), cache `--max_len` with `--max_len`/2 tokens live: ms per token step.
  greedy     the same with temperature 0 (no random draw; the sampler's top-k/top-p sort is
             already skipped when no row asks for it).
  cache/4    the same with a cache a quarter as long (same live tokens where they fit): what
             attending over the whole cache costs (the chunk here reads all max_len entries:
             its live length is past the engine's smaller decode buckets).
  model      the model alone for one token: `engine.model_step.extend` on [batch, 1] against the
             cache (no sampling, no state update), one jitted call per token.
  dense      the chunk of a dense twin (n_experts=0, d_ff = top_k x d_ff_expert: the same active
             FLOPs): what the MoE dispatch costs beyond its arithmetic.
  greedy_half  greedy with a cache half as long (max_len / 2, the decode bucket the wall run's
             chunks read: their live lengths stay below it).
  wall       `S.generate` (greedy) per token step past the prefill (a `--new`-token run minus a
             1-token run: the driver's host loop, results to the host, chunk after chunk); the
             host's share is 1 - greedy_half / wall. prefill: the 1-token run, in ms (the prompts
             admitted together by one `prefill_many` call).

    python experiments/bench/decode_profile.py [--batches 1 8 32] [--decode_steps 8] [--max_len 256]
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.engine.model_step import extend  # noqa: E402
from sfrrl_jax.engine.slot_state import DecodeState, SlotRequest  # noqa: E402
from sfrrl_jax.engine.steps import EngineSteps  # noqa: E402


def active_state(steps: EngineSteps, batch: int, live: int, vocab: int, temperature: float) -> DecodeState:
    """Every slot active with `live` cached tokens (zeros: the work does not depend on them)."""
    init = steps.init_decode_state()
    one = SlotRequest.make(temperature=temperature, max_new=steps.max_len, seed=0)
    req = jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], batch, axis=0), one)
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=np.arange(batch, dtype=np.uint32)))
    state = DecodeState(cache_k=init.cache_k, cache_v=init.cache_v, lengths=np.full(batch, live, np.int32),
                        last_token=np.arange(batch, dtype=np.int32) % vocab, generated=np.zeros(batch, np.int32),
                        draws=np.zeros(batch, np.int32), active=np.ones(batch, bool), request=req)
    return jax.device_put(state, jax.tree.map(lambda a: a.sharding, init))


def chunk_timer(cfg, params, mesh, batch, max_len, k, temperature=1.0):
    """A warm callable: one `generate(k)` with every slot live at max_len // 2 (the state reset
    each call, so every call runs the same positions); returns ms per token step."""
    steps = EngineSteps(cfg, mesh, max_slots=batch, max_len=max_len)
    live = max_len // 2 if max_len // 2 + k < max_len else max_len - k - 1
    state = active_state(steps, batch, live, cfg.vocab_size, temperature)

    def once() -> float:
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # generate donates its state
        t0 = time.perf_counter()
        jax.block_until_ready(steps.generate(params, fresh, k)[1].tokens)
        return 1e3 * (time.perf_counter() - t0) / k
    once(), once()   # compile, warm
    return once


def model_timer(cfg, params, mesh, batch, max_len):
    """A warm callable: the model alone for one token of every slot against a max_len cache
    (`extend`, the cache donated and fed back as the engine does); returns ms per call."""
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    tokens = np.zeros((batch, 1), np.int32)
    starts = np.full((batch,), max_len // 2, np.int32)
    fn = jax.jit(functools.partial(extend, cfg), donate_argnums=(3, 4))
    held = {"k": jnp.zeros(shape, jnp.float32), "v": jnp.zeros(shape, jnp.float32)}

    def once() -> float:
        with jax.set_mesh(mesh):
            t0 = time.perf_counter()
            logits, held["k"], held["v"] = fn(params, tokens, starts, held["k"], held["v"], starts + 1)
            jax.block_until_ready(logits)
            return 1e3 * (time.perf_counter() - t0)
    once(), once()
    return once


def interleaved_medians(timers: dict, iters: int) -> dict:
    """Median of `iters` calls of each timer, called round-robin (one of each per round), so a
    drift of the machine's speed during the run falls on every variant alike."""
    times = {name: [] for name in timers}
    for _ in range(iters):
        for name, once in timers.items():
            times[name].append(once())
    return {name: statistics.median(t) for name, t in times.items()}


def wall_ms(cfg, params, batch, new, k, max_len) -> tuple[float, float]:
    """(ms per token step of `S.generate` past the prompts' prefill, ms of the prefills): the
    difference of a `new`-token and a 1-token run (same prompts, both warm)."""
    prompts = np.random.RandomState(batch).randint(3, cfg.vocab_size, (batch, 16)).tolist()

    def run(n):
        kw = dict(max_new_tokens=n, max_slots=batch, max_len=max_len, decode_steps=k)
        S.generate(cfg, params, prompts, **kw)  # compiles
        t0 = time.perf_counter()
        S.generate(cfg, params, prompts, **kw)
        return time.perf_counter() - t0
    one, full = run(1), run(new)
    return 1e3 * (full - one) / (new - 1), 1e3 * one


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--decode_steps", type=int, default=8)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="bench_out/decode_profile.json")
    args = ap.parse_args()
    k, n = args.decode_steps, args.max_len
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=n)
    dense_cfg = cfg.replace(n_experts=0, d_ff=cfg.top_k * cfg.d_ff_expert)
    mesh = S.make_mesh(devices=jax.devices()[:1])
    params = S.init_params(cfg, mesh, seed=0)
    dense_params = S.init_params(dense_cfg, mesh, seed=0)
    rows = []
    for b in args.batches:
        timers = {
            "chunk": chunk_timer(cfg, params, mesh, b, n, k),
            "greedy": chunk_timer(cfg, params, mesh, b, n, k, temperature=0.0),
            "cache_quarter": chunk_timer(cfg, params, mesh, b, n // 4, k),
            "model": model_timer(cfg, params, mesh, b, n),
            "dense": chunk_timer(dense_cfg, dense_params, mesh, b, n, k),
            # the wall run's chunks: greedy, reading the max_len / 2 decode bucket
            "greedy_half": chunk_timer(cfg, params, mesh, b, n // 2, k, temperature=0.0),
        }
        r = {"batch": b, **interleaved_medians(timers, args.iters)}
        r["wall"], r["prefill_ms"] = wall_ms(cfg, params, b, args.new, k, n)
        rows.append(r)
    print(f"tiny-moe fp32, 1 CPU device, {k} tokens per device call, cache {n}; ms per token step "
          "(every slot one token); shares of the chunk")
    cols = ("chunk", "greedy", "cache_quarter", "model", "dense", "greedy_half", "wall", "prefill_ms")
    print(f"{'batch':>5s} " + " ".join(f"{c:>13s}" for c in cols) + f" {'host share':>10s}")
    for r in rows:
        print(f"{r['batch']:5d} " + " ".join(f"{r[c]:13.3f}" for c in cols)
              + f" {1 - r['greedy_half'] / r['wall']:10.0%}")
    for r in rows:
        c = r["chunk"]
        print(f"batch {r['batch']}: sampling {1 - r['greedy'] / c:+.0%}, cache beyond a quarter "
              f"{1 - r['cache_quarter'] / c:+.0%}, MoE vs dense twin {1 - r['dense'] / c:+.0%}, "
              f"model alone per call {r['model'] / c:.0%} of a chunk step, "
              f"host {1 - r['greedy_half'] / r['wall']:.0%} of wall")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
