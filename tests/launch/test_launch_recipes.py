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


def test_cli_without_the_recipe_module_says_how_to_run_the_recipe(monkeypatch, capsys):
    # As in a run that imported no recipe module: no recipe registered.
    monkeypatch.setattr(recipes, "_RECIPES", {})
    assert cli.main([f"--gin_file={QUICKSTART_GIN}", "--validate_only"]) == 2
    err = capsys.readouterr().err
    # which of the two depends on whether gin met QuickstartRecipe earlier in this process
    assert ("Job.kind='quickstart'; valid: ['rl']" in err
            or "No configurable matching reference '@QuickstartRecipe()'" in err)
    assert "python experiments/train.py --gin_file=experiments/configs/quickstart.gin" in err
    assert "--recipe_module" in err


def _cli(args: list[str], cwd, pythonpath: list[str] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    # sfrrl-train's own interpreter state: -c, so the cwd is not put on sys.path (as for the console script)
    return subprocess.run([sys.executable, "-c", "import sys; from sfrrl_jax.launch.cli import main; "
                           "sys.exit(main(sys.argv[1:]))"] + args, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_installed_cli_imports_only_the_recipe_modules_it_is_given(tmp_path):
    # The library never puts the checkout on sys.path: without --recipe_module the shipped recipes
    # are unknown even in the checkout's root, and the error says how to run them.
    out = _cli([f"--gin_file={QUICKSTART_GIN}", "--validate_only"], cwd=REPO)
    assert out.returncode == 2 and "python experiments/train.py" in out.stderr, out.stderr[-3000:]
    # --recipe_module imports the module as Python finds it (here on PYTHONPATH), from any directory
    out = _cli(["--recipe_module=experiments.recipes", f"--gin_file={QUICKSTART_GIN}", "--validate_only"],
               cwd=tmp_path, pythonpath=[REPO])
    assert out.returncode == 0 and "config valid (quickstart)" in out.stdout, out.stderr[-3000:]
    out = _cli(["--recipe_module=no_such_recipes", f"--gin_file={QUICKSTART_GIN}", "--validate_only"], cwd=tmp_path)
    assert out.returncode == 2 and "cannot import a recipe module" in out.stderr, out.stderr[-3000:]
    assert "no_such_recipes" in out.stderr


def test_installed_cli_imports_the_recipes_of_an_entry_point(tmp_path):
    # A package of recipes declares an `sfrrl_jax.recipes` entry point; installed (here: its module and
    # dist-info on sys.path, as pip lays them out), the CLI imports it and its Job kind runs.
    (tmp_path / "toy_recipes.py").write_text(
        "import dataclasses\n"
        "from sfrrl_jax.launch.recipes import register_recipe\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class EntryToy:\n    steps: int = 1\n"
        "def run(recipe, run_dir, log=print):\n    log(f'entry toy ran {recipe.steps} steps')\n"
        "    return {'steps': recipe.steps}\n"
        "register_recipe('entry_toy', EntryToy, run)\n")
    info = tmp_path / "toy_recipes-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-recipes\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sfrrl_jax.recipes]\ntoy = toy_recipes\n")
    gin_file = tmp_path / "toy.gin"
    gin_file.write_text("Job.kind = 'entry_toy'\nJob.entry_toy = @EntryToy()\nEntryToy.steps = 3\n"
                        f"Job.run_dir = {str(tmp_path / 'run')!r}\n")
    out = _cli([f"--gin_file={gin_file}"], cwd=tmp_path, pythonpath=[tmp_path])
    assert out.returncode == 0 and "entry toy ran 3 steps" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
