"""Sandboxed Python: one fresh, jailed process per call (see `launcher.py` for the jail).

What the jail enforces (every layer is probed once per host uid by `probe_capabilities`;
`PythonSandbox` refuses to start unless all of them work, see "Unisolated mode" below):

* a separate process per call in its own process group, killed as a group on the wall-clock
  timeout (which starts when the call gets one of the `max_concurrency` slots, not while it
  queues); rlimits on CPU seconds, address space, file size, open files and processes; stdout and
  stderr capped (the process is killed once it writes more); stdin is /dev/null.
* memory: `memory_bytes` caps the whole call, all its processes together, and each process's
  address space (RLIMIT_AS) on its own too. The whole-call cap is a memory cgroup per call
  (`cgroup.py`: cgroup v2 `memory.max` where our cgroup delegates the memory controller,
  else cgroup v1 `memory.limit_in_bytes`, swap included where the kernel accounts it), which
  also charges the call's tmpfs files and shared memory, and its launcher and init (a few MiB).
  An OOM kill in it shows as `SandboxResult.memory_limit_hit` ("killed by the memory limit").
  Where no memory cgroup can be made, the cap is split instead: max_processes is lowered to
  n = memory_bytes // 128 MiB (at least 1, at most max_processes) and RLIMIT_AS to
  memory_bytes // n, so n processes x their address space <= memory_bytes (RLIMIT_NPROC counts
  threads too; the private tmpfs mounts and SysV shared memory, `tmpfs_bytes` each, come on top).
  `SandboxCapabilities.memory_cap` says which one this machine allows ("cgroup2", "cgroup1" or
  "rlimit-split"), `PythonSandbox.memory_cap` which one a sandbox uses, with its numbers.
* a clean environment: the launcher is started with an explicit environment (LANG only), and the
  code's process is a fresh interpreter with four variables (HOME, TMPDIR, PATH, LANG), so the
  trainer's variables are neither in `os.environ` nor anywhere in the process's memory.
* a fresh interpreter: the jail is built by `launcher.py`, then the code's process execs
  a new `python -I -S` (the base interpreter, never a venv's) that receives only the seccomp
  program and the code, so no frame, object or module of the launcher (its config names host
  paths: the project, the cwd, the hidden directories) exists where the code runs; its argv,
  `sys.executable` and /proc/self/exe name only that interpreter's real path.
* a fresh unprivileged uid per concurrent slot (drawn from a random range per sandbox): root
  ignores RLIMIT_NPROC, and a per-call uid makes the process cap per call.
* network namespace: no interface but a down loopback; every connect fails (`isolate_network`).
* mount namespace: every mount is read-only and nosuid; /root, /home, /run, /mnt, /media, /srv,
  the project, the trainer's cwd, every non-stdlib `sys.path` entry and site-packages are covered
  by empty read-only tmpfs mounts (only the stdlib is bound back), unless `visible_paths` or
  `allow_site_packages` allow them; /tmp (the cwd), /var/tmp and /dev/shm are private,
  size-capped tmpfs mounts that vanish with the call.
* pid namespace with its own /proc (hidepid=2): the code sees only its own processes, and when
  its main process ends the kernel kills everything it spawned, even after setsid().
* IPC namespace (SysV shared memory, queues, semaphores, POSIX queues): nothing is shared with
  the host or with other calls, nothing outlives the call, and shared memory is capped at
  `tmpfs_bytes`. UTS namespace: the hostname is "sandbox".
* no_new_privs (setuid binaries do not raise privileges) and a seccomp filter
  (`seccomp.py`): no ptrace, namespaces, mount API, keyrings, bpf, perf, userfaultfd,
  io_uring, module/kexec calls; sockets only AF_INET/AF_INET6 (no AF_UNIX connection to a
  host daemon, even to a socket in a visible path); no execve / execveat unless
  `SandboxConfig.allow_exec`: the code cannot start another interpreter or any program
  (`subprocess`, `os.exec*` raise PermissionError); fork, threads and multiprocessing's fork
  start method work.

Not enforced: CPU time is per process (the wall timeout bounds a fork bomb's total); /sys and
/etc are readable (read-only); the paths the denylist above does not name (e.g. a /data tree)
are readable if their permissions allow the jail's uid; the interpreter binary and the shared
libraries it maps are visible (read-only, where a hidden directory holds them: the fresh
interpreter needs them), so with `allow_exec` the code can start `sys.executable`; denying exec
does not stop native code: ctypes still runs any machine code inside the code's own process,
under the same jail. A base interpreter installed inside the project (not a venv, which is
never used) would name the project in the code's argv: the stdlib lives there too.

Unisolated mode: without root, or where the kernel refuses a namespace (no CAP_SYS_ADMIN, a
container's seccomp), `PythonSandbox` raises a RuntimeError naming what is missing, unless
`SandboxConfig(allow_unisolated=True)`: then it warns loudly (warnings + logging) and runs with
what there is. Without root the code then runs as the trainer's own uid and can write its files,
signal its processes and leave daemons behind; only the rlimits, the clean environment, the
fresh interpreter, no_new_privs and seccomp (which then also denies SysV IPC) still hold, and
the memory cap where the trainer's uid may make memory cgroups. Without a mount namespace the
jail's uid must be able to reach the interpreter itself (it runs it by path).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

# Aliased: `cgroup` and `seccomp` are local names here (a call's `CallCgroup`, the filter's bytes).
from sfrrl_jax.agents.sandbox import cgroup as sandbox_cgroup, seccomp as sandbox_seccomp
from sfrrl_jax.agents.sandbox.paths import (_ALWAYS_HIDDEN, _PROJECT_ROOT, _jail_plan, _site_dirs,  # noqa: F401
                                            _stdlib_dirs)

_LAUNCHER = str(Path(__file__).with_name("launcher.py"))
SETUP_FAILED = 121
# The launcher's whole environment: the process stack (inherited by the code) holds nothing else.
_LAUNCHER_ENV = {"LANG": "C.UTF-8"}
# Without a memory cgroup the call's cap is split over its processes (see the module docstring);
# no process gets less address space than this (an interpreter with a few threads fits).
_SPLIT_MIN_PROCESS_BYTES = 128 * 2**20
_MiB = 2**20

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed call. Sizes in bytes, times in seconds.

    `visible_paths`: absolute directories the code may read (bound read-only at the same path,
    even under a hidden directory, e.g. the project). `allow_site_packages`: make the
    interpreter's site-packages readable and importable. `allow_exec`: let the code start other
    programs (execve / execveat; `subprocess`, `os.exec*`, multiprocessing's spawn), only those
    the jail shows it, under the same limits; denied by default (EPERM, a PermissionError).
    `allow_unisolated`: run even where the jail cannot be built (see the module docstring);
    never the default.
    """

    wall_timeout_s: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    max_processes: int = 16
    max_file_bytes: int = 8 * 2**20
    tmpfs_bytes: int = 32 * 2**20
    max_open_files: int = 64
    output_limit_bytes: int = 64 * 2**10
    max_concurrency: int = 8
    isolate_network: bool = True
    visible_paths: tuple[str, ...] = ()
    allow_site_packages: bool = False
    allow_exec: bool = False
    allow_unisolated: bool = False

    def __post_init__(self):
        for name in ("wall_timeout_s", "cpu_seconds", "memory_bytes", "max_processes", "max_file_bytes",
                     "tmpfs_bytes", "max_open_files", "output_limit_bytes", "max_concurrency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if isinstance(self.visible_paths, str) or not all(os.path.isabs(p) for p in self.visible_paths):
            raise ValueError(f"SandboxConfig.visible_paths must be a tuple of absolute paths, "
                             f"got {self.visible_paths!r}")


@dataclasses.dataclass(frozen=True)
class SandboxCapabilities:
    """Which isolation layers this machine grants (see module docstring)."""

    separate_uid: bool
    network_namespace: bool
    mount_namespace: bool
    pid_namespace: bool
    ipc_namespace: bool = False
    uts_namespace: bool = False
    seccomp: bool = False
    # How the memory cap holds for a whole call: "cgroup2" / "cgroup1" (a memory cgroup per call),
    # or "rlimit-split" (no cgroup here: per-process RLIMIT_AS x a lowered process cap).
    memory_cap: str = "rlimit-split"

    def missing(self, isolate_network: bool = True) -> list[str]:
        """Names of the layers a full jail needs but this machine refused."""
        need = [("separate_uid (root)", self.separate_uid), ("mount namespace", self.mount_namespace),
                ("pid namespace", self.pid_namespace), ("IPC namespace", self.ipc_namespace),
                ("UTS namespace", self.uts_namespace), ("seccomp", self.seccomp)]
        if isolate_network:
            need.append(("network namespace", self.network_namespace))
        return [name for name, ok in need if not ok]


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one call. `exec_s` is the code's own run time (fork to exit, measured inside, with
    the fresh interpreter's ~10 ms start); `wall_s` runs from getting a concurrency slot to the end;
    `queued_s` is the wait for the slot."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    output_truncated: bool
    setup_error: str | None
    wall_s: float
    exec_s: float | None
    peak_rss_kb: int | None = None  # largest resident set of the code's processes
    queued_s: float = 0.0
    # The call's memory cgroup: its cap was hit and the kernel OOM-killed one of its processes
    # (cgroup v2: all of them), and the most memory the call held at once (None without one).
    memory_limit_hit: bool = False
    peak_memory_bytes: int | None = None

    @property
    def ok(self) -> bool:
        failed = self.timed_out or self.output_truncated or self.setup_error or self.memory_limit_hit
        return self.exit_code == 0 and not failed

    def error_summary(self) -> str | None:
        """One line saying why the call failed, or None if it succeeded."""
        if self.setup_error:
            return f"sandbox setup failed: {self.setup_error}"
        if self.timed_out:
            return "timed out (wall-clock limit), process group killed"
        if self.output_truncated:
            return "output limit exceeded, process killed"
        if self.memory_limit_hit:
            return "killed by the memory limit (all of the call's processes together): out of memory"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.valid_signals() else str(self.signal)
            hint = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed: CPU or memory limit)"}.get(name, "")
            return f"killed by {name}{hint}"
        if self.exit_code != 0:
            return f"exit code {self.exit_code}"
        return None


