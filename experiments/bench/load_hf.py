"""Benchmark: `sfrrl_jax.load_hf` vs `transformers.from_pretrained` on the same HF directory.

Builds (once, cached under --dir) a random Qwen3-MoE or GPT-OSS checkpoint of a few hundred MB in
bf16 with transformers' `save_pretrained` (sharded at --shard-mb), then loads it in fresh
subprocesses (--repeats per row, the fastest shown), so each row's peak RSS is its own:
  transformers  -- `from_pretrained(dtype=bfloat16)` on CPU
  load_hf       -- on 8 fake CPU devices, per mesh in --meshes (DATAxEXPERT)
RSS is sampled every 2 ms during the load. On CPU the "devices" are host memory, so load_hf's
RSS includes the params themselves: `resident` = bytes of the loaded params in that process, all
copies (dense weights are replicated over data x expert, experts over data). Columns:
  transient  = peak - final: memory that was needed only while loading (staging buffers; `final`
               is measured after gc + malloc_trim, so freed heap does not count as live);
  kept extra = final - baseline - resident: what stays beyond the params (compiled executables,
               runtime caches, transformers' own structures).
"Peak host memory about one tensor" means load_hf's transient is of the order of the largest HF
tensor (printed above the table). After the first row the files sit in the page cache;
transformers runs first and again last, so the cache effect is visible.

    python experiments/bench/load_hf.py [--family qwen3_moe --layers 8 --experts 32 --d-model 512 \
        --d-ff 512 --meshes 1x8,2x4 --out bench_out/load_hf.json]
"""
import argparse
import ctypes
import gc
import json
import os
import pathlib
import resource
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class RssSampler:
    """Samples this process's RSS every 2 ms in a thread; `.peak` is the max seen since start()."""

    def __init__(self):
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.002)

    def __enter__(self):
        self.peak = _rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _measure(load, resident_bytes) -> dict:
    gc.collect()
    base = _rss_mb()
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        result = load()
        seconds = time.perf_counter() - t0
        gc.collect()
        # Hand freed heap back to the OS, so `final` is what is live, not what malloc keeps cached.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        final = _rss_mb()
    return dict(seconds=seconds, baseline_mb=base, peak_mb=sampler.peak, final_mb=final,
                resident_mb=resident_bytes(result) / 2**20), result


def build(args) -> pathlib.Path:
    import torch
    import transformers

    directory = pathlib.Path(args.dir) / f"{args.family}_L{args.layers}_E{args.experts}_D{args.d_model}_F{args.d_ff}"
    if (directory / "config.json").is_file():
        return directory
    common = dict(vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=args.d_model // 8,
                  num_experts_per_tok=4)
    if args.family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=args.experts,
                                             moe_intermediate_size=args.d_ff, norm_topk_prob=True)
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.GptOssConfig(**common, num_local_experts=args.experts, intermediate_size=args.d_ff)
        model_cls = transformers.GptOssForCausalLM
    torch.manual_seed(0)
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=f"{args.shard_mb}MB")
    return directory


def child_transformers(directory: str) -> dict:
    import torch
    import transformers

    config = json.loads((pathlib.Path(directory) / "config.json").read_text())
    cls = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "gpt_oss": transformers.GptOssForCausalLM}[config["model_type"]]
    row, _ = _measure(lambda: cls.from_pretrained(directory, local_files_only=True, dtype=torch.bfloat16),
                      lambda m: sum(p.numel() * p.element_size() for p in m.parameters()))
    return row


def child_ours(directory: str, data: int, expert: int) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import sfrrl_jax as S
    from sfrrl_jax.checkpoints.hf import load_hf

    mesh = S.make_mesh(data=data, expert=expert)
    row, (_, params) = _measure(
        lambda: jax.block_until_ready(load_hf(directory, mesh)),
        lambda r: sum(s.data.nbytes for x in jax.tree.leaves(r[1]) for s in x.addressable_shards))
    row["params"] = sum(int(x.size) for x in jax.tree.leaves(params))
    del params
    # Again in the same process: XLA's executables are cached, so this is the load without the
    # one-off compilation (a fixed cost per model shape, independent of the checkpoint's size).
    t0 = time.perf_counter()
    jax.block_until_ready(load_hf(directory, mesh))
    row["warm_seconds"] = time.perf_counter() - t0
    return row


def run_child(repeats: int, *argv) -> dict:
    """The row of the fastest of `repeats` fresh subprocesses (the machine may be shared)."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, __file__, "--child", *argv], check=True, capture_output=True,
                             text=True, cwd=ROOT)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["seconds"])
    best["all_seconds"] = [r["seconds"] for r in runs]
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "gpt_oss"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--meshes", default="1x8,2x4")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per row; the fastest is shown")
    ap.add_argument("--dir", default="/tmp/sfrrl_bench_load_hf")
    ap.add_argument("--out", default="bench_out/load_hf.json")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, directory, *rest = args.child
        result = child_transformers(directory) if kind == "transformers" else child_ours(directory, *map(int, rest))
        print(json.dumps(result))
        return

    directory = build(args)
    sys.path.insert(0, str(ROOT))
    from sfrrl_jax.checkpoints.hf.safetensors_io import CheckpointFiles

    files = CheckpointFiles(directory)
    total_mb = sum(i.nbytes for i in files.tensors.values()) / 2**20
    largest = max(files.tensors.values(), key=lambda i: i.nbytes)
    n_files = len({i.file for i in files.tensors.values()})
    print(f"checkpoint {directory}: {total_mb:.0f} MB bf16 in {n_files} files; largest tensor "
          f"{largest.name} {largest.shape} = {largest.nbytes / 2**20:.1f} MB")
    n = args.repeats
    rows = [("transformers.from_pretrained", run_child(n, "transformers", str(directory)))]
    for mesh in args.meshes.split(","):
        data, expert = mesh.split("x")
        rows.append((f"load_hf data={data} expert={expert}", run_child(n, "ours", str(directory), data, expert)))
    rows.append(("transformers.from_pretrained (again)", run_child(n, "transformers", str(directory))))

    header = (f"{'loader':38s} {'time s':>7s} {'base MB':>8s} {'peak MB':>8s} {'final MB':>9s} "
              f"{'resident MB':>12s} {'transient MB':>13s} {'kept extra MB':>14s}")
    print(header)
    print("-" * len(header))
    for name, r in rows:
        r["transient_mb"] = r["peak_mb"] - r["final_mb"]
        r["kept_extra_mb"] = r["final_mb"] - r["baseline_mb"] - r["resident_mb"]
        print(f"{name:38s} {r['seconds']:7.2f} {r['baseline_mb']:8.0f} {r['peak_mb']:8.0f} {r['final_mb']:9.0f} "
              f"{r['resident_mb']:12.0f} {r['transient_mb']:13.0f} {r['kept_extra_mb']:14.0f}")
    for name, r in rows:
        if "warm_seconds" in r:
            print(f"{name}: {r['warm_seconds']:.2f} s when loaded again in the same process (compiles cached)")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "checkpoint": str(directory), "family": args.family, "checkpoint_mb": total_mb, "files": n_files,
        "repeats": n, "largest_tensor": {"name": largest.name, "shape": list(largest.shape), "mb": largest.nbytes / 2**20},
        "rows": {name: r for name, r in rows}}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
