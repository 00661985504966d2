"""GPU suite: decode bandwidth, train-step MFU, ragged vs padded MoE dispatch, attention parity,
paged decode attention.

One script to run whenever a GPU is at hand (its table goes into the closing note); at toy size it
runs on CPU in well under a minute, and `tests/test_gpu_suite.py` runs it that way.

    python experiments/bench/gpu_suite.py                        # real on a GPU, toy elsewhere
    python experiments/bench/gpu_suite.py --size toy --sections decode train
    python experiments/bench/gpu_suite.py --peak-hbm 4.8e12 --peak-flops 989e12 --out bench_out/gpu_suite.json

Sizes (`--size`):
  real  qwen3-moe-30b-a3b's shapes (d 2048, 32/4 heads of 128, 128 experts top-8 of width 768,
        vocab 151936) with `--layers` (4) layers, bf16 params and compute; decode batches 1/64/256
        against a 4096-token dense cache; a train micro-batch of 8 x 2048 tokens. Sized for <= 8
        minutes on one H200, compiles included (each section prints its wall time).
  toy   the tiny-moe preset (fp32); decode batches 1/4/8; seconds on CPU.
On CPU the decode, train and attention sections run on one device (fake host devices share the
same cores and only add emulated collectives); the MoE section uses every device on `expert`.
On GPU every section uses every local device (one H200: a 1-device mesh).

Sections and columns (`--sections`, all by default):
  decode     the engine's jitted decode step (`EngineSteps.generate`, 8 tokens per call at real
             size, 4 at toy; temperature-1 sampling; every slot active at half the cache length,
             with the routes recorded), timed after two warm-up calls of the same shape; no
             prefill in the timing.
             tok/s      batch x tokens per call / median call time.
             ms/step    one token for every slot.
             experts    share of each MoE layer's experts the step's tokens used, measured from
                        the routes the step records (mean over steps and layers); uniform routing
                        would give 1 - (1 - top_k / n_experts) ** batch.
             GB/step    bytes a decode step must read at least: every non-expert param (attention,
                        router, norms, LM head), the embedding rows of the batch's tokens, the
                        expert weights times `experts` (an unused expert's weights need not be
                        read), and the whole dense KV cache (decode attends over all max_len
                        entries, masking the unused ones). Writes (one token per slot) are left out.
             GB/s       GB/step / ms/step.      HBM %   GB/s / the devices' peak ("-" unknown).
             Goal: >= 50 % of peak HBM bandwidth at batch 64 (real size).
  train      one micro-batch through `TrainStep.step` (forward, backward, AdamW update), the policy
             loss of `LossConfig()` on random tokens (loss mask ones, random advantages, zero
             rollout log-probs); timed after a compile call.
             model TF   6 x active params x tokens + causal attention 6 x layers x heads x
                        head_dim x seq x tokens, in TFLOP; active params: every matmul param but
                        the embedding lookup (the LM head counts), experts scaled by
                        top_k / n_experts.
             MFU        model TF / time / the devices' peak dense bf16 FLOP/s.
             The JSON also holds `xla_flops`, `cost_analysis()['flops']` of the lowered step: not
             printed and not an MFU, because XLA counts a loop body once whatever its trip count
             (the scanned layers, the attention block loops, the log-prob chunks) and a
             `ragged_dot` as if every row met every expert.
             Goal: MFU >= 35 % (real size). On GPU the train forward uses the Pallas attention
             (`--train-attention`), elsewhere blockwise.
  moe        `moe.moe_experts` (dispatch, experts, combine) forward + backward (VJP of a random
             cotangent) of one MoE layer on the `expert` axis, uniform random routing: padded
             (all_to_all) vs ragged (ragged_all_to_all; on CPU its all-gather emulation).
             max|dy|    max |ragged - padded| of the layer output.
             grad diff  max over dx and the expert weights' grads of max |ragged - padded|,
                        relative to max(1, max |padded grad|) of that array.
             ms, /padded  median fwd+bwd time and its ratio to padded's.
             With one shard (one GPU) both names run the same code: `moe_experts` has nothing
             to exchange on a 1-device expert axis.
  attention  the whole model's logits and param grads (of sum(logits * w), w random) with each
             `ModelConfig.attention_impl` against 'naive' (the reference): 'blockwise' (XLA
             loops) and 'pallas' (Triton kernels on GPU, interpret mode elsewhere). One packed
             batch: a full causal row and a row of two segments plus padding. The model's MLP is
             dense (width d_ff_expert): an expert choice flipped by rounding would swamp the
             attention's own error. Real size: the real attention shapes, 2 layers, a 4096
             vocabulary (the section checks attention, not the LM head), seq 2048; fp32 rows
             (matmul precision 'highest', so GPU TF32 cannot blur the comparison; 64-long tiles,
             as 128 x 128 fp32 tiles of head_dim 128 may overflow shared memory) and, on GPU,
             bf16 rows (the configured 512 blocks, i.e. the Pallas default 128 tiles), each
             against naive in its own dtype.
             max|dlogit| / rel  max |impl - naive| of the logits, and that over max |naive|.
             grad diff  max over params of max |impl - naive| / max(1, max |naive|) (as in
                        tests/models/test_attention_blockwise.py).
             ms         median fwd+bwd time.
  paged      decode attention of one layer over a paged KV cache (`models.paged_attention`'s
             kernel, Triton on GPU, interpret mode elsewhere) against the engine's gather path
             (the row's pages copied into a contiguous view, then `attend`), one new token a
             row; a long tail of row lengths (mean ~ a fifth of the cache), full attention and a
             window of 128 (gpt-oss' sliding layers). Real size: batch 64, qwen3-moe-30b-a3b's
             attention shapes (32 / 4 heads of 128), bf16, pages of 16, a 16k-token cache.
             gather/kernel  the gather path's time over the kernel's.
             KV GB/s    bytes of the keys and values each row can see (what the kernel must
                        read) / the kernel's time.
             max rel    max |kernel - gather| / max |gather|.
Times are medians over `--iters` calls after warm-up; compare rows of one run only. A section
(or an attention core) that raises is reported and skipped, so one failure on a scarce GPU does
not cost the other tables; `errors` in the JSON names it.
Peaks: `--peak-hbm` / `--peak-flops` (per device) or the table below by `device_kind`.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.engine import DecodeState, EngineSteps, SlotRequest  # noqa: E402
from sfrrl_jax.learner.train_step import batch_sharding  # noqa: E402
from sfrrl_jax.models import moe as moe_lib  # noqa: E402
from sfrrl_jax.models.paged_attention import paged_decode_attention, paged_decode_reference  # noqa: E402
from sfrrl_jax.models.transformer import moe_layer_ids  # noqa: E402
from sfrrl_jax.trainer.batching import batch_fields, zero_microbatch  # noqa: E402

# the report's module beside this script, also when the script is loaded by path (the test)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_suite_report import pct, print_results  # noqa: E402

SECTIONS = ("decode", "train", "moe", "attention", "paged")
ATTENTION_IMPLS = ("blockwise", "pallas")  # each against 'naive'
EXPERT_KEYS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")

# Datasheet peaks per device: (substring of `device.device_kind`, HBM bytes/s, dense bf16 FLOP/s).
# The first match wins, so the more specific names come first.
DEVICE_PEAKS = (
    ("H200", 4.8e12, 989e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),
    ("A100-SXM4-40GB", 1.555e12, 312e12),
    ("A100", 2.039e12, 312e12),
)

SIZES = {
    "real": dict(preset="qwen3-moe-30b-a3b", dtype="bfloat16", batches=(1, 64, 256), context=4096,
                 decode_steps=8, train_rows=8, train_seq=2048, moe_tokens=16384, attn_batch=2,
                 attn_seq=2048, attn_block={"float32": 64, "bfloat16": 512}, iters=5,
                 paged=dict(batch=64, heads=32, kv_heads=4, head_dim=128, page=16, context=16384,
                            windows=(0, 128))),
    "toy": dict(preset="tiny-moe", dtype="float32", batches=(1, 4, 8), context=64, decode_steps=4,
                train_rows=4, train_seq=64, moe_tokens=256, attn_batch=2, attn_seq=48, attn_block={"float32": 16},
                iters=2, paged=dict(batch=4, heads=4, kv_heads=2, head_dim=16, page=4, context=64, windows=(0, 8))),
}


# -- shared helpers ------------------------------------------------------------------------------

def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def model_devices() -> list:
    # Fake CPU devices share the host's cores: one device measures the same work without the
    # emulated collectives. A GPU host's devices are real, so all of them take part.
    return jax.devices() if on_gpu() else jax.devices()[:1]


def mesh_over(devices, n_experts: int):
    """`expert` as large as the device count and the experts allow, the rest on `data`."""
    expert = math.gcd(len(devices), max(n_experts, 1))
    return S.make_mesh(data=len(devices) // expert, expert=expert, devices=devices)


def device_peaks(args) -> tuple[float | None, float | None, str]:
    """(HBM bytes/s, bf16 FLOP/s) of one device, from the flags or the table; None if unknown."""
    kind = jax.devices()[0].device_kind
    hbm = flops = None
    if jax.default_backend() != "cpu":
        for name, h, f in DEVICE_PEAKS:
            if name in kind:
                hbm, flops = h, f
                break
    return args.peak_hbm or hbm, args.peak_flops or flops, kind


def median_time(fn, iters: int, warmup: int = 1):
    """(median seconds of `iters` calls after `warmup` calls, the last output)."""
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def param_bytes(params) -> dict:
    """Bytes and element counts of the params by role: 'expert' (MoE expert weights), 'embed'
    (the embedding table), 'other' (attention, router, norms, dense MLPs, LM head)."""
    out = {k: 0 for k in ("expert_bytes", "embed_bytes", "other_bytes", "expert", "embed", "other")}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(k, "key", str(k)) for k in path]
        role = "expert" if "moe" in keys and keys[-1] in EXPERT_KEYS else "embed" if keys[0] == "embed" else "other"
        out[role] += int(leaf.size)
        out[role + "_bytes"] += int(leaf.size) * leaf.dtype.itemsize
    return out


def active_matmul_params(cfg, sizes: dict) -> float:
    """Params one token multiplies through: all but the embedding lookup (which is a matmul only
    when tied to the LM head), experts scaled by top_k / n_experts."""
    share = cfg.top_k / cfg.n_experts if cfg.is_moe else 1.0
    return sizes["other"] + sizes["expert"] * share + (sizes["embed"] if cfg.tie_embeddings else 0)


def max_rel_diff(a, b) -> float:
    """Max over the arrays of a pytree of max |a - b| / max(1, max |b|)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(1.0, float(np.max(np.abs(y)))) if y.size else 1.0
        worst = max(worst, float(np.max(np.abs(x - y))) / scale if y.size else 0.0)
    return worst


