"""Held-out evaluation in the real experiment path (issue #45): `AgenticRollout.eval_tasks` builds a
held-out set (training prompts removed), `run_experiment` scores it with the trainer's own engine
before the first step, every `eval_every` steps and after the last, logs each as an 'eval' row,
draws learning_curve.png and puts success_before / success_after in the summary; a resumed run
redoes the evaluation its resume step lost. Reasoning-gym items read as 'math' tasks are verified
by math-verify."""
import json
import sys
from pathlib import Path

import pytest

from sfrrl_jax.agents.tasks.builtin_kinds import generate_arithmetic_tasks
from sfrrl_jax.agents.tasks.records import save_tasks_jsonl
from sfrrl_jax.agents.tasks.loading import load_tasks
from sfrrl_jax.agents.tasks.reward_fns import task_reward
from sfrrl_jax.launch import gin_bindings
from sfrrl_jax.launch.held_out_runs import HeldOutRuns, write_learning_curve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agentic_rollout import _bindings, model_dir  # noqa: E402,F401  (the tiny Qwen3 directory fixture)


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    train = generate_arithmetic_tasks(4, seed=0)
    held = generate_arithmetic_tasks(3, seed=7) + train[:1]   # one of them is a training prompt
    return save_tasks_jsonl(train, d / "train.jsonl"), save_tasks_jsonl(held, d / "held.jsonl")


def _eval_bindings(model_dir, task_files, run_dir, **extra):
    train, held = task_files
    b = {"AgenticRollout.eval_tasks": repr(str(held)), "ExperimentConfig.num_steps": "2",
         "ExperimentConfig.eval_every": "1",
         "ExperimentConfig.tensorboard": "False", "AgentConfig.max_turns": "1", "AgentConfig.max_new_tokens_per_turn": "6",
         **extra}
    return _bindings(model_dir, train, run_dir, **b)


def _run(bindings):
    job = gin_bindings.load_job([], bindings)
    return gin_bindings.run_job(job, gin_bindings.operative_config(), log=lambda line: None)


def test_the_held_out_set_is_scored_before_during_and_after_the_run(model_dir, task_files, tmp_path):
    run_dir = tmp_path / "run"
    job = gin_bindings.load_job([], _eval_bindings(model_dir, task_files, run_dir))
    source = job.experiment.rollout(job.experiment, gin_bindings.validate_job(job))
    # the held-out prompt that is also a training prompt is gone; greedy, same environment
    assert len(source.held_out.tasks) == 3 and source.held_out.agent_cfg.temperature == 0.0
    assert not {t.prompt for t in source.held_out.tasks} & {t.prompt for t in source.tasks}
    assert source.held_out.env is source.rollout_fn.env
    summary = _run(_eval_bindings(model_dir, task_files, run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("phase") == "eval"]
    # before (0 updates), after step 1 (eval_every 1), after the last (2 updates)
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert [r["eval/tag"] for r in evals] == ["before", "step_1", "after"]
    assert all(r["eval/num_tasks"] == 3 and 0.0 <= r["eval/success_rate"] <= 1.0 for r in evals)
    examples = json.loads(evals[0]["eval/examples"])   # the answers the verifier scored
    assert [e["gold"] for e in examples] == [t.answer for t in source.held_out.tasks]
    assert all(isinstance(e["final_text"], str) and e["reward"] in (0.0, 1.0) for e in examples)
    assert [r["step"] for r in rows if r.get("phase") != "eval"] == [0, 1]
    assert summary["success_before"] == evals[0]["eval/success_rate"]
    assert summary["success_after"] == evals[-1]["eval/success_rate"]
    assert [e["step"] for e in summary["evals"]] == [0, 1, 2]
    assert Path(summary["learning_curve"]).stat().st_size > 1000
    # resumed from its last checkpoint (step 2) up to step 3: the evaluation at step 2 is redone
    # (the resume dropped its row with the step's), no 'before' again
    resumed = _run(_eval_bindings(model_dir, task_files, run_dir, **{"ExperimentConfig.num_steps": "3",
                                                                    "ExperimentConfig.resume": "True"}))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/tag"]) for r in rows if r.get("phase") == "eval"] == [
        (0, "before"), (1, "step_1"), (2, "step_2"), (3, "after")]
    assert resumed["steps_done"] == 3 and resumed["success_before"] == summary["success_before"]


