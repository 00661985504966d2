"""Sandboxed Python: one fresh, jailed process per call (see `sandbox_launcher.py` for the jail).

What is enforced (probed once per host process by `probe_capabilities`; `PythonSandbox.capabilities`
says what this machine allows):

* always: a separate process per call in its own process group, killed as a group on the wall-clock
  timeout; rlimits on CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size
  (RLIMIT_FSIZE), open files and processes (RLIMIT_NPROC); stdout/stderr capped (the process is
  killed once it writes more); an empty environment; stdin is /dev/null.
* as root: the code runs under a fresh unprivileged uid per concurrent call (drawn from a random
  range per sandbox), because root ignores RLIMIT_NPROC and because a per-call uid makes the
  process cap per call: a fork bomb in one call cannot starve another call's fork.
* network namespace (CLONE_NEWNET): no interface but a down loopback; every connect fails.
* mount namespace (CLONE_NEWNS): every mount is remounted read-only; /tmp (the cwd), /var/tmp,
  /dev/shm and /run/lock are private size-capped tmpfs mounts that vanish with the call.
* pid namespace (CLONE_NEWPID): when the code's main process ends, the kernel kills everything it
  spawned, including processes that called setsid() to leave the process group.

Where a namespace is refused (no CAP_SYS_ADMIN, seccomp), that layer is simply absent: without
the mount namespace the cwd is a host temp dir and the filesystem is protected only by the uid's
permissions (and not at all if we are not root); without the pid namespace, escaped processes are
swept by uid (as root) or survive (otherwise); without the network namespace there is no network
isolation. Not enforced anywhere: host /proc is readable (read-only), CPU time is per process
(the wall timeout bounds a fork bomb's total), and only stdlib is importable (no site-packages).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LAUNCHER = str(Path(__file__).with_name("sandbox_launcher.py"))
SETUP_FAILED = 121


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed call. Sizes in bytes, times in seconds."""

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

    def __post_init__(self):
        for name in ("wall_timeout_s", "cpu_seconds", "memory_bytes", "max_processes", "max_file_bytes",
                     "tmpfs_bytes", "max_open_files", "output_limit_bytes", "max_concurrency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxCapabilities:
    """Which isolation layers this machine grants (see module docstring)."""

    separate_uid: bool
    network_namespace: bool
    mount_namespace: bool
    pid_namespace: bool


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one call. `exec_s` is the code's own run time (fork to exit, measured inside)."""

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

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.output_truncated or self.setup_error)

    def error_summary(self) -> str | None:
        """One line saying why the call failed, or None if it succeeded."""
        if self.setup_error:
            return f"sandbox setup failed: {self.setup_error}"
        if self.timed_out:
            return "timed out (wall-clock limit), process group killed"
        if self.output_truncated:
            return "output limit exceeded, process killed"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.valid_signals() else str(self.signal)
            hint = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed: CPU or memory limit)"}.get(name, "")
            return f"killed by {name}{hint}"
        if self.exit_code != 0:
            return f"exit code {self.exit_code}"
        return None


_CAPABILITIES: SandboxCapabilities | None = None


def _launch_sync(cfg: dict, code: str, timeout: float) -> int:
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", _LAUNCHER, json.dumps({**cfg, "status_fd": write_fd})],
            input=code.encode(), capture_output=True, pass_fds=[write_fd], timeout=timeout,
            start_new_session=True, check=False)
        return proc.returncode
    finally:
        os.close(write_fd)
        os.close(read_fd)


def _launcher_config(cfg: SandboxConfig, uid: int | None, net_ns: bool, mount_ns: bool, pid_ns: bool,
                     workdir: str) -> dict:
    return {
        "uid": uid, "gid": uid, "net_ns": net_ns, "mount_ns": mount_ns, "pid_ns": pid_ns,
        "tmpfs_bytes": cfg.tmpfs_bytes, "workdir": workdir, "cpu_s": cfg.cpu_seconds,
        "as_bytes": cfg.memory_bytes, "nproc": cfg.max_processes, "fsize_bytes": cfg.max_file_bytes,
        "nofile": cfg.max_open_files,
    }


