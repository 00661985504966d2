"""Held-out evaluation during an RL run, and the learning curve it draws.

A `RolloutSource` may carry a held-out set (`trainer.evaluate.HeldOut`; `AgenticRollout` builds
one from `eval_tasks`). `run_experiment` then scores it with the trainer's own engine (no second
KV cache, no extra compile; greedy unless the set says otherwise) on a fresh run before the first
step, every `ExperimentConfig.eval_every` steps, and after the last step. Each evaluation is a
metrics row (`phase: 'eval'`, `step` = the updates the scored params have had, every result key as
`eval/<key>`: `eval/success_rate`, `eval/mean_reward`, ..., `eval/examples` a JSON list of a few
answers as the verifier saw them) and `learning_curve.png` is redrawn from
metrics.jsonl: the training reward per step and the held-out success, against steps and against
the run's wall seconds. The run's summary gets `success_before` (the first evaluation the run dir
holds), `success_after` (the last) and `evals` (each one's step, success and wall seconds).

One process only: on a multi-process run each process's engine takes part in every device call,
so a held-out set is refused there by name (evaluate its checkpoints instead).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

from sfrrl_jax.trainer.evaluate import HeldOut
from sfrrl_jax.trainer.run_logger import RunLogger, read_metrics

EVAL_PHASE = "eval"


class HeldOutRuns:
    """When and how a run evaluates its held-out set (module doc).

    held_out: the set; eval_every: also every this many steps (0: before and after only);
    run_log: where rows go (None on a process that logs nothing); run_dir: the run's directory
    (metrics.jsonl is read back for the curve and the summary); log: one line of text per evaluation.
    """

    def __init__(self, held_out: HeldOut, eval_every: int, run_log: RunLogger | None, run_dir: Path,
                 log: Callable[[str], None] = print):
        self.held_out, self.eval_every, self.run_log = held_out, eval_every, run_log
        self.run_dir, self.log = Path(run_dir), log
        self.last_step: int | None = None
        self.wall_s = 0.0   # spent evaluating in this process

    def check(self, trainer) -> None:
        """Refuses a run this evaluation cannot serve (several processes)."""
        if trainer.multi_process:
            raise ValueError("a held-out set (AgenticRollout.eval_tasks) is evaluated on one process only: this run "
                             "has several; drop eval_tasks and evaluate its checkpoints instead")

    def due(self, step: int, last: bool) -> bool:
        """Whether params after `step` updates are evaluated (every `eval_every`, and the last)."""
        if step == self.last_step:
            return False
        return last or bool(self.eval_every and step % self.eval_every == 0)

    def evaluate(self, trainer, tag: str) -> dict:
        """Scores the trainer's current params on the held-out set; logs and returns the result."""
        step = trainer.step_index
        t0 = time.perf_counter()
        result = self.held_out.run(trainer.engine, trainer.params)
        self.wall_s += time.perf_counter() - t0
        self.last_step = step
        row = {"phase": EVAL_PHASE, "eval/tag": tag,
               **{f"eval/{k}": json.dumps(v) if k == "examples" else v for k, v in result.items()}}
        if self.run_log is not None:
            self.run_log.log(step, row)
            self.write_curve()
        self.log(f"held-out eval ({tag}, after {step} steps): success {result['success_rate']:.3f}, mean reward "
                 f"{result['mean_reward']:.3f} on {result['num_tasks']} tasks [{result['wall_s']:.1f}s]")
        return result

    def write_curve(self) -> Path | None:
        """learning_curve.png from metrics.jsonl (None when matplotlib is missing)."""
        return write_learning_curve(read_metrics(self.run_dir), self.run_dir / "learning_curve.png")

    def summary(self) -> dict:
        """success_before / success_after / evals from every eval row the run dir holds."""
        rows = [r for r in read_metrics(self.run_dir) if r.get("phase") == EVAL_PHASE]
        if not rows:
            return {}
        evals = [{"step": r["step"], "success_rate": r["eval/success_rate"], "mean_reward": r["eval/mean_reward"],
                  "wall_s": r["eval/wall_s"]} for r in rows]
        return {"success_before": evals[0]["success_rate"], "success_after": evals[-1]["success_rate"],
                "success_gain": evals[-1]["success_rate"] - evals[0]["success_rate"], "evals": evals,
                "learning_curve": str(self.run_dir / "learning_curve.png")}


def write_learning_curve(rows: list[dict], path: str | Path, title: str = "learning curve") -> Path | None:
    """Training reward per step and held-out success (eval rows) against steps and wall seconds.

    rows: metrics rows (`read_metrics`): step rows carry 'reward/mean' and 'time/wall_s', eval rows
    `phase == 'eval'` and 'eval/success_rate'. Wall seconds count steps and evaluations in row order.
    Returns the PNG's path, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps, rewards, step_walls, evals = [], [], [], []
    wall = 0.0
    for r in rows:
        if r.get("phase") == EVAL_PHASE:
            wall += float(r.get("eval/wall_s", 0.0))
            evals.append((r["step"], r["eval/success_rate"], wall))
        elif "reward/mean" in r:
            wall += float(r.get("time/wall_s", 0.0))
            steps.append(r["step"] + 1)   # the reward of step s is measured before its update
            rewards.append(r["reward/mean"])
            step_walls.append(wall)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, xs, x_eval, label in ((axes[0], steps, [e[0] for e in evals], "RL steps (updates)"),
                                  (axes[1], step_walls, [e[2] for e in evals], "wall seconds")):
        if rewards:
            ax.plot(xs, rewards, color="tab:blue", alpha=0.5, label="train reward (sampled)")
            ax.plot(xs, _running_mean(rewards, 5), color="tab:blue", label="train reward, mean of 5")
        if evals:
            ax.plot(x_eval, [e[1] for e in evals], "o-", color="tab:red", label="held-out success")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward / success")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _running_mean(values: list[float], n: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - n + 1):i + 1]
        out.append(math.fsum(window) / len(window))
    return out