def test_held_out_sets_that_cannot_measure_anything_are_refused_by_name(model_dir, task_files, tmp_path):
    train, _ = task_files
    same = _eval_bindings(model_dir, (train, train), tmp_path / "run")
    with pytest.raises(ValueError, match="all 4 held-out tasks are also training prompts"):
        gin_bindings.validate_job(gin_bindings.load_job([], same))
    greedy_many = _eval_bindings(model_dir, task_files, tmp_path / "run", **{"AgenticRollout.eval_samples": "4"})
    with pytest.raises(ValueError, match="eval_samples=4 with eval_temperature=0"):
        gin_bindings.validate_job(gin_bindings.load_job([], greedy_many))
    with pytest.raises(ValueError, match="ExperimentConfig.eval_every"):
        gin_bindings.load_job([], _eval_bindings(model_dir, task_files, tmp_path / "run",
                                                 **{"ExperimentConfig.eval_every": "-1"}))


def test_the_eval_fields_stay_out_of_the_resume_fingerprint(model_dir, task_files, tmp_path):
    with_eval = _eval_bindings(model_dir, task_files, tmp_path / "run")
    without = [b for b in with_eval if not b.startswith("AgenticRollout.eval_")]
    reprs = [repr(gin_bindings.load_job([], b).experiment.rollout) for b in (without, with_eval)]
    assert reprs[0] == reprs[1] and "eval_" not in reprs[0]


def test_when_the_held_out_set_is_due():
    runs = HeldOutRuns(held_out=None, eval_every=3, run_log=None, run_dir=Path("/nonexistent"))
    assert [s for s in range(10) if runs.due(s, last=False)] == [0, 3, 6, 9]
    runs.last_step = 6
    assert not runs.due(6, last=True) and runs.due(7, last=True)
    assert not HeldOutRuns(None, 0, None, Path("/x")).due(4, last=False)


def test_the_learning_curve_draws_steps_and_evaluations(tmp_path):
    rows = [{"step": 0, "phase": "eval", "eval/success_rate": 0.2, "eval/wall_s": 5.0}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "time/wall_s": 2.0} for s in range(4)]
    rows += [{"step": 4, "phase": "eval", "eval/success_rate": 0.5, "eval/wall_s": 5.0}]
    path = write_learning_curve(rows, tmp_path / "curve.png")
    assert path.stat().st_size > 1000


def test_reasoning_gym_items_read_as_math_tasks_are_verified_by_math_verify():
    opts = dict(size=4, seed=3, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    own = load_tasks("reasoning-gym:basic_arithmetic", **opts)
    math = load_tasks("reasoning-gym:basic_arithmetic", "math", **opts)
    assert [t.kind for t in math] == ["math"] * 4 and [t.answer for t in math] == [t.answer for t in own]
    assert [t.metadata["problem"] for t in math] == [t.metadata["question"] for t in own]
    task = math[0]
    # the scorer of the generator needs <answer> tags; math-verify also reads the final text's last number
    assert task_reward(own[0], f"It is {task.answer}.") == 0.0
    assert task_reward(task, f"It is {task.answer}.") == 1.0
    assert task_reward(task, f"<answer>{task.answer}</answer>") == 1.0
    assert task_reward(task, f"It is {int(task.answer) + 1}.") == 0.0
    with pytest.raises(ValueError, match="gives 'function_call' tasks, not kind 'math'"):
        load_tasks("bfcl:simple_python", "math")
