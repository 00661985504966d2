"""Benchmark: one synchronous GRPO step of the tiny Qwen3-MoE shape, ours against Tunix's, back to back.

The step (both sides): 4 prompts x 4 samples, every prompt 16 random token ids, every sample
exactly 32 new tokens (temperature 1, no stop token: every step has the same work), the reward
a pure function of the generated ids (the share of even ids), group-relative advantages, one
policy-gradient update (clipped ratio 0.2, no KL term, AdamW with global-norm clip 1.0), float32
params, on 8 fake CPU devices.

Ours: `RLTrainer` in mode 'sync' (roll out every group, then train) on `ModelConfig.preset("tiny-moe")`
(2 layers, d_model 64, 8 experts top-2, vocab 512) over `make_mesh(data=2, expert=4)`; all 16
samples decode together (max_slots = 16). Every micro-step shape is compiled first
(`compile_train_shapes`), then `--warmup` steps run untimed (engine compiles), then `--steps`
steps are timed; the figures are the means of the trainer's own step metrics:
  rollout s/step  time/rollout_s: launch to the last sample back (prefill, decode, reward);
  train s/step    time/train_s: the gradient micro-steps and the optimizer update;
  step s          time/wall_s: the whole step (rollout + train + the step's bookkeeping).

Tunix (with --tunix-python): `tunix_grpo_step.py`, next to this file, run by that interpreter
(a separate environment: google-tunix pins safetensors < 0.8, ours needs newer, so it is never
installed here). It builds Tunix's GRPOLearner on an RLCluster whose actor, reference and rollout
share one mesh (the colocated 'vanilla' sampler, weights shared, no sync), with the same shape on
a tiny Qwen3-MoE of Tunix's own model code (`tunix.models.qwen3`, the same dimensions), times
the same three figures from its learner (rollout: generate + rewards + advantages; train: the
actor update; step: one global step) and prints one JSON line, which this script reads.
Both rows are printed, then the speed-up of ours over Tunix's (Tunix seconds / our seconds: above
1 ours is faster; the goal of issue #23 is a step speed-up >= 1.5, reported, not asserted).

    python experiments/bench/grpo_step.py [--steps 5 --warmup 2 --decode-steps 8]
        [--tunix-python /tmp/tunix-env/bin/python] [--out bench_out/grpo_step.json]

A Tunix environment:
    python3 -m venv /tmp/tunix-env --system-site-packages
    /tmp/tunix-env/bin/pip install google-tunix==0.1.7
The fake devices share the host's cores, and the two sides run one after the other on a shared
machine: compare the rows of one run only. What differs beyond the step itself:
  - on CPU Tunix's MoE layer takes its dense fallback (every expert on every token; its megablox
    path is for accelerators), ours dispatches each token to its top-2 experts over the expert axis;
  - our engine decodes --decode-steps tokens per device call (default 8; TrainerConfig's default
    of 1 made our step ~1.6x slower in one run), Tunix's sampler decodes in one `while_loop`;
  - Tunix samples with top_p = 1.0 (a vocabulary sort per token) and the same seed every step,
    and masks out of its loss the rare sampled id 0 (its padding id): 511 of 512 tokens trained here;
  - Tunix compiles in its first two steps, so its row needs --warmup >= 2 (the default).
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.agents.protocols import GenerationRequest, Task  # noqa: E402
from sfrrl_jax.agents.trajectory import Trajectory, TrajectoryBuilder, Turn  # noqa: E402
from sfrrl_jax.trainer import RLTrainer, TaskStream, TrainerConfig  # noqa: E402

COLUMNS = (("rollout_s", "rollout s/step"), ("train_s", "train s/step"), ("step_s", "step s"))
TUNIX_SCRIPT = pathlib.Path(__file__).with_name("tunix_grpo_step.py")
TUNIX_HINT = ("python3 -m venv /tmp/tunix-env --system-site-packages && "
              "/tmp/tunix-env/bin/pip install google-tunix==0.1.7, then add "
              "--tunix-python /tmp/tunix-env/bin/python")


def prompt_tokens(seed: int, prompts: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """The step's prompts: random ids in [3, vocab) (0-2 left to pad/special ids). The Tunix
    script draws the same ones (same generator, seed and call), so both sides see one batch."""
    return np.random.default_rng(seed).integers(3, vocab, (prompts, prompt_len)).tolist()


def even_share(tokens) -> float:
    return float(np.mean([t % 2 == 0 for t in tokens])) if len(tokens) else 0.0


class FixedLengthRollout:
    """`await rollout(engine, task, sample_index)`: one turn of exactly `new_tokens` tokens.

    No stop token, so every step does the same work; each visit of a (task, sample) draws its own
    sampling seed, so the samples of a group differ and change from step to step."""

    def __init__(self, new_tokens: int, prompt_len: int, seed: int = 0):
        self.new_tokens, self.seed = new_tokens, seed
        self.max_total_tokens = prompt_len + new_tokens  # checked against TrainerConfig.max_len
        self.visits: dict[tuple[str, int], int] = {}

    async def __call__(self, engine, task: Task, sample_index: int) -> Trajectory:
        key = (task.task_id, sample_index)
        visit = self.visits[key] = self.visits.get(key, -1) + 1
        prompt = list(task.metadata["prompt_tokens"])
        builder = TrajectoryBuilder(task.task_id, task.task_id, sample_index, prompt)
        traj = builder.trajectory
        seed = int(np.random.default_rng([self.seed, int(task.task_id[1:]), sample_index, visit]).integers(2**31))
        t0 = time.perf_counter()
        c = await engine.complete(GenerationRequest(tokens=prompt, max_new_tokens=self.new_tokens,
                                                    temperature=1.0, seed=seed))
        try:
            start, end = builder.append_completion(c)
        finally:
            await engine.release(c.slot_handle)
        traj.turns.append(Turn(0, start, end, end, c.finish_reason, time.perf_counter() - t0, 0.0, 0, 0))
        traj.finish_reason = "length"
        traj.wall_s = time.perf_counter() - t0
        traj.reward = even_share(c.tokens)
        return traj


def run_ours(args) -> dict:
    """Our sync GRPO step, timed; returns the means, the per-step figures and the setup."""
    cfg = S.ModelConfig.preset("tiny-moe")
    mesh = S.make_mesh(data=2, expert=4)
    tasks = [Task(task_id=f"p{i}", kind="bench", prompt="", metadata={"prompt_tokens": p})
             for i, p in enumerate(prompt_tokens(args.seed, args.prompts, args.prompt_len, cfg.vocab_size))]
    total = args.prompt_len + args.new_tokens
    # One train row per sample, exactly its length wide: seq_bucket = the row width.
    tc = TrainerConfig(mode="sync", groups_per_step=args.prompts, group_size=args.samples,
                       max_slots=args.prompts * args.samples, max_len=total + 1, decode_steps=args.decode_steps,
                       seq_bucket=total, groups_per_microbatch=args.prompts, seed=args.seed)
    params = S.init_params(cfg, mesh, seed=args.seed)
    trainer = RLTrainer(cfg, params, tc, S.LossConfig(), S.OptimizerConfig(learning_rate=1e-6),
                        FixedLengthRollout(args.new_tokens, args.prompt_len, args.seed),
                        TaskStream(tasks, seed=args.seed))
    t0 = time.perf_counter()
    trainer.compile_train_shapes()
    for _ in range(args.warmup):
        trainer.step()
    warm_s = time.perf_counter() - t0
    compiles0 = sum(trainer.engine.steps.compile_counts().values()) + trainer.train_step.compile_count()
    rows = [trainer.step() for _ in range(args.steps)]
    generated = {r["rollout/generated_tokens"] for r in rows}
    if generated != {args.prompts * args.samples * args.new_tokens}:
        raise RuntimeError(f"ours generated {generated} tokens per step, expected "
                           f"{args.prompts * args.samples * args.new_tokens}")
    per_step = {"rollout_s": [r["time/rollout_s"] for r in rows], "train_s": [r["time/train_s"] for r in rows],
                "step_s": [r["time/wall_s"] for r in rows]}
    return {"name": "ours (sfrrl_jax)",
            "model": f"sfrrl_jax tiny-moe ({cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_experts} experts "
                     f"top-{cfg.top_k}, vocab {cfg.vocab_size})",
            "mesh": dict(mesh.shape), "decode_steps": args.decode_steps, "warmup_s": warm_s,
            **{k: float(np.mean(v)) for k, v in per_step.items()}, "per_step": per_step,
            "reward_mean": float(np.mean([r["reward/mean"] for r in rows])),
            # a compile inside the timed steps would make the figures meaningless: reported to check
            "compiles_in_timed_steps": int(rows[-1]["perf/compile_count"] - compiles0)}


def run_tunix(args) -> dict:
    """Runs the companion script with the Tunix interpreter; returns its JSON line (or an error)."""
    cmd = [args.tunix_python, str(TUNIX_SCRIPT), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--prompts", str(args.prompts), "--samples", str(args.samples), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--seed", str(args.seed)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.tunix_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.tunix_timeout} s: {' '.join(cmd)}"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        return {"error": f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}"}
    return json.loads(lines[-1])


def table(ours: dict, tunix: dict | None) -> str:
    head = f"{'':26s}" + "".join(f"{title:>16s}" for _, title in COLUMNS)
    out = [head, f"{ours['name']:26s}" + "".join(f"{ours[k]:16.3f}" for k, _ in COLUMNS)]
    if tunix:
        out.append(f"{tunix['name']:26s}" + "".join(f"{tunix[k]:16.3f}" for k, _ in COLUMNS))
        out.append(f"{'speed-up (Tunix s / ours)':26s}"
                   + "".join(f"{tunix[k] / ours[k]:15.2f}x" for k, _ in COLUMNS))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (the GRPO group)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=8, help="our engine's tokens per device call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tunix-python", default=None,
                    help="a Python interpreter of a separate environment where `import tunix` works")
    ap.add_argument("--tunix-timeout", type=float, default=1800.0)
    ap.add_argument("--out", default="bench_out/grpo_step.json")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.samples < 2 or args.prompts < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --samples >= 2 (a group), --prompts >= 1")
    shape = (f"{args.prompts} prompts x {args.samples} samples, {args.prompt_len}-token prompts, "
             f"{args.new_tokens} new tokens, sync, {jax.device_count()} fake {jax.default_backend()} devices")
    print(f"GRPO step: {shape}; means over {args.steps} steps after {args.warmup} warm-up", flush=True)
    ours = run_ours(args)
    print(f"ours: {ours['model']}, mesh {ours['mesh']}, decode_steps {ours['decode_steps']}", flush=True)
    tunix = None
    if args.tunix_python:
        if args.warmup < 2:
            print("note: Tunix compiles in its first two steps: with --warmup < 2 its row holds a compile",
                  file=sys.stderr)
        tunix = run_tunix(args)
        if "error" in tunix:
            print(f"Tunix side failed: {tunix['error']}", file=sys.stderr)
        else:
            print(f"Tunix {tunix.get('tunix_version', '?')}: {tunix['model']}, mesh {tunix['mesh']}", flush=True)
    ok = tunix if tunix and "error" not in tunix else None
    print(table(ours, ok))
    if ok:
        speedup = ok["step_s"] / ours["step_s"]
        print(f"issue #23 goal, a GRPO step >= 1.5x Tunix's: {speedup:.2f}x, {'met' if speedup >= 1.5 else 'NOT met'}")
    if not args.tunix_python:
        print(f"Tunix's row: {TUNIX_HINT}")
    report = {"shape": shape, "args": vars(args), "ours": ours, "tunix": tunix,
              "speedup_tunix_over_ours": ({k: ok[k] / ours[k] for k, _ in COLUMNS} if ok else None)}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