def xla_flops(lowered) -> float | None:
    """XLA's flop count of a lowered computation (None where the backend gives none)."""
    try:
        ca = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 -- an estimate for the table; its absence is reported as '-'
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    flops = (ca or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def model_config(size: str, args):
    s = SIZES[size]
    if size == "real":
        return S.ModelConfig.preset(s["preset"], n_layers=args.layers, param_dtype=s["dtype"],
                                    compute_dtype=s["dtype"])
    return S.ModelConfig.preset(s["preset"], max_seq_len=1024)


class Model:
    """The section's model params, built once and shared by decode and train (train donates
    them: it hands the updated ones back here)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.mesh = mesh_over(model_devices(), cfg.n_experts)
        self.params = S.init_params(cfg, self.mesh, seed=0)
        self.sizes = param_bytes(self.params)


# -- 1. decode -----------------------------------------------------------------------------------

def decode_state(steps: EngineSteps, batch: int, length: int, vocab: int, seed: int) -> DecodeState:
    """Every slot active at `length` cached tokens, sampling at temperature 1 with its own seed.
    The cache content is zeros: a decode step's work does not depend on it."""
    init = steps.init_decode_state()
    one = SlotRequest.make(temperature=1.0, max_new=steps.max_len, seed=0)
    req = jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], batch, axis=0), one)
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling,
                                                               seed=np.arange(batch, dtype=np.uint32)))
    rng = np.random.RandomState(seed)
    state = DecodeState(
        cache_k=init.cache_k, cache_v=init.cache_v, lengths=np.full(batch, length, np.int32),
        last_token=rng.randint(0, vocab, batch).astype(np.int32), generated=np.zeros(batch, np.int32),
        draws=np.zeros(batch, np.int32), active=np.ones(batch, bool), request=req)
    # the engine's own layout, so the timed calls run the executable the engine would
    return jax.device_put(state, jax.tree.map(lambda a: a.sharding, init))