def probe_capabilities() -> SandboxCapabilities:
    """Try each isolation layer once with a trivial program; cached for the process."""
    global _CAPABILITIES
    if _CAPABILITIES is None:
        base = SandboxConfig()
        uid = random.randint(10**6, 2 * 10**9) if os.geteuid() == 0 else None
        with tempfile.TemporaryDirectory(prefix="sfrrl_probe_") as workdir:
            os.chmod(workdir, 0o777)

            def works(code="pass", **layers) -> bool:
                flags = {"net_ns": False, "mount_ns": False, "pid_ns": False, **layers}
                return _launch_sync(_launcher_config(base, uid, workdir=workdir, **flags), code, 10) == 0

            if uid is not None and not works():
                uid = None  # cannot drop to an arbitrary uid (e.g. a user namespace without a mapping)
            _CAPABILITIES = SandboxCapabilities(
                separate_uid=uid is not None, network_namespace=works(net_ns=True),
                mount_namespace=works("import fractions", mount_ns=True), pid_namespace=works(pid_ns=True))
    return _CAPABILITIES


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

    At most `cfg.max_concurrency` calls run at once (others wait their turn); each concurrent slot
    owns one uid from this sandbox's random uid range, so per-uid limits are per call.
    """

    def __init__(self, cfg: SandboxConfig = SandboxConfig()):
        self.cfg = cfg
        self.capabilities = probe_capabilities()
        if os.geteuid() == 0 and not self.capabilities.separate_uid:
            # Root ignores RLIMIT_NPROC: without another uid a fork bomb would be unbounded.
            raise RuntimeError("PythonSandbox: running as root but cannot switch to an unprivileged uid; "
                               "refusing to run untrusted code without a process limit")
        self._slots: asyncio.Queue[int | None] | None = None
        base = random.randint(10**6, 2 * 10**9)
        self._uids = [base + i if self.capabilities.separate_uid else None for i in range(cfg.max_concurrency)]

    def _slot_queue(self) -> asyncio.Queue:
        # Created lazily so the queue binds to the running event loop.
        if self._slots is None:
            self._slots = asyncio.Queue()
            for uid in self._uids:
                self._slots.put_nowait(uid)
        return self._slots

    async def run(self, code: str, wall_timeout_s: float | None = None) -> SandboxResult:
        """Run `code`; never raises for anything the code does (all of it lands in the result)."""
        slots = self._slot_queue()
        uid = await slots.get()
        try:
            return await self._run_in_slot(code, uid, wall_timeout_s or self.cfg.wall_timeout_s)
        finally:
            slots.put_nowait(uid)

    async def _run_in_slot(self, code: str, uid: int | None, timeout: float) -> SandboxResult:
        caps, cfg = self.capabilities, self.cfg
        workdir = None
        if not caps.mount_namespace:
            workdir = tempfile.mkdtemp(prefix="sfrrl_sbx_")
            if uid is not None:
                os.chown(workdir, uid, uid)
        launcher_cfg = _launcher_config(
            cfg, uid, net_ns=caps.network_namespace and cfg.isolate_network, mount_ns=caps.mount_namespace,
            pid_ns=caps.pid_namespace, workdir=workdir or "/tmp")
        read_fd, write_fd = os.pipe()
        start = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", _LAUNCHER, json.dumps({**launcher_cfg, "status_fd": write_fd}),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=[write_fd], start_new_session=True)
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        os.close(write_fd)
        outcome = {"timed_out": False, "truncated": False}

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
            try:
                proc.stdin.write(code.encode())
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
            if uid is not None and not caps.pid_namespace:
                _kill_processes_of_uid(uid)
            if workdir is not None:
                subprocess.run(["rm", "-rf", workdir], check=False)
        wall = time.perf_counter() - start
        setup_error = None
        if proc.returncode == SETUP_FAILED and stderr.startswith(b"sandbox setup failed:"):
            setup_error = stderr.decode(errors="replace").strip()
        exit_code, sig = status.get("exit_code"), status.get("signal")
        if not status:  # the launcher itself was killed (timeout / output cap) before init reported
            exit_code, sig = (None, -proc.returncode) if proc.returncode < 0 else (proc.returncode, None)
        return SandboxResult(
            stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"),
            exit_code=exit_code, signal=sig, timed_out=outcome["timed_out"],
            output_truncated=outcome["truncated"], setup_error=setup_error, wall_s=wall,
            exec_s=status.get("exec_s"), peak_rss_kb=status.get("peak_rss_kb"))


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
