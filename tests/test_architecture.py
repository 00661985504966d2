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


def _lint_copy_with(tmp_path: Path, module: str, line: str) -> str:
    """Lints a copy of the package (same contracts) with `line` appended to `module` (a path under
    sfrrl_jax/); returns the report, asserting the check failed."""
    shutil.copytree(REPO / "sfrrl_jax", tmp_path / "sfrrl_jax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")   # the same contracts
    target = tmp_path / "sfrrl_jax" / module
    target.write_text(target.read_text() + f"\n{line}  # noqa: E402,F401\n")
    out = _lint(tmp_path, extra_path=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode != 0, report
    return report


def test_the_check_fails_on_an_import_against_the_layer_order(tmp_path):
    # models sits below trainer: the model code must not reach up into the RL loop
    report = _lint_copy_with(tmp_path, "models/layers.py", "import sfrrl_jax.trainer.rl_trainer")
    assert "Rooms import downward only BROKEN" in report, report
    assert "sfrrl_jax.models.layers -> sfrrl_jax.trainer.rl_trainer" in report, report   # the copy was linted


def escaping_arrows(package: Path) -> list[str]:
    """Arrows import-linter cannot see: code in the package that edits `sys.path` (so that it can
    import what is not installed) or imports the checkout's `experiments` (experiment code, which
    imports the library, never the other way). One 'file:line: what' per finding."""
    import ast
    out = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = lambda node: f"{path.relative_to(package.parent)}:{node.lineno}"   # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and ast.unparse(node.func.value) == "sys.path" \
                    and node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear"):
                out.append(f"{where(node)}: sys.path.{node.func.attr}(...)")
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(ast.unparse(t).startswith("sys.path") for t in targets):
                    out.append(f"{where(node)}: assigns sys.path")
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "experiments" for a in node.names):
                out.append(f"{where(node)}: import experiments")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "experiments":
                out.append(f"{where(node)}: from {node.module} import ...")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module") \
                    and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).split(".")[0] == "experiments":
                out.append(f"{where(node)}: import_module({node.args[0].value!r})")
    return sorted(out, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def test_no_arrow_escapes_the_check():
    assert escaping_arrows(REPO / "sfrrl_jax") == []


def test_the_escape_check_fails_on_a_sys_path_edit_or_an_experiments_import(tmp_path):
    pkg = tmp_path / "sfrrl_jax"
    (pkg / "launch").mkdir(parents=True)
    (pkg / "launch" / "cli.py").write_text(
        "import importlib\nimport sys\nsys.path.insert(0, '/checkout')\nsys.path += ['/x']\n"
        "import experiments.recipes\nfrom experiments import recipes\nimportlib.import_module('experiments.recipes')\n")
    assert escaping_arrows(pkg) == [
        "sfrrl_jax/launch/cli.py:3: sys.path.insert(...)", "sfrrl_jax/launch/cli.py:4: assigns sys.path",
        "sfrrl_jax/launch/cli.py:5: import experiments", "sfrrl_jax/launch/cli.py:6: from experiments import ...",
        "sfrrl_jax/launch/cli.py:7: import_module('experiments.recipes')"]


def test_the_check_fails_when_launch_imports_the_testing_room(tmp_path):
    # the synthetic workload as the runner's default rollout: the arrow this contract forbids
    report = _lint_copy_with(tmp_path, "launch/runner.py", "from sfrrl_jax.testing.workload import WorkloadRollout")
    assert "Launch does not import the testing room BROKEN" in report, report
    assert "sfrrl_jax.launch.runner -> sfrrl_jax.testing.workload" in report, report
