"""Benchmark: decode tokens/s of our engine vs HF transformers `generate` on the same weights.

    python experiments/bench/decode.py [--batches 1 8 32] [--new 64] [--out bench_out/decode.json]
    python experiments/bench/decode.py --hf_dir /tmp/smollm2_hf    # real weights (experiments/smollm2.py converts)
        [--scan_layers false]    # per-layer params (ModelConfig.scan_layers), as the gin path on CPU

Both run greedy decoding of `--new` tokens from `--prompt`-token prompts on CPU, in this process.
Our side: the tiny-moe preset (or `--hf_dir`'s model, `load_hf`, fp32) on a 1-device mesh (fake
CPU devices add no compute), `S.generate` with its default slots (one per prompt) and
`decode_steps` tokens per device call. HF side: the same params exported with `save_hf` (or the
same `--hf_dir`), loaded with `from_pretrained`, `generate(do_sample=False)` with its KV cache,
fp32. Beside the table: this machine's measured memory bandwidth (`machine_limits.py`) and
batch-1 decode's share of it (param bytes x tokens/s: every param is read once per token). Each side: one warm-up call of the same shape (compiles excluded), then the fastest of
`--repeats` calls (single runs of either side varied by up to 2x on a shared machine).
The ratio column is ours / transformers; compare rows of one run only. `overlap/sequential`: our
engine with its decode chain overlapping host and device (chunk i+1 dispatched before chunk i is
fetched: the default on one device and on accelerators) against the same engine fetching each
chunk before dispatching the next, same weights, same run, timed alternately.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.checkpoints.hf import save_hf  # noqa: E402

import machine_limits  # noqa: E402  (experiments/bench/, beside this script)


def time_ours(cfg, params, prompts, new, decode_steps):
    kw = dict(max_new_tokens=new, max_len=256, decode_steps=decode_steps)   # slots: one per prompt, the default
    t0 = time.perf_counter()
    outs = S.generate(cfg, params, prompts, **kw)
    dt = time.perf_counter() - t0
    assert all(len(o.tokens) == new for o in outs)
    return dt, [o.tokens for o in outs]


def time_ours_sequential(cfg, params, prompts, new, decode_steps):
    """`time_ours` with the decode chain's host/device overlap off (each chunk fetched before the
    next is dispatched; the overlap is the default here, on one device), for the ratio."""
    from sfrrl_jax.engine.driver import Engine
    prop = Engine._overlap_chunks
    Engine._overlap_chunks = property(lambda self: False)
    try:
        return time_ours(cfg, params, prompts, new, decode_steps)
    finally:
        Engine._overlap_chunks = prop


def time_hf(model, prompts, new):
    import torch
    ids = torch.tensor(prompts)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def best_of(fn, repeats):
    """(the fastest of `repeats` timed calls, its output) after one untimed warm-up call (compiles,
    first-touch): the minimum is the least noisy estimate on a shared machine."""
    fn()
    return min((fn() for _ in range(repeats)), key=lambda r: r[0])


def best_of_pair(fa, fb, repeats):
    """`best_of` for two functions timed alternately (a, b, a, b, ...) after a warm-up of each: an
    A/B on this machine is otherwise biased by which side runs second (warmer caches, clocks)."""
    fa(), fb()
    ra, rb = [], []
    for _ in range(repeats):
        ra.append(fa())
        rb.append(fb())
    return min(ra, key=lambda r: r[0]), min(rb, key=lambda r: r[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode_steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch_threads", type=int, default=os.cpu_count())
    ap.add_argument("--hf_dir", default=None, help="an HF directory (default: the tiny-moe preset)")
    ap.add_argument("--scan_layers", choices=("true", "false"), default="true",
                    help="our params' layer layout with --hf_dir (load_hf's scan_layers; 'false': per-layer, "
                         "what the gin path runs an HF model in on CPU)")
    ap.add_argument("--out", default="bench_out/decode.json")
    args = ap.parse_args()
    import torch
    import transformers
    torch.set_num_threads(args.torch_threads)
    mesh = S.make_mesh(devices=jax.devices()[:1])
    if args.hf_dir:
        cfg, params = S.load_hf(args.hf_dir, mesh, dtype="float32", scan_layers=args.scan_layers == "true")
        model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, local_files_only=True,
                                                                  dtype=torch.float32).eval()
    else:
        cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=256)
        params = S.init_params(cfg, mesh, seed=0)
        with tempfile.TemporaryDirectory() as d:
            save_hf(cfg, params, d)
            model = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True,
                                                                      dtype=torch.float32).eval()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    limits = machine_limits.measure()
    rows = []
    rng = np.random.RandomState(0)
    for b in args.batches:
        prompts = rng.randint(3, cfg.vocab_size, (b, args.prompt)).tolist()
        (ours_s, outs), (seq_s, seq_outs) = best_of_pair(
            lambda: time_ours(cfg, params, prompts, args.new, args.decode_steps),
            lambda: time_ours_sequential(cfg, params, prompts, args.new, args.decode_steps), args.repeats)
        assert seq_outs == outs, "the overlapped chain changed tokens"
        hf_s, hf_tokens = best_of(lambda: time_hf(model, prompts, args.new), args.repeats)
        agree = float(np.mean([o == h for o, h in zip(outs, hf_tokens)]))
        rows.append({"batch": b, "new_tokens": args.new, "ours_s": ours_s, "hf_s": hf_s,
                     "ours_sequential_s": seq_s, "overlap_speedup": seq_s / ours_s,
                     "ours_tok_s": b * args.new / ours_s, "hf_tok_s": b * args.new / hf_s,
                     "ratio": hf_s / ours_s, "greedy_sequences_identical": agree})
    print(f"{'batch':>5s} {'ours tok/s':>11s} {'HF tok/s':>10s} {'ours/HF':>8s} {'same greedy':>11s} "
          f"{'overlap/sequential':>18s}")
    for r in rows:
        print(f"{r['batch']:5d} {r['ours_tok_s']:11.0f} {r['hf_tok_s']:10.0f} {r['ratio']:8.2f} "
              f"{r['greedy_sequences_identical']:11.0%} {r['overlap_speedup']:18.2f}")
    bandwidth = limits["memory_bytes_per_s"]
    for r in rows:
        # a decode step reads every param once, whatever the batch: at batch 1 that is the bound
        r["param_bytes_per_s"] = param_bytes * r["ours_tok_s"] / r["batch"]
        r["bandwidth_share"] = r["param_bytes_per_s"] / bandwidth
    print(f"model {cfg.name}: {param_bytes / 2**20:.0f} MiB of params; this machine: memory "
          f"{bandwidth / 1e9:.1f} GB/s, matmul {limits['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s; params read per "
          f"second / bandwidth: " + ", ".join(f"batch {r['batch']} {r['bandwidth_share']:.0%}" for r in rows))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "cpu_count": os.cpu_count(), "limits": limits,
                               "model": cfg.name, "param_bytes": param_bytes,
                               "transformers": transformers.__version__, "torch": torch.__version__},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
