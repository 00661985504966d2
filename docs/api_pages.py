"""mkdocs hook (mkdocs.yml `hooks:`): writes the API reference pages' member lists at build time.

Every public object is documented once, on the page of the room that owns it (the room whose package
holds the module defining it; else the first room, bottom-up, that exports it), so each has one anchor
and cross-references resolve. A page then lists the names it also exports, linking to their owner's
entry; the `import sfrrl_jax as S` page documents what no room exports and links the rest.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re

# Bottom-up, as the import-linter layers (pyproject.toml); the order picks an owner among exporters.
ROOMS = ("tokenizer", "models", "engine", "rl", "learner", "agents", "trainer", "checkpoints", "testing", "plan",
         "launch")
# Packages inside a room with an `__all__` of their own (a section of the room's page).
INNER = {"agents": ("formats", "sandbox", "tasks"), "checkpoints": ("hf",)}
MARKER = re.compile(r"<!-- members (\S+) -->")


def _exports(package: str) -> list[str]:
    return list(getattr(importlib.import_module(package), "__all__", ()))


def _clashes(package: str, name: str, obj) -> bool:
    """A module of the same name stands on the export's path (`engine.generate`, the function, beside
    `engine/generate.py`; `reasoning_gym_tasks` defined in `tasks/reasoning_gym_tasks.py`): the
    documentation tools read the name as the module, so the entry is written under the object's path."""
    own_module = getattr(obj, "__module__", "") or ""
    return (importlib.util.find_spec(f"{package}.{name}") is not None
            or own_module.rsplit(".", 1)[-1] == getattr(obj, "__name__", None))


def _has_identity(obj) -> bool:
    return inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)


def _entry(package: str, name: str, obj) -> str:
    if _clashes(package, name, obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"{package}.{name}"


def owners() -> dict[int, str]:
    """id(object) -> the qualified name of its documented entry ('sfrrl_jax.rl.LossConfig')."""
    out: dict[int, str] = {}
    packages = []
    for room in ROOMS:   # a room's inner packages first: they own what they define
        packages += [f"sfrrl_jax.{room}.{inner}" for inner in INNER.get(room, ())] + [f"sfrrl_jax.{room}"]
    for defining_first in (True, False):
        for package in packages:
            module = importlib.import_module(package)
            for name in _exports(package):
                obj = getattr(module, name)
                if not _has_identity(obj):
                    continue   # a constant ('data') is documented where it is exported, each time
                home = getattr(inspect.getmodule(obj), "__name__", "") if defining_first else package
                if id(obj) not in out and (home == package or home.startswith(package + ".")):
                    out[id(obj)] = _entry(package, name, obj)
    return out


def page_markdown(package: str, own: dict[int, str]) -> str:
    """The mkdocstrings block of `package` (the members it owns) and links to the rest of its exports."""
    module = importlib.import_module(package)
    mine, apart, elsewhere = [], [], []
    for name in _exports(package):
        obj = getattr(module, name)
        entry = own.get(id(obj)) if _has_identity(obj) else None
        if entry is None or entry == f"{package}.{name}":
            mine.append(name)
        elif entry == _entry(package, name, obj):
            apart.append(entry)   # owned here, written under its own path
        else:
            elsewhere.append((name, entry))
    lines = [f"::: {package}", "    options:", "      members:"]
    lines += [f"        - {name}" for name in mine] or ["        []"]
    for entry in apart:
        lines += ["", f"::: {entry}", "    options:", "      heading_level: 3"]
    if elsewhere:
        lines += ["", "### Also exported here", "", "| name | documented as |", "|---|---|"]
        lines += [f"| `{name}` | [`{entry}`][{entry}] |" for name, entry in elsewhere]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs event: replaces each `<!-- members PACKAGE -->` marker of a page with that package's block."""
    own = owners() if MARKER.search(markdown) else {}
    return MARKER.sub(lambda m: page_markdown(m.group(1), own), markdown)
