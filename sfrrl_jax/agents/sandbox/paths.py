"""What the sandbox's filesystem view hides and exposes (`python_sandbox.PythonSandbox`'s mount plan).

The jail covers the host's private places (home directories, /run's sockets, mounted data), the
project, the trainer's cwd, every non-stdlib `sys.path` entry and site-packages with empty
read-only mounts, and binds back the base interpreter's stdlib (and what the config allows).
`_jail_plan(cfg)` turns a `SandboxConfig` into the launcher's `hide` / `expose` / `sys_path`
lists (launcher.py's config keys).
"""
from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

# Never covered, even if they are the trainer's cwd or on its sys.path: the jail needs them.
_SYSTEM_DIRS = ("/", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/usr/bin", "/usr/sbin",
                "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libexec", "/usr/local", "/usr/local/bin",
                "/usr/local/lib", "/usr/share", "/etc", "/dev", "/proc", "/sys", "/tmp", "/var", "/var/tmp")
# Always covered: host sockets (/run), other users' files, mounted data.
_ALWAYS_HIDDEN = ("/root", "/home", "/run", "/mnt", "/media", "/srv")
# The checkout holding the package: this file is <root>/sfrrl_jax/agents/sandbox/paths.py (moving it
# changes the count; the jail covers this directory, see `_jail_plan`).
_PROJECT_ROOT = str(Path(__file__).resolve().parents[3])


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _stdlib_dirs() -> list[str]:
    # The base interpreter's (the one the jail runs): in a venv, "platstdlib" would otherwise name
    # the venv's own lib/pythonX.Y, which holds its site-packages.
    bases = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix,
             "installed_platbase": sys.base_exec_prefix}
    dirs = []
    for key in ("stdlib", "platstdlib"):
        base = sysconfig.get_path(key, vars=bases)
        dirs += [base, os.path.join(base, "lib-dynload")]
    dirs = [d for d in dirs if os.path.isdir(d)]
    return sorted(set(dirs + [os.path.realpath(d) for d in dirs]))


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    dirs += [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return sorted({os.path.realpath(d) for d in dirs if d and os.path.isdir(d)})


def _jail_plan(cfg) -> dict:
    """The launcher's `hide` / `expose` / `sys_path` lists for a `SandboxConfig` (its `visible_paths`
    and `allow_site_packages`; see launcher.py)."""
    stdlib = _stdlib_dirs()
    sites = _site_dirs()
    visible = sorted({os.path.realpath(p) for p in cfg.visible_paths})
    expose = stdlib + visible + (sites if cfg.allow_site_packages else [])
    candidates = list(_ALWAYS_HIDDEN) + [_PROJECT_ROOT, os.getcwd(), os.path.expanduser("~")]
    candidates += [p for p in sys.path if p and os.path.isdir(p)] + ([] if cfg.allow_site_packages else sites)
    # An exposed directory under one the jail's uid cannot traverse (pyenv under a 0700 /root) is
    # reachable only if that ancestor is covered too (the cover's mount points are mode 0755).
    for path in expose:
        if not os.path.isdir(path):
            continue
        parts = Path(path).parts
        for i in range(2, len(parts)):
            ancestor = os.path.join(*parts[:i])
            try:
                traversable = os.stat(ancestor).st_mode & 0o001
            except OSError:
                traversable = 0
            if not traversable:
                candidates.append(ancestor)
                break
    hide = set()
    for path in candidates:
        path = os.path.realpath(path)
        if not os.path.isdir(path) or path in stdlib:
            continue
        if any(_inside(system, path) for system in _SYSTEM_DIRS):
            continue  # a system dir or an ancestor of one
        if any(_inside(path, v) for v in visible) or (cfg.allow_site_packages and path in sites):
            continue  # explicitly allowed
        hide.add(path)
    sys_path = sites if cfg.allow_site_packages else []
    return {"hide": sorted(hide), "expose": sorted(set(expose)), "sys_path": sys_path}
