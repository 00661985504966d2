"""Tunix's side of experiments/bench/grpo_step.py: one synchronous GRPO step of Tunix 0.1.7, timed.

Runs in a separate environment where `import tunix` works (google-tunix pins safetensors < 0.8,
which sfrrl_jax's environment must not get), so it imports nothing of sfrrl_jax; grpo_step.py
starts it with that environment's interpreter and reads the one JSON line it prints last.

The same step as ours: `--prompts` prompts x `--samples` samples, `--prompt-len` random token ids
per prompt (the same ids: same generator and seed), exactly `--new-tokens` new tokens per sample
(temperature 1, no stop token: the end-of-sequence id is one past the vocabulary, so it is never
sampled), the share of even ids as the reward, group-relative advantages, one update of the
clipped policy loss (epsilon 0.2, beta 0: no KL term and no reference model, one iteration: no
old-policy forward), AdamW 1e-6 behind a global-norm clip of 1.0, float32, 8 fake CPU devices.
The model is Tunix's own Qwen3 (`tunix.models.qwen3.model.Qwen3`) with MoE layers at our
tiny-moe's dimensions: 2 layers, d_model 64, 4 query / 2 KV heads of 16, 8 experts of width 64,
top-2, vocabulary 512, untied embeddings (on CPU Tunix's MoE layer runs its dense fallback:
every expert on every token). Its mesh is ('fsdp', 'tp') = (8, 1): Tunix shards experts and the
batch over 'fsdp' (it has no separate expert axis).
The learner: `GRPOLearner` on an `RLCluster` whose actor, reference and rollout roles share one
mesh, so its 'vanilla' sampler (prefill + a `while_loop` decode) generates with the actor's own
weights (colocated, no weight sync). Tunix's padding id is 0 and a sampled 0 is masked out of
its loss (about one token in 512), which does not change the shapes or the work.

Timing: the learner's own loop (`learner.train`) runs `--warmup` + `--steps` + 1 global steps;
wrappers around its methods record
  rollout_s  `_generate_and_compute_advantage`: generate + rewards + advantages;
  train_s    `rl_cluster.update_actor` (the loss, gradients and optimizer update), until the
             new params are ready;
  step_s     from the start of one global step to the start of the next (so the learner's
             per-step bookkeeping counts), hence the one extra step, not reported.
The first `--warmup` steps compile and are dropped. Tunix compiles in its first two steps (with
one warm-up step its first timed step took 16 s against 0.4-0.6 s later), so keep --warmup >= 2.

    /tmp/tunix-env/bin/python experiments/bench/tunix_grpo_step.py [--steps 5 --warmup 2]
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

VOCAB = 512


class IdTokenizer:
    """Text is space-separated token ids: the benchmark needs no real tokenizer, and the
    learner's string interface (prompts and completions are text) then carries ids exactly."""

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self):
        return 0  # falsy: Tunix's sampler then prepends no BOS

    def eos_id(self):
        return VOCAB  # outside the vocabulary: never sampled, so every sample runs to the limit

    def pad_id(self):
        return 0


def even_share_reward(prompts, completions, **kwargs):
    return [float(np.mean([int(t) % 2 == 0 for t in c.split()])) if c.split() else 0.0 for c in completions]


def tiny_qwen3_moe() -> "qwen3.ModelConfig":
    return qwen3.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=64, num_heads=4,
                             head_dim=16, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6,
                             use_tied_embedding=False, num_experts=8, num_experts_per_tok=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    # Auto axes: Tunix's code shards by partition specs under `with mesh:`, not by explicit types
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1, 1), ("fsdp", "tp"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cfg = tiny_qwen3_moe()
    # built on the default device; RLCluster reshards it onto the mesh by its partition specs
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(args.seed))
    # the same prompts as grpo_step.py (same generator, seed and call)
    prompts = np.random.default_rng(args.seed).integers(3, VOCAB, (args.prompts, args.prompt_len)).tolist()
    prompt_text = np.array([" ".join(map(str, p)) for p in prompts])
    n_steps = args.warmup + args.steps + 1

    cluster_cfg = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0),
                                        optax.adamw(1e-6, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)),
            eval_every_n_steps=10**9, max_steps=n_steps),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=args.new_tokens, max_prompt_length=args.prompt_len,
            kv_cache_size=args.prompt_len + args.new_tokens, temperature=1.0, top_p=1.0, top_k=None),
    )
    cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=IdTokenizer(),
                                       cluster_config=cluster_cfg)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=even_share_reward,
        algo_config=grpo_learner.GRPOConfig(num_generations=args.samples, num_iterations=1, beta=0.0,
                                            epsilon=0.2, loss_agg_mode="token-mean"))

    # Timing wrappers on the learner's own calls (instance attributes shadow the methods).
    rec = {"rollout_s": [], "train_s": [], "starts": [], "generated": []}
    generate = learner._generate_and_compute_advantage

    def timed_generate(training_input, mode=rl_cluster_lib.Mode.TRAIN):
        t0 = time.perf_counter()
        example = jax.block_until_ready(generate(training_input, mode))
        rec["rollout_s"].append(time.perf_counter() - t0)
        rec["generated"].append(int(np.asarray(example.completion_mask).sum()))
        return example

    update_actor = cluster.update_actor

    def timed_update(train_ds, eval_ds, skip_jit=False):
        t0 = time.perf_counter()
        update_actor(train_ds, eval_ds, skip_jit)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))  # the update may run ahead
        rec["train_s"].append(time.perf_counter() - t0)

    global_step = learner._run_global_step

    def timed_global_step(*a, **kw):
        rec["starts"].append(time.perf_counter())
        return global_step(*a, **kw)

    learner._generate_and_compute_advantage = timed_generate
    cluster.update_actor = timed_update
    learner._run_global_step = timed_global_step

    learner.train([{"prompts": prompt_text} for _ in range(n_steps)])
    if len(rec["starts"]) < n_steps or len(rec["train_s"]) < n_steps:
        raise RuntimeError(f"Tunix ran {len(rec['starts'])} global steps / {len(rec['train_s'])} updates, "
                           f"expected {n_steps}")
    timed = slice(args.warmup, args.warmup + args.steps)
    step_s = list(np.diff(rec["starts"]))[timed]
    per_step = {"rollout_s": rec["rollout_s"][timed], "train_s": rec["train_s"][timed],
                "step_s": [float(x) for x in step_s]}
    print(json.dumps({
        "name": "Tunix " + importlib.metadata.version("google-tunix"),
        "tunix_version": importlib.metadata.version("google-tunix"),
        "model": "tunix.models.qwen3 Qwen3 MoE (2 layers, embed 64, 8 experts top-2, vocab 512; dense "
                 "expert fallback on CPU)",
        "mesh": dict(mesh.shape), "sampler": "vanilla (colocated, shared weights)",
        **{k: float(np.mean(v)) for k, v in per_step.items()}, "per_step": per_step,
        "generated_tokens_per_step": rec["generated"][timed],
    }))


if __name__ == "__main__":
    main()
