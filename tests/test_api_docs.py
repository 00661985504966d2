"""The API reference a researcher browses: every public name (`import sfrrl_jax as S` and each room's
`__all__`) carries a docstring, a function's has an Args section (and Returns where it returns
something), its signature is annotated, and the mkdocstrings site (mkdocs.yml) builds with warnings
as errors (griffe warns on a documented parameter the signature lacks, or one without a type) and
shows every one of those names."""
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sfrrl_jax

REPO = Path(__file__).resolve().parents[1]


def public_names() -> dict[str, object]:
    """'module.name' -> object for every name in the `__all__` of sfrrl_jax and of its sub-packages
    (an object re-exported in several places is listed at the first)."""
    packages = ["sfrrl_jax"] + sorted(m.name for m in pkgutil.walk_packages(sfrrl_jax.__path__, "sfrrl_jax.")
                                      if m.ispkg)
    out, seen = {}, set()
    for name in packages:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if id(obj) not in seen:
                seen.add(id(obj))
                out[f"{name}.{attr}"] = obj
    return out


def _own_doc(obj) -> str | None:
    doc = obj.__doc__
    if inspect.isclass(obj) and doc and doc.startswith(obj.__name__ + "("):
        return None   # the signature dataclasses write when a class has no docstring of its own
    return inspect.cleandoc(doc) if doc else None


def doc_problems(names: dict[str, object]) -> list[str]:
    """One line per public class or function whose docstring or annotations fall short."""
    out = []
    for qual, obj in names.items():
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = _own_doc(obj)
        if not doc:
            out.append(f"{qual}: no docstring")
            continue
        if not inspect.isfunction(obj):
            continue
        sig = inspect.signature(obj)
        params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
        if params and not re.search(r"^(Args|Arguments):", doc, re.M):
            out.append(f"{qual}: no Args section")
        returns_none = sig.return_annotation in (None, "None")
        if not returns_none and not re.search(r"^(Returns|Yields):", doc, re.M):
            out.append(f"{qual}: no Returns section")
        missing = [p.name for p in params if p.annotation is inspect.Parameter.empty
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if sig.return_annotation is inspect.Signature.empty:
            missing.append("return")
        if missing:
            out.append(f"{qual}: unannotated {missing}")
    return out


def test_every_public_name_is_documented_and_annotated():
    names = public_names()
    assert len(names) > 150   # the listing is real: S alone exports more than that
    assert doc_problems(names) == []


def test_the_check_fails_on_an_undocumented_or_unannotated_function():
    def bare(x, y: int = 0):
        return x

    def prose(x: int) -> int:
        """Adds one."""
        return x + 1

    assert doc_problems({"m.bare": bare, "m.prose": prose}) == [
        "m.bare: no docstring", "m.prose: no Args section", "m.prose: no Returns section"]


@pytest.mark.skipif(importlib.util.find_spec("mkdocstrings_handlers") is None,
                    reason="mkdocstrings[python] is not installed (the 'test' extra brings it)")
def test_the_api_reference_builds_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                          "-d", str(site)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    html = "".join(p.read_text() for p in site.rglob("index.html"))
    # each object is documented once, under the entry the build's hook gives it (docs/api_pages.py)
    spec = importlib.util.spec_from_file_location("api_pages", REPO / "docs" / "api_pages.py")
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    entries = pages.owners()
    names = public_names()
    missing = [q for q, obj in names.items()
               if f'id="{entries.get(id(obj), q) if pages._has_identity(obj) else q}"' not in html]
    assert missing == [], f"public names with no entry in the API reference: {missing[:20]}"
    assert len(set(entries.values())) == len(entries)   # one entry per object: cross-references resolve