def bench_decode(model: Model, spec: dict, iters: int, peak_hbm: float | None) -> list[dict]:
    cfg, params, sizes = model.cfg, model.params, model.sizes
    k_steps, context = spec["decode_steps"], spec["context"]
    record = bool(moe_layer_ids(cfg))
    n_dev = model.mesh.size
    rows = []
    for b in spec["batches"]:
        steps = EngineSteps(cfg, model.mesh, max_slots=b, max_len=context, record_routes=record)
        start = context // 2
        if start + (iters + 2) * k_steps >= context - 1:
            raise ValueError(f"context {context} too short for {iters + 2} calls of {k_steps} steps")
        state = decode_state(steps, b, start, cfg.vocab_size, seed=b)
        holder = {"state": state}

        def call():
            holder["state"], res = steps.generate(params, holder["state"], k_steps)
            return res

        dt, res = median_time(call, iters, warmup=2)
        valid = np.asarray(res.valid)
        if not valid.all():
            raise RuntimeError(f"batch {b}: {int((~valid).sum())} slot-steps inactive in a timed call")
        if record:
            routes = np.asarray(res.routes)  # [steps, slots, moe layers, top_k]
            used = [len(np.unique(routes[s, :, layer])) for s in range(routes.shape[0])
                    for layer in range(routes.shape[2])]
            touched = float(np.mean(used)) / cfg.n_experts
        else:
            touched = 1.0
        step_s = dt / k_steps
        embed_read = (sizes["embed_bytes"] if cfg.tie_embeddings
                      else b * sizes["embed_bytes"] // cfg.vocab_size)
        weight_bytes = sizes["other_bytes"] + embed_read + sizes["expert_bytes"] * touched
        kv_bytes = steps.cache_bytes()
        step_bytes = weight_bytes + kv_bytes
        bw = step_bytes / step_s
        rows.append({"batch": b, "tok_s": b / step_s, "ms_step": 1e3 * step_s, "experts_touched": touched,
                     "experts_uniform": 1 - (1 - cfg.top_k / cfg.n_experts) ** b if cfg.is_moe else 1.0,
                     "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bytes_step": step_bytes,
                     "bandwidth": bw, "hbm_share": bw / (peak_hbm * n_dev) if peak_hbm else None,
                     "context": context, "start_len": start, "decode_steps": k_steps})
        del holder, state, res
    return rows


# -- 2. train ------------------------------------------------------------------------------------

def train_batch(ts, cfg, rows: int, seq: int, mesh) -> S.MicroBatch:
    """A policy-loss micro-batch of random tokens with the fields and dtypes the trainer builds."""
    rng = np.random.RandomState(0)
    mb = zero_microbatch(batch_fields(ts.loss), rows, seq)
    mb = mb.replace(tokens=rng.randint(0, cfg.vocab_size, (rows, seq)).astype(np.int32))
    mb.loss_mask[:] = 1.0
    if mb.advantages is not None:
        mb = mb.replace(advantages=rng.randn(rows, seq).astype(np.float32))
    if mb.segment_ids is not None:
        mb.segment_ids[:] = 1
    # only what the step reads, placed as `TrainStep` would place it (so each call skips the copy)
    mb = mb.select(set(ts.loss.fields) | set(ts.loss.forward_fields))
    return jax.tree.map(lambda v: jax.device_put(v, batch_sharding(mesh, v.shape)), mb)


def bench_train(model: Model, spec: dict, iters: int, peak_flops: float | None, attention: str) -> list[dict]:
    cfg = model.cfg.replace(attention_impl=attention)
    rows_, seq = spec["train_rows"], spec["train_seq"]
    ts = S.make_train_step(cfg, S.LossConfig(), S.OptimizerConfig(learning_rate=1e-6))
    params = model.params
    opt_state = ts.init_opt_state(params)
    batch = train_batch(ts, cfg, rows_, seq, model.mesh)
    with jax.set_mesh(model.mesh):  # lowered before the first call: the step donates params
        xla = xla_flops(ts.jitted_step(params).lower(params, None, opt_state, batch))
    holder = {"params": params, "opt": opt_state}

    def call():
        holder["params"], holder["opt"], metrics = ts.step(holder["params"], holder["opt"], batch)
        return holder["params"], metrics

    dt, (_, metrics) = median_time(call, iters)
    model.params = holder["params"]
    tokens = rows_ * seq
    flops = (6 * active_matmul_params(cfg, model.sizes) * tokens
             + 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq * tokens)
    peak = peak_flops * model.mesh.size if peak_flops else None
    return [{"rows": rows_, "seq": seq, "tokens": tokens, "attention": attention, "ms_step": 1e3 * dt,
             "tok_s": tokens / dt, "model_flops": flops, "xla_flops": xla, "model_tflops_s": flops / dt / 1e12,
             "mfu": flops / dt / peak if peak else None,
             "loss": float(metrics["loss"]), "update_skipped": float(metrics["update_skipped"])}]


# -- 3. MoE dispatch -----------------------------------------------------------------------------

def bench_moe(cfg, spec: dict, iters: int) -> list[dict]:
    devices = jax.devices()
    # one layer and a small vocabulary: the section needs only the expert weights
    cfg = cfg.replace(n_layers=1, vocab_size=256)
    mesh = mesh_over(devices, cfg.n_experts)
    shards = mesh.shape[S.EXPERT_AXIS]
    n, d = spec["moe_tokens"], cfg.d_model
    params = S.init_params(cfg, mesh, seed=0)
    w = {k: v[0] for k, v in params["layers"]["moe"].items() if k in EXPERT_KEYS}
    rng = np.random.RandomState(0)
    dt = jnp.dtype(cfg.compute_dtype)
    x = jnp.asarray(rng.randn(n, d), dt)
    cot = jnp.asarray(rng.randn(n, d), dt)
    ids = jnp.asarray(np.argsort(rng.rand(n, cfg.n_experts), axis=1)[:, :cfg.top_k].astype(np.int32))
    weights = jnp.asarray(rng.dirichlet(np.ones(cfg.top_k), size=n).astype(np.float32))
    results, rows = {}, []
    for dispatch in ("padded", "ragged"):
        c = cfg.replace(moe_dispatch=dispatch)

        def fwd_bwd(x, w, c=c):
            y, vjp = jax.vjp(lambda x, w: moe_lib.moe_experts(c, x, ids, weights, w), x, w)
            return y, vjp(cot)

        with jax.set_mesh(mesh):
            fn = jax.jit(fwd_bwd)
            t, out = median_time(lambda: fn(x, w), iters)
        results[dispatch] = out
        rows.append({"dispatch": dispatch, "shards": shards, "tokens": n, "ms": 1e3 * t,
                     "same_code": shards == 1})
    y_pad, g_pad = results["padded"]
    for r in rows:
        y, g = results[r["dispatch"]]
        r["time_vs_padded"] = r["ms"] / rows[0]["ms"]
        r["out_diff"] = float(np.max(np.abs(np.asarray(y, np.float64) - np.asarray(y_pad, np.float64))))
        r["grad_diff"] = max_rel_diff(g, g_pad)
    return rows


# -- 4. attention parity -------------------------------------------------------------------------

def attention_config(size: str, base, dtype: str, block: int):
    # A dense MLP in place of the experts: an expert choice flipped by rounding (bf16 rows) would
    # swamp the attention's own error. init_std 1/sqrt(d_model) keeps activations O(1).
    cfg = base.replace(param_dtype=dtype, compute_dtype=dtype, attention_block_q=block, attention_block_k=block,
                       init_std=base.d_model ** -0.5, n_experts=0, d_ff=base.d_ff_expert)
    if size == "real":
        cfg = cfg.replace(n_layers=2, vocab_size=4096)
    return cfg


def packed_rows(batch: int, seq: int) -> np.ndarray:
    """Segment ids: row 0 one causal sequence; the others two segments then 8 padding tokens."""
    seg = np.ones((batch, seq), np.int32)
    for r in range(1, batch):
        seg[r, seq // 2:] = 2
        seg[r, seq - 8:] = 0
    return seg


def bench_attention(size: str, base, spec: dict, iters: int, impls) -> list[dict]:
    b, t = spec["attn_batch"], spec["attn_seq"]
    dtypes = ("float32", "bfloat16") if on_gpu() else ("float32",)
    rng = np.random.RandomState(0)
    seg = packed_rows(b, t)
    rows = []
    for dtype in dtypes:
        cfg0 = attention_config(size, base, dtype, spec["attn_block"][dtype])
        mesh = mesh_over(model_devices(), cfg0.n_experts)
        tokens = rng.randint(0, cfg0.vocab_size, (b, t)).astype(np.int32)
        w = jnp.asarray(rng.randn(b, t, cfg0.vocab_size).astype(np.float32))
        params = S.init_params(cfg0, mesh, seed=1)
        # fp32 rows compare the kernels' math: no TF32 matmuls under it (GPU's default)
        precision = "highest" if dtype == "float32" else None
        results = {}
        for impl in ("naive",) + tuple(impls):
            cfg = cfg0.replace(attention_impl=impl)

            def loss(p, cfg=cfg):
                logits = S.forward(cfg, p, tokens, seg)
                return jnp.sum(logits * w), logits

            try:
                with jax.set_mesh(mesh), jax.default_matmul_precision(precision):
                    fn = jax.jit(jax.grad(loss, has_aux=True))
                    sec, (grads, logits) = median_time(lambda: fn(params), iters)
            except Exception as e:  # noqa: BLE001 -- one failing core must not hide the others' rows
                if impl == "naive":
                    raise
                rows.append({"dtype": dtype, "impl": impl, "batch": b, "seq": t,
                             "error": "".join(traceback.format_exception_only(e)).strip()})
                traceback.print_exc()
                continue
            results[impl] = (grads, logits)
            ref_g, ref_l = results["naive"]
            ref = np.asarray(ref_l, np.float64)
            diff = float(np.max(np.abs(np.asarray(logits, np.float64) - ref)))
            rows.append({"dtype": dtype, "impl": impl, "batch": b, "seq": t, "ms": 1e3 * sec,
                         "logit_diff": diff, "logit_rel": diff / max(float(np.max(np.abs(ref))), 1e-30),
                         "grad_diff": max_rel_diff(grads, ref_g), "time_vs_naive": None})
        naive_ms = next(r["ms"] for r in rows if r["dtype"] == dtype and r["impl"] == "naive")
        for r in rows:
            if r["dtype"] == dtype and "ms" in r:
                r["time_vs_naive"] = r["ms"] / naive_ms
        del results, params
    return rows


# -- 5. paged decode attention ------------------------------------------------------------------

def bench_paged(spec: dict, iters: int) -> list[dict]:
    b, h, kvh, d, page, ctx = (spec["paged"][k] for k in ("batch", "heads", "kv_heads", "head_dim", "page",
                                                           "context"))
    dtype = jnp.dtype(spec["dtype"])
    rng = np.random.RandomState(0)
    per_row = ctx // page
    n_units = b * per_row + 1
    # drawn on the device: at real size each pool is 0.5 G entries (1 GB in bf16)
    pool_k, pool_v = (jax.random.normal(jax.random.key(i), (n_units, page, kvh, d), dtype) for i in range(2))
    units = jnp.asarray(rng.permutation(n_units)[:b * per_row].reshape(b, per_row), jnp.int32)
    # a long tail of lengths: most rows short, a few near the whole cache
    q_pos = jnp.asarray(np.minimum(ctx - 1, (ctx * rng.beta(0.7, 2.5, b)).astype(np.int32) + 1), jnp.int32)
    q, k_new, v_new = (jnp.asarray(rng.randn(b, n, d), dtype) for n in (h, kvh, kvh))
    rows = []
    for window in spec["paged"]["windows"]:
        kernel = jax.jit(lambda *a, w=window: paged_decode_attention(*a, w, k_len=ctx))
        # the engine's gather path for one token a row
        gather = jax.jit(lambda *a, w=window: paged_decode_reference(*a, w, k_len=ctx))
        args = (q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new)
        sec_k, out_k = median_time(lambda: kernel(*args), iters)
        sec_g, out_g = median_time(lambda: gather(*args), iters)
        ref = np.asarray(out_g, np.float64)
        seen = np.asarray(q_pos if window <= 0 else np.minimum(q_pos, window - 1))
        # the keys and values the kernel must read: each row's visible tokens
        kv_bytes = 2 * int(seen.sum()) * kvh * d * dtype.itemsize
        rows.append({"batch": b, "context": ctx, "page": page, "window": window, "mean_len": float(np.mean(q_pos)),
                     "kernel_ms": 1e3 * sec_k, "gather_ms": 1e3 * sec_g, "gather_vs_kernel": sec_g / sec_k,
                     "kv_bytes": kv_bytes, "bandwidth": kv_bytes / sec_k,
                     "max_rel": float(np.max(np.abs(np.asarray(out_k, np.float64) - ref)) / np.max(np.abs(ref)))})
    return rows


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=tuple(SIZES), default=None, help="default: real on GPU, toy elsewhere")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--layers", type=int, default=4, help="real size: layers of the qwen3-moe-30b-a3b shapes")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="decode batches (default: the size's)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per row (default: real 5, toy 2)")
    ap.add_argument("--attention-impls", nargs="+", choices=ATTENTION_IMPLS, default=list(ATTENTION_IMPLS))
    ap.add_argument("--train-attention", choices=("naive",) + ATTENTION_IMPLS, default=None,
                    help="attention_impl of the train step (default: pallas on GPU, blockwise elsewhere)")
    ap.add_argument("--peak-hbm", type=float, default=None, help="HBM bytes/s of one device")
    ap.add_argument("--peak-flops", type=float, default=None, help="dense bf16 FLOP/s of one device")
    ap.add_argument("--out", default="bench_out/gpu_suite.json")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    """Runs the chosen sections, prints their tables, writes the JSON; returns what it wrote."""
    args = parse_args(argv)
    size = args.size or ("real" if on_gpu() else "toy")
    spec = dict(SIZES[size])
    if args.batches:
        spec["batches"] = tuple(args.batches)
    iters = args.iters or spec["iters"]
    train_attention = args.train_attention or ("pallas" if on_gpu() else "blockwise")
    peak_hbm, peak_flops, kind = device_peaks(args)
    cfg = model_config(size, args)
    res: dict = {"meta": {"size": size, "model": spec["preset"], "layers": cfg.n_layers, "dtype": spec["dtype"],
                          "backend": jax.default_backend(), "device_kind": kind, "devices": len(jax.devices()),
                          "peak_hbm": peak_hbm, "peak_flops": peak_flops, "iters": iters, "jax": jax.__version__,
                          "args": vars(args), "seconds": {}}}
    model = None
    errors = {}
    for section in (s for s in SECTIONS if s in args.sections):  # fixed order: decode before train
        t0 = time.perf_counter()
        try:
            if section in ("decode", "train") and model is None:
                model = Model(cfg)
            if section == "decode":
                res["decode"] = bench_decode(model, spec, iters, peak_hbm)
            elif section == "train":
                res["train"] = bench_train(model, spec, iters, peak_flops, train_attention)
            elif section == "moe":
                res["moe"] = bench_moe(cfg, spec, iters)
            elif section == "attention":
                res["attention"] = bench_attention(size, cfg, spec, iters, args.attention_impls)
            else:
                res["paged"] = bench_paged(spec, iters)
        except Exception as e:  # noqa: BLE001 -- device time is scarce: keep the other sections' tables
            errors[section] = "".join(traceback.format_exception_only(e)).strip()
            traceback.print_exc()
        res["meta"]["seconds"][section] = time.perf_counter() - t0
    res["errors"] = errors
    goals = {}
    for r in res.get("decode", []):
        if r["batch"] == 64:
            goals["decode HBM share at batch 64"] = {"value": pct("hbm_share")(r), "goal": 50}
    if res.get("train"):
        goals["train MFU"] = {"value": pct("mfu")(res["train"][0]), "goal": 35}
    res["goals"] = goals
    print_results(res)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    for section, message in errors.items():
        print(f"section {section} failed: {message}")
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
