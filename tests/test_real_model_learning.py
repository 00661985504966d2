"""experiments/bench/real_model_learning.py's pure parts, without the real model and without TRL:
a run's metrics.jsonl becomes per-step rewards, train walls (evaluations excluded) and held-out
evaluations placed at the train wall of the steps before them; the table's gain is after - before."""
import importlib.util
import json
import pathlib
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench" / "real_model_learning.py"


def _load():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("real_model_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_becomes_curves_and_a_table_row(tmp_path):
    bench = _load()
    rows = [{"step": 0, "phase": "eval", "eval/success_rate": 0.2, "eval/wall_s": 50.0}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "time/wall_s": 10.0 + s, "rollout/generated_tokens": 100}
             for s in range(4)]
    rows.insert(3, {"step": 2, "phase": "eval", "eval/success_rate": 0.3, "eval/wall_s": 50.0})
    rows.append({"step": 4, "phase": "eval", "eval/success_rate": 0.45, "eval/wall_s": 50.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = bench.read_run(tmp_path)
    assert run["rewards"] == [0.0, 0.1, 0.2, 0.30000000000000004]
    assert run["step_walls"] == [10.0, 21.0, 33.0, 46.0]   # the evaluations' 50 s are not in it
    assert run["evals"] == [{"step": 0, "success_rate": 0.2, "train_wall_s": 0.0},
                            {"step": 2, "success_rate": 0.3, "train_wall_s": 21.0},
                            {"step": 4, "success_rate": 0.45, "train_wall_s": 46.0}]
    g = bench.gain(run)
    assert g["steps"] == 4 and abs(g["gain"] - 0.25) < 1e-12 and g["train_wall_s"] == 46.0
    table = bench.format_table({"seeds": {0: {"ours": run}}})
    assert "| 0 | ours | 0.200 | 0.450 | +25.0 | 4 | 46 |" in table
    bench.plot({"seeds": {0: {"ours": run, "trl": run}}}, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert bench.seed_bindings(2, "/r", 7) == ["ExperimentConfig.seed = 2", "AgentConfig.seed = 2", "RUN_DIR = '/r'",
                                               "ExperimentConfig.num_steps = 7"]
    # the bindings load with the gin file (each one used: the CLI refuses a binding nothing reads)
    from sfrrl_jax.launch import gin_bindings
    job = gin_bindings.load_job([str(SCRIPT.parents[1] / "configs" / "smollm2_learns.gin")],
                                bench.seed_bindings(2, "/r", 7))
    assert job.run_dir == "/r" and job.recipe.experiment.run_dir == "/r" and job.recipe.experiment.seed == 2
    assert job.recipe.experiment.num_steps == 7 and job.recipe.experiment.rollout.agent.seed == 2
