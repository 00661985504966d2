"""Calibration: the planner's train-micro-step peak against the memory a CPU run really uses.

    python -m sfrrl_jax.plan.calibrate [--json]   # run in a fresh process (it sets XLA_FLAGS)

Measured, on one CPU device (the process's only one, so its memory is the device's memory):
  arguments  the bytes of the live jax arrays the step is called with (params, accumulator,
             micro-batch): exact, they exist;
  in-call    the highest resident set size (RSS) sampled every ~0.2 ms during the second call,
             minus the RSS just before it: the outputs and temporaries XLA really touched.
glibc is told (MALLOC_MMAP_THRESHOLD_) to map every block above 64 KiB on its own, so a freed
buffer leaves the RSS at once and one call's peak is not hidden by memory an earlier call freed.
Predicted: the plan's train_micro arguments + temp + outputs not aliased (no residents: nothing
else is allocated here). The model is small enough for a 2-core CPU, and its activations (a
[4 x 2048] micro-batch, 4 layers, a 16k vocab) dwarf the runtime's own noise.
"""
from __future__ import annotations

import os

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"

import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from sfrrl_jax.config import ModelConfig  # noqa: E402
from sfrrl_jax.learner.optimizer import OptimizerConfig  # noqa: E402
from sfrrl_jax.mesh import make_mesh  # noqa: E402
from sfrrl_jax.models.api import init_params  # noqa: E402
from sfrrl_jax.plan.planner import PlanConfig, PlanInputs, plan_memory  # noqa: E402
from sfrrl_jax.rl.config import LossConfig  # noqa: E402
from sfrrl_jax.trainer.config import TrainerConfig  # noqa: E402

CALIBRATION_MODEL = dict(vocab_size=8192, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
                         d_ff_expert=256, n_experts=8, top_k=2, max_seq_len=2048)


def _peak_rss_during(fn) -> tuple[int, int]:
    """(rss, vms) before the call and their highest samples during it."""
    proc = psutil.Process()
    m = proc.memory_info()
    base = (m.rss, m.vms)
    peak, done = list(base), threading.Event()

    def sample():
        while True:
            m = proc.memory_info()
            peak[0], peak[1] = max(peak[0], m.rss), max(peak[1], m.vms)
            if done.is_set():
                return
            time.sleep(0.0002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    fn()
    done.set()
    t.join()
    return base, tuple(peak)


def calibrate(rows: int = 2, length: int = 1024, remat: str = "none") -> dict:
    cfg = ModelConfig.preset("tiny-moe", **CALIBRATION_MODEL, remat=remat)
    mesh = make_mesh(devices=jax.devices()[:1])
    tc = TrainerConfig(max_len=length, seq_bucket=length, group_size=rows, groups_per_step=1, max_slots=1)
    loss, opt = LossConfig(vocab_chunk=4096, seq_chunk=512), OptimizerConfig()
    plan = plan_memory(PlanInputs(cfg, mesh, tc, loss, opt), PlanConfig(phases=("train_micro",), bf16_as_f16=False))
    ph = plan.phases[0]
    predicted = ph.device_arguments + ph.temp + ph.device_outputs

    from sfrrl_jax.plan.abstract import TrainSetup, microbatch
    setup = TrainSetup.build(cfg, mesh, loss, opt)
    ts = setup.train_step
    params = init_params(cfg, mesh)
    rng = np.random.default_rng(0)
    abstract = microbatch(setup, rows, length)
    host = jax.tree.map(lambda v: np.zeros(v.shape, v.dtype), abstract)
    host = host.replace(tokens=rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32))
    host.loss_mask[:, length // 4:] = 1.0
    host.advantages[:] = rng.normal(size=(rows, 1)).astype(np.float32) * host.loss_mask
    host.segment_ids[:] = 1
    mb = jax.tree.map(lambda v, a: jax.device_put(v, a.sharding), host, abstract)
    acc = ts.init_accumulator(params)
    compiled = ph.compiled   # the planner's own executable, run on real arrays
    with jax.set_mesh(mesh):
        acc = compiled(params, None, acc, mb)   # warm: first-touch costs, thread pools
        jax.block_until_ready(acc)
        gc.collect()
        arguments = sum(x.nbytes for x in jax.tree.leaves((params, acc, mb)))
        out = {}

        def call():
            out["acc"] = jax.block_until_ready(compiled(params, None, acc, mb))
        base, peak = _peak_rss_during(call)
    measured = arguments + (peak[1] - base[1])
    return {"predicted": predicted, "measured": measured, "ratio": predicted / measured,
            "measured_touched": arguments + (peak[0] - base[0]),
            "arguments": arguments, "rss_in_call": peak[0] - base[0], "vms_in_call": peak[1] - base[1], "xla_temp": ph.temp,
            "xla_output_not_aliased": ph.output - ph.alias, "compile_s": ph.compile_s,
            "shape": [rows, length], "remat": remat}


if __name__ == "__main__":
    rows = [calibrate(remat=r) for r in (sys.argv[1:] or ["none"])]
    for r in rows:
        print(json.dumps(r))