def _rlimit_split(cfg: SandboxConfig) -> tuple[int, int]:
    """(processes, address space each) whose product stays within `cfg.memory_bytes`."""
    processes = max(1, min(cfg.max_processes, cfg.memory_bytes // _SPLIT_MIN_PROCESS_BYTES))
    return processes, cfg.memory_bytes // processes


def _launcher_config(cfg: SandboxConfig, plan: dict, uid: int | None, workdir: str, seccomp: bytes | None,
                     net_ns: bool, mount_ns: bool, pid_ns: bool, ipc_ns: bool, uts_ns: bool,
                     split: bool = False) -> dict:
    nproc, as_bytes = _rlimit_split(cfg) if split else (cfg.max_processes, cfg.memory_bytes)
    return {
        "uid": uid, "gid": uid, "net_ns": net_ns, "mount_ns": mount_ns, "pid_ns": pid_ns, "ipc_ns": ipc_ns,
        "uts_ns": uts_ns, "tmpfs_bytes": cfg.tmpfs_bytes, "workdir": workdir, "cpu_s": cfg.cpu_seconds,
        "as_bytes": as_bytes, "nproc": nproc, "fsize_bytes": cfg.max_file_bytes,
        "nofile": cfg.max_open_files, "seccomp": seccomp.hex() if seccomp else None, **plan,
    }


# The base interpreter's real path, never a virtualenv's `bin/python` (a venv may live in or beside
# the project, so its path names the project); the launcher imports the stdlib only, which both
# share. The source goes in as `-c`: no argv of the jail names where the project lives.
_PYTHON = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
_LAUNCHER_ARGV = [_PYTHON, "-I", "-S", "-c", Path(_LAUNCHER).read_text()]


def _launcher_input(launcher_cfg: dict, status_fd: int, code: str) -> bytes:
    # Config on stdin, not argv: argv stays on the code's stack and in its /proc/self/cmdline, and
    # the config names host paths. Lone surrogates pass through (compile() then reports them).
    header = json.dumps({**launcher_cfg, "status_fd": status_fd}).encode()
    return header + b"\n" + code.encode("utf-8", "surrogatepass")


def _launch_sync(cfg: dict, code: str, timeout: float, memory_bytes: int | None = None) -> int:
    """The launcher's exit code (the probe's launches); in a memory cgroup if `memory_bytes`."""
    read_fd, write_fd = os.pipe()
    cgroups = _memory_cgroups() if memory_bytes else None
    cgroup = None
    try:
        cgroup = cgroups.create(memory_bytes) if cgroups else None
        with subprocess.Popen(_LAUNCHER_ARGV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              pass_fds=[write_fd], start_new_session=True, env=_LAUNCHER_ENV) as proc:
            try:
                if cgroup is not None:
                    cgroup.add(proc.pid)  # before the config: nothing has forked yet
                proc.communicate(_launcher_input(cfg, write_fd, code), timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return -1
            return proc.returncode
    except OSError:
        return -1
    finally:
        os.close(write_fd)
        os.close(read_fd)
        if cgroup is not None:
            cgroup.remove()


def _seccomp_filter(sysv_ipc: bool, allow_exec: bool = False) -> bytes | None:
    try:
        return sandbox_seccomp.build_filter(sysv_ipc, allow_exec=allow_exec)
    except RuntimeError:  # unsupported architecture: reported as a missing layer
        return None


_CAPABILITIES: dict[int, SandboxCapabilities] = {}  # per effective uid: the answer depends on it
_CGROUPS: dict[int, sandbox_cgroup.MemoryCgroups | None] = {}


def _memory_cgroups(refresh: bool = False) -> sandbox_cgroup.MemoryCgroups | None:
    """Where per-call memory cgroups can be made (`sandbox_cgroup.find`), once per effective uid."""
    euid = os.geteuid()
    if refresh or euid not in _CGROUPS:
        _CGROUPS[euid] = sandbox_cgroup.find()
    return _CGROUPS[euid]


def probe_capabilities(refresh: bool = False) -> SandboxCapabilities:
    """Try the isolation layers with a trivial program; cached per effective uid.

    The full jail is tried first (one launch, in a per-call memory cgroup where one can be made);
    only if it fails is each layer tried alone. A separate uid is only tried when running as root.

    Args:
      refresh: probe again (the memory-cgroup lookup too) instead of returning the cached result.
    Returns:
      The `SandboxCapabilities` this machine grants: one flag per isolation layer, and how the
      memory cap holds (`memory_cap`: 'cgroup2' / 'cgroup1', or 'rlimit-split').
    """
    euid = os.geteuid()
    if refresh or euid not in _CAPABILITIES:
        cgroups = _memory_cgroups(refresh)
        memory_cap = f"cgroup{cgroups.version}" if cgroups else "rlimit-split"
        base = SandboxConfig()
        plan = _jail_plan(base)
        uid = random.randint(10**6, 2 * 10**9) if euid == 0 else None
        with tempfile.TemporaryDirectory(prefix="sfrrl_probe_") as workdir:
            os.chmod(workdir, 0o777)

            def works(code="pass", seccomp=None, cgroup=False, **layers) -> bool:
                flags = {"net_ns": False, "mount_ns": False, "pid_ns": False, "ipc_ns": False, "uts_ns": False,
                         **layers}
                launcher_cfg = _launcher_config(base, plan, uid, workdir, seccomp, **flags)
                return _launch_sync(launcher_cfg, code, 10, base.memory_bytes if cgroup else None) == 0

            full = _seccomp_filter(sysv_ipc=True)
            if uid is not None and full is not None and works(
                    "import fractions", seccomp=full, cgroup=cgroups is not None, net_ns=True, mount_ns=True,
                    pid_ns=True, ipc_ns=True, uts_ns=True):
                caps = SandboxCapabilities(True, True, True, True, True, True, True, memory_cap)
            else:
                if uid is not None and not works():
                    uid = None  # cannot drop to an arbitrary uid (e.g. a user namespace without a mapping)
                filt = _seccomp_filter(sysv_ipc=False)
                caps = SandboxCapabilities(
                    separate_uid=uid is not None, network_namespace=works(net_ns=True),
                    mount_namespace=works("import fractions", mount_ns=True), pid_namespace=works(pid_ns=True),
                    ipc_namespace=works(ipc_ns=True), uts_namespace=works(uts_ns=True),
                    seccomp=filt is not None and works(seccomp=filt),
                    memory_cap=memory_cap if cgroups and works(cgroup=True) else "rlimit-split")
        _CAPABILITIES[euid] = caps
    return _CAPABILITIES[euid]


def _kill_processes_of_uid(uid: int) -> None:
    """Fallback sweep without a pid namespace: SIGKILL every process owned by `uid`, until none."""
    for _ in range(50):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    owner = next(line for line in f if line.startswith("Uid:")).split()[1]
                if int(owner) == uid:
                    found = True
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, StopIteration, ValueError):
                continue
        if not found:
            return
        time.sleep(0.01)


class PythonSandbox:
    """Runs Python source in a fresh jailed process per call; `await sandbox.run(code)`.

    At most `cfg.max_concurrency` calls run at once (others wait their turn; the wait does not
    count against the call's timeout); each concurrent slot owns one uid from this sandbox's random
    uid range, so per-uid limits are per call.
    """

    def __init__(self, cfg: SandboxConfig = SandboxConfig()):
        self.cfg = cfg
        self.capabilities = probe_capabilities()
        caps = self.capabilities
        if os.geteuid() == 0 and not caps.separate_uid:
            # Root ignores RLIMIT_NPROC, and root code can undo any jail: no opt-in for this.
            raise RuntimeError("PythonSandbox: running as root but cannot switch to an unprivileged uid; "
                               "refusing to run untrusted code as root")
        missing = caps.missing(cfg.isolate_network)
        self.unisolated = bool(missing)
        if missing:
            why = "not running as root" if os.geteuid() != 0 else "the kernel refused them"
            message = (f"PythonSandbox cannot build its jail on this machine: missing {', '.join(missing)} "
                       f"({why}).")
            if not cfg.allow_unisolated:
                raise RuntimeError(message + " Untrusted code would run with the trainer's own privileges "
                                   "(host files, processes, network, SysV IPC). Run the trainer as root on a "
                                   "kernel that allows namespaces, or pass SandboxConfig(allow_unisolated=True) "
                                   "to run anyway.")
            loud = ("UNISOLATED SANDBOX: " + message + " allow_unisolated=True was given, so untrusted code "
                    "runs WITHOUT these protections.")
            warnings.warn(loud, RuntimeWarning, stacklevel=2)
            logger.warning(loud)
        ipc_ns = caps.ipc_namespace
        self._seccomp = _seccomp_filter(sysv_ipc=ipc_ns, allow_exec=cfg.allow_exec) if caps.seccomp else None
        self._layers = {"net_ns": caps.network_namespace and cfg.isolate_network, "mount_ns": caps.mount_namespace,
                        "pid_ns": caps.pid_namespace, "ipc_ns": ipc_ns, "uts_ns": caps.uts_namespace}
        for path in cfg.visible_paths:
            if not os.path.isdir(path):
                raise ValueError(f"SandboxConfig.visible_paths: {path!r} is not an existing directory")
        self._plan = _jail_plan(cfg)
        self._cgroups = _memory_cgroups() if caps.memory_cap.startswith("cgroup") else None
        if self._cgroups is not None:
            self.memory_cap = f"cgroup{self._cgroups.version}: {cfg.memory_bytes // _MiB} MiB per call, all processes"
        else:
            processes, each = _rlimit_split(cfg)
            self.memory_cap = f"rlimit-split: {processes} processes x {each // _MiB} MiB"
        self._slots: asyncio.Queue[int | None] | None = None
        base = random.randint(10**6, 2 * 10**9)
        self._uids = [base + i if caps.separate_uid else None for i in range(cfg.max_concurrency)]

    def __reduce__(self):
        # Pickles as its config: a copy (a Ray tool actor's) probes and jails on its own host.
        return (type(self), (self.cfg,))

    def _slot_queue(self) -> asyncio.Queue:
        # Created lazily so the queue binds to the running event loop.
        if self._slots is None:
            self._slots = asyncio.Queue()
            for uid in self._uids:
                self._slots.put_nowait(uid)
        return self._slots

    async def run(self, code: str, wall_timeout_s: float | None = None,
                  on_slot: Callable[[], None] | None = None) -> SandboxResult:
        """Run `code`; never raises for anything the code does (all of it lands in the result).

        The wall-clock timeout starts once the call holds a concurrency slot. `on_slot` is called
        at that moment, so a caller with its own deadline can start it there too (the queue wait
        is load, not the code's fault).
        """
        slots = self._slot_queue()
        queued = time.perf_counter()
        uid = await slots.get()
        queued_s = time.perf_counter() - queued
        try:
            if on_slot is not None:
                on_slot()
            result = await self._run_in_slot(code, uid, wall_timeout_s or self.cfg.wall_timeout_s)
        finally:
            slots.put_nowait(uid)
        return dataclasses.replace(result, queued_s=queued_s)

    async def _run_in_slot(self, code: str, uid: int | None, timeout: float) -> SandboxResult:
        cfg = self.cfg
        start = time.perf_counter()
        cgroup = None
        if self._cgroups is not None:
            try:
                cgroup = self._cgroups.create(cfg.memory_bytes)
            except OSError as e:  # never run without the cap this sandbox promised
                return SandboxResult("", "", None, None, False, False, f"sandbox setup failed: memory cgroup: {e}",
                                     time.perf_counter() - start, None)
        workdir = None
        if not self._layers["mount_ns"]:
            workdir = tempfile.mkdtemp(prefix="sfrrl_sbx_")
            if uid is not None:
                os.chown(workdir, uid, uid)
        launcher_cfg = _launcher_config(cfg, self._plan, uid, workdir or "/tmp", self._seccomp, **self._layers,
                                        split=self._cgroups is None)
        read_fd, write_fd = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *_LAUNCHER_ARGV, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, pass_fds=[write_fd],
                start_new_session=True, env=_LAUNCHER_ENV)
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            if cgroup is not None:
                await cgroup.remove_async()
            raise
        os.close(write_fd)
        outcome = {"timed_out": False, "truncated": False, "setup_error": None}

        def kill_group():
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        async def pump(stream: asyncio.StreamReader, sink: bytearray):
            while chunk := await stream.read(65536):
                room = cfg.output_limit_bytes - len(sink)
                sink += chunk[:max(room, 0)]
                if len(chunk) > room:
                    outcome["truncated"] = True
                    kill_group()
                    # Keep draining so the pipe never blocks a dying writer.

        stdout, stderr = bytearray(), bytearray()

        async def feed_and_wait():
            if cgroup is not None:
                try:
                    cgroup.add(proc.pid)  # before the config: the launcher has forked nothing yet
                except OSError as e:
                    outcome["setup_error"] = f"sandbox setup failed: memory cgroup: {e}"
                    kill_group()
            try:
                if outcome["setup_error"] is None:
                    proc.stdin.write(_launcher_input(launcher_cfg, write_fd, code))
                    await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass
            await asyncio.gather(pump(proc.stdout, stdout), pump(proc.stderr, stderr))
            await proc.wait()

        try:
            await asyncio.wait_for(feed_and_wait(), timeout)
        except asyncio.TimeoutError:
            outcome["timed_out"] = True
            kill_group()
            await proc.wait()
        except BaseException:
            kill_group()  # cancelled: still never leave the jail running
            await proc.wait()
            raise
        finally:
            status = _read_status(read_fd)
            if uid is not None and not self._layers["pid_ns"]:
                _kill_processes_of_uid(uid)
            if workdir is not None:
                subprocess.run(["rm", "-rf", workdir], check=False)
            memory_limit_hit, peak_memory = False, None
            if cgroup is not None:
                memory_limit_hit, peak_memory = cgroup.oom_kills() > 0, cgroup.peak_bytes()
                await cgroup.remove_async()
        wall = time.perf_counter() - start
        setup_error = outcome["setup_error"]
        if proc.returncode == SETUP_FAILED and stderr.startswith(b"sandbox setup failed:"):
            setup_error = stderr.decode(errors="replace").strip()
        exit_code, sig = status.get("exit_code"), status.get("signal")
        if not status:  # the launcher itself was killed (timeout / output cap) before init reported
            exit_code, sig = (None, -proc.returncode) if proc.returncode < 0 else (proc.returncode, None)
        return SandboxResult(
            stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"),
            exit_code=exit_code, signal=sig, timed_out=outcome["timed_out"],
            output_truncated=outcome["truncated"], setup_error=setup_error, wall_s=wall,
            exec_s=status.get("exec_s"), peak_rss_kb=status.get("peak_rss_kb"),
            memory_limit_hit=memory_limit_hit, peak_memory_bytes=peak_memory)


def _read_status(read_fd: int) -> dict:
    try:
        os.set_blocking(read_fd, False)
        data = os.read(read_fd, 65536)
    except BlockingIOError:
        data = b""
    finally:
        os.close(read_fd)
    try:
        return json.loads(data) if data else {}
    except json.JSONDecodeError:
        return {}
