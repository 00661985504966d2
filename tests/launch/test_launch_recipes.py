"""The recipe registry: a registered kind runs through gin and the CLI; unknown kinds and misbound
recipes are refused by name; the CLI says how to run a recipe when it cannot find experiments/."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfrrl_jax.launch import cli, gin_bindings, recipes
from sfrrl_jax.launch.recipes import get_recipe, recipe_kinds, register_recipe

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_GIN = REPO / "experiments" / "configs" / "quickstart.gin"


@dataclasses.dataclass(frozen=True)
class ToyRecipe:
    steps: int = 1


def run_toy(recipe: ToyRecipe, run_dir, log=print) -> dict:
    log(f"toy: {recipe.steps} steps")
    (Path(run_dir) / "toy.json").write_text(json.dumps({"steps": recipe.steps}))
    return {"steps": recipe.steps, "run_dir": str(run_dir)}


def validate_toy(recipe: ToyRecipe) -> None:
    if recipe.steps < 1:
        raise ValueError(f"ToyRecipe.steps must be >= 1, got {recipe.steps}")


@pytest.fixture
def toy():
    entry = register_recipe("toy", ToyRecipe, run_toy, validate_toy)
    yield entry
    recipes.unregister_recipe("toy")


def _gin(tmp_path, *lines):
    path = tmp_path / "job.gin"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_registered_recipe_runs_through_gin_and_the_cli(toy, tmp_path, capsys):
    assert recipe_kinds()[0] == "rl" and "toy" in recipe_kinds() and get_recipe("toy") is toy
    assert register_recipe("toy", ToyRecipe, run_toy, validate_toy) == toy   # the same again: a no-op
    run_dir = tmp_path / "run"
    gin_file = _gin(tmp_path, "Job.kind = 'toy'", "Job.toy = @ToyRecipe()", "ToyRecipe.steps = 3",
                    f"Job.run_dir = '{run_dir}'")
    job = gin_bindings.load_job([gin_file])
    assert job == gin_bindings.Job(kind="toy", recipe=ToyRecipe(3), run_dir=str(run_dir))
    assert gin_bindings.validate_job(job) is None
    lines = []
    summary = gin_bindings.run_job(job, gin_bindings.operative_config(), log=lines.append)
    assert summary == {"steps": 3, "run_dir": str(run_dir)} and lines == ["toy: 3 steps"]
    assert "ToyRecipe.steps = 3" in (run_dir / "operative_config.gin").read_text()
    # the registered validate runs for --validate_only
    assert cli.main([f"--gin_file={gin_file}", "--gin_param=ToyRecipe.steps = 0", "--validate_only"]) == 2
    assert "ToyRecipe.steps must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main([f"--gin_file={gin_file}", f"--run_dir={tmp_path / 'cli'}"]) == 0
    assert json.loads((tmp_path / "cli" / "toy.json").read_text()) == {"steps": 3}
    assert 'SUMMARY {"run_dir"' in capsys.readouterr().out


def test_unknown_kinds_and_misbound_recipes_are_refused_by_name(toy, tmp_path):
    with pytest.raises(gin_bindings.GinConfigError, match=r"Job.kind='tyo'; valid: \['rl', .*'toy'\]"):
        gin_bindings.load_job([_gin(tmp_path, "Job.kind = 'tyo'", "Job.run_dir = '/x'")])
    with pytest.raises(ValueError, match=r"Job.kind='toy' needs Job.toy = @ToyRecipe\(\)"):
        gin_bindings.Job(kind="toy", run_dir="/x")
    with pytest.raises(ValueError, match="Job.toy must be a ToyRecipe, got dict"):
        gin_bindings.Job(kind="toy", recipe={"steps": 1}, run_dir="/x")
    with pytest.raises(ValueError, match="Job.kind='toy' needs Job.run_dir"):
        gin_bindings.Job(kind="toy", recipe=ToyRecipe())
    # gin accepts any name for Job's recipe parameter, so make_job names what is not one
    with pytest.raises(gin_bindings.GinConfigError, match="Job has no parameter 'experimnt'"):
        gin_bindings.load_job([_gin(tmp_path, "Job.kind = 'rl'", "Job.experimnt = None")])
    with pytest.raises(gin_bindings.GinConfigError, match="Job.kind='rl' but Job.toy is bound"):
        gin_bindings.load_job([_gin(tmp_path, "Job.kind = 'rl'", "Job.experiment = @ExperimentConfig()",
                                    "ExperimentConfig.run_dir = '/x'", "Job.toy = @ToyRecipe()")])


@pytest.mark.parametrize("kind, cls, error", [
    ("rl", ToyRecipe, "kind 'rl' is taken by the Job itself"),
    ("run_dir", ToyRecipe, "kind 'run_dir' is taken by the Job itself"),
    ("my-recipe", ToyRecipe, "kind must be an identifier"),
    ("toy", dict, "kind 'toy' is already registered to .*ToyRecipe"),
])
def test_register_recipe_refuses_taken_or_bad_kinds(toy, kind, cls, error):
    with pytest.raises(ValueError, match=error):
        register_recipe(kind, cls, run_toy)


def test_cli_without_experiments_says_how_to_run_the_recipe(monkeypatch, capsys):
    # As in an install that is not a checkout: no recipe registered, experiments/ not found.
    monkeypatch.setattr(recipes, "_RECIPES", {})
    monkeypatch.setattr(cli, "import_shipped_recipes", lambda: False)
    assert cli.main([f"--gin_file={QUICKSTART_GIN}", "--validate_only"]) == 2
    err = capsys.readouterr().err
    # which of the two depends on whether gin met QuickstartRecipe earlier in this process
    assert ("Job.kind='quickstart'; valid: ['rl']" in err
            or "No configurable matching reference '@QuickstartRecipe()'" in err)
    assert "python experiments/train.py --gin_file=experiments/configs/quickstart.gin" in err


def test_installed_cli_finds_the_checkouts_recipes_from_any_directory(tmp_path):
    # The editable install's CLI, run outside the checkout with nothing on PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "sfrrl_jax.launch.cli", f"--gin_file={QUICKSTART_GIN}",
                          "--validate_only"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "config valid (quickstart)" in out.stdout, out.stderr[-3000:]
