"""The architecture check: every import-linter contract in pyproject.toml is kept (the rooms
import downward only, no cycles between sibling modules), and the check does fail on an import
against the layer order (shown on a copy of the package with one such import added).

experiments/ and tests/ are not in the package, so they are not linted: recipes and tests may
import any room.
"""
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `lint-imports`, run by this interpreter (the console script may belong to another environment).
# No cache: the check must not write into the checkout, and a cold run takes about a second.
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
        "--no-cache", "--no-logo"]


def _contract_names(pyproject: Path) -> list[str]:
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    return [c["name"] for c in config["contracts"]]


def _lint(root: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:   # the copy shadows the installed package (sys.path precedes the editable finder)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    return subprocess.run(LINT + [str(root / "pyproject.toml")], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_every_import_linter_contract_is_kept():
    names = _contract_names(REPO / "pyproject.toml")
    assert "Rooms import downward only" in names
    out = _lint(REPO)
    report = out.stdout + out.stderr
    assert out.returncode == 0, f"lint-imports found imports against the architecture:\n{report}"
    for name in names:
        assert f"{name} KEPT" in report, report
    assert f"Contracts: {len(names)} kept, 0 broken." in report, report


def test_the_check_fails_on_an_import_against_the_layer_order(tmp_path):
    shutil.copytree(REPO / "sfrrl_jax", tmp_path / "sfrrl_jax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")   # the same contracts
    layers = tmp_path / "sfrrl_jax" / "models" / "layers.py"
    # models sits below trainer: the model code must not reach up into the RL loop
    layers.write_text(layers.read_text() + "\nimport sfrrl_jax.trainer.rl_trainer  # noqa: E402,F401\n")
    out = _lint(tmp_path, extra_path=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode != 0, report
    assert "Rooms import downward only BROKEN" in report, report
    assert "sfrrl_jax.models.layers -> sfrrl_jax.trainer.rl_trainer" in report, report   # the copy was linted
