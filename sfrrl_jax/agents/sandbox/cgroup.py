"""Per-call memory cgroups for the sandbox: the memory cap of one call holds for all its processes
together (RLIMIT_AS alone caps each process, so a call could hold max_processes x memory_bytes).

Where they are made: under the cgroup this host process is in (as /proc/self/cgroup names it),
never anywhere else, and nothing of the host's own cgroup is changed:

* cgroup v2 (unified hierarchy), if that cgroup already delegates the memory controller to its
  children (`memory` in its cgroup.subtree_control; enabling it ourselves would need an empty
  cgroup): `memory.max` = the cap, `memory.swap.max` = 0, `memory.oom.group` = 1 (an OOM kill
  takes the whole call down, not one of its processes).
* else cgroup v1, the `memory` hierarchy: `memory.limit_in_bytes` = the cap, and where the kernel
  accounts swap, `memory.memsw.limit_in_bytes` = the cap too (memory and swap together);
  `memory.swappiness` = 0. An OOM kill takes the call's largest process.

What is charged: every page the call's processes touch, their tmpfs files (/tmp, /dev/shm) and
SysV shared memory, the page cache they bring in (reclaimable), and the jail's own launcher and
init (a few MiB: what they touch after the launcher joins the cgroup).

Lifecycle: `MemoryCgroups.create` makes `sfrrl_sbx_<host pid>_<random>`; the host writes the
launcher's pid into it (`CallCgroup.add`) before it sends the launcher its config, so nothing of
the call has forked yet; after the call `CallCgroup.remove` SIGKILLs whatever is still in it
and removes it (retrying for up to 2 s: exiting tasks take a moment to leave). Cgroups left behind
by a host process that died are removed by the next `find()`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import secrets
import signal
import time

PREFIX = "sfrrl_sbx_"
_REMOVE_TRIES, _REMOVE_PAUSE_S = 200, 0.01

logger = logging.getLogger(__name__)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _own_cgroup_dirs() -> list[tuple[int, str]]:
    """(version, directory) of this process's cgroup: the v2 one first, then v1's memory one."""
    memberships = {}  # "" (v2) or "memory" (v1) -> path inside its hierarchy
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            memberships[""] = path
        elif "memory" in controllers.split(","):
            memberships["memory"] = path
    found = []
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        sep = fields.index("-")
        root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        key = "" if fstype == "cgroup2" else "memory" if fstype == "cgroup" and "memory" in options else None
        path = memberships.get(key) if key is not None else None
        if path is None or not (path == root or path.startswith(root.rstrip("/") + "/")):
            continue  # not our hierarchy, or a mount that does not reach our cgroup
        directory = os.path.normpath(os.path.join(mount_point, path[len(root):].lstrip("/")))
        found.append((2 if key == "" else 1, directory))
    return sorted(set(found), reverse=True)


@dataclasses.dataclass(frozen=True)
class CallCgroup:
    """One call's cgroup (see the module docstring)."""

    path: str
    version: int

    def add(self, pid: int) -> None:
        _write(os.path.join(self.path, "cgroup.procs"), pid)

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this cgroup (its cap was hit)."""
        text = _read(os.path.join(self.path, "memory.events" if self.version == 2 else "memory.oom_control")) or ""
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0))

    def peak_bytes(self) -> int | None:
        """The most memory the call held at once (all its processes), where the kernel says."""
        text = _read(os.path.join(self.path, "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))
        return int(text) if text and text.strip().isdigit() else None

    def try_remove(self) -> bool:
        """SIGKILL what is left in it, then remove it; False while the kernel still holds tasks."""
        if not os.path.isdir(self.path):
            return True
        if self.version == 2 and os.path.exists(os.path.join(self.path, "cgroup.kill")):
            try:
                _write(os.path.join(self.path, "cgroup.kill"), 1)
            except OSError:
                pass
        for pid in (_read(os.path.join(self.path, "cgroup.procs")) or "").split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        try:
            os.rmdir(self.path)
            return True
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY: tasks still leaving
            return False

    def remove(self) -> None:
        for _ in range(_REMOVE_TRIES):
            if self.try_remove():
                return
            time.sleep(_REMOVE_PAUSE_S)
        logger.warning("sandbox: could not remove memory cgroup %s (tasks still in it)", self.path)

    async def remove_async(self) -> None:
        for _ in range(_REMOVE_TRIES):
            if self.try_remove():
                return
            await asyncio.sleep(_REMOVE_PAUSE_S)
        logger.warning("sandbox: could not remove memory cgroup %s (tasks still in it)", self.path)


@dataclasses.dataclass(frozen=True)
class MemoryCgroups:
    """Where per-call memory cgroups are made: `parent` directory, cgroup `version` (1 or 2)."""

    parent: str
    version: int

    def create(self, limit_bytes: int) -> CallCgroup:
        """A new cgroup capped at `limit_bytes`; raises OSError if the cap cannot be set."""
        path = os.path.join(self.parent, f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}")
        os.mkdir(path)
        call = CallCgroup(path, self.version)
        try:
            if self.version == 2:
                _write(os.path.join(path, "memory.max"), limit_bytes)
                optional = (("memory.swap.max", 0), ("memory.oom.group", 1))
            else:
                # memory first: memsw may never be below it
                _write(os.path.join(path, "memory.limit_in_bytes"), limit_bytes)
                optional = (("memory.memsw.limit_in_bytes", limit_bytes), ("memory.swappiness", 0))
            for name, value in optional:
                if os.path.exists(os.path.join(path, name)):
                    try:
                        _write(os.path.join(path, name), value)
                    except OSError:
                        if name.startswith("memory.memsw") or name == "memory.swap.max":
                            raise  # swap accounting is there, and refused the cap: not a cap then
        except BaseException:
            call.try_remove()
            raise
        return call

    def remove_stale(self) -> None:
        """Remove cgroups left by host processes that have died (a crash mid-call)."""
        try:
            entries = os.listdir(self.parent)
        except OSError:
            return
        for entry in entries:
            match = re.fullmatch(PREFIX + r"(\d+)_[0-9a-f]+", entry)
            if not match:
                continue
            try:
                os.kill(int(match.group(1)), 0)
                continue  # its host is alive
            except ProcessLookupError:
                CallCgroup(os.path.join(self.parent, entry), self.version).try_remove()
            except OSError:
                continue


def find() -> MemoryCgroups | None:
    """Where this process can make capped per-call memory cgroups, or None (then the sandbox
    splits its cap over rlimits; see `python_sandbox.py`). Tries one: make it, cap it, remove it."""
    for version, directory in _own_cgroup_dirs():
        if version == 2 and "memory" not in (_read(os.path.join(directory, "cgroup.subtree_control")) or "").split():
            continue
        if version == 1 and not os.path.exists(os.path.join(directory, "memory.limit_in_bytes")):
            continue
        cgroups = MemoryCgroups(directory, version)
        try:
            trial = cgroups.create(64 * 2**20)
        except OSError:
            continue
        if not trial.try_remove():
            continue
        cgroups.remove_stale()
        return cgroups
    return None
