"""reasoning-gym's scorers in forked children that may only compute: the child program of
`isolated.ReasoningGymScorer` (run as a script; it imports nothing from `sfrrl_jax`, and loads the
stdlib-only `agents/sandbox/launcher.py` by path for its `_lock_down`).

Some scorers eval the model's answer (countdown: `sympy.parse_expr`, which runs Python), so an
answer `__import__('os').system(...)` ran in the trainer, and `9**9**9**9` froze it. This process
imports reasoning-gym once, then forks one child per answer. The child, before it reads the
answer: stdin, stdout and stderr are /dev/null, every other descriptor but its result pipe is
closed, rlimits cap its memory, CPU seconds and file size (0: no file can grow), then the sandbox
launcher's `_lock_down` sets no_new_privs and installs a seccomp filter
(`sandbox.seccomp.build_compute_filter`, sent by the parent) that denies exec, fork,
threads, sockets, signals to other processes and every change to a file. A fresh fork per answer:
whatever an answer's code changes in its child's memory (the scorer itself) is gone with it. The
child past `timeout_s` is killed; no result, a result outside [0, 1] or a scorer that raised
scores 0.0.

Protocol (lines on stdin / stdout): first the config, JSON `{"filter": hex, "memory_bytes": int,
"cpu_seconds": int, "timeout_s": float}`; this process answers `ready` (or `E <why>`: reasoning-gym
missing, or the lock-down failed in a probe child). Then per request one line of base64 pickle
`(dataset, answer, entry)` from the parent (trusted), one line back: the score as JSON.
"""
import base64
import importlib.util
import json
import math
import os
import pickle
import resource
import select
import signal
import sys
import time
from pathlib import Path


def _launcher():
    """The sandbox's launcher module (`agents/sandbox/launcher.py`, stdlib-only like this file),
    loaded by path: its `_lock_down(seccomp_hex)` sets no_new_privs and installs the filter (on a
    failure it exits the process, and the fork then has no result)."""
    path = Path(__file__).resolve().parents[1] / "sandbox" / "launcher.py"   # this file: agents/tasks/
    spec = importlib.util.spec_from_file_location("sfrrl_sandbox_launcher", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_install_filter = _launcher()._lock_down   # loaded once here, before any fork reads an answer


def _lock_down(cfg: dict, result_fd: int) -> None:
    """The child's confinement, in this order (the filter last: it denies what the rest needs)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    # stderr too: where it is a file (a redirected log), RLIMIT_FSIZE 0 would kill the child with
    # SIGXFSZ at the scorer's first warning, scoring a right answer 0
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    keep = {0, 1, 2, result_fd}
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:   # the listing's own descriptor, already closed
                pass
    with open("/proc/self/statm") as f:
        in_use = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    for which, value in ((resource.RLIMIT_AS, in_use + cfg["memory_bytes"]),
                         (resource.RLIMIT_CPU, cfg["cpu_seconds"]), (resource.RLIMIT_FSIZE, 0),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))
    _install_filter(cfg["filter"])


def _in_child(cfg: dict, work, read_fd: int, result_fd: int):
    """Runs `work()` (-> JSON-able) in a locked-down fork; returns what it wrote, or None (killed
    past the timeout, died, or wrote nothing)."""
    pid = os.fork()
    if pid == 0:   # the child: never returns
        out = b"null"
        try:
            os.close(read_fd)
            _lock_down(cfg, result_fd)
            out = json.dumps(work()).encode()
        except BaseException as e:   # noqa: BLE001 - an answer may raise anything; it scores 0
            out = json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}).encode()
        finally:
            try:
                os.write(result_fd, out)
            finally:
                os._exit(0)
    os.close(result_fd)
    received, deadline = b"", time.monotonic() + cfg["timeout_s"]
    try:
        while len(received) <= 1 << 16:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                received = b""   # past its time: no result, whatever it wrote so far
                break
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:   # it wrote its result and exited
                break
            received += chunk
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)   # done or not: it must not outlive its answer
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    try:
        return json.loads(received) if received else None
    except ValueError:   # over 64 KiB, or not JSON
        return None


def _score(value) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1:
        return float(value)
    return 0.0


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    try:
        import reasoning_gym
    except ImportError as e:
        print(f"E {e}", flush=True)
        return
    read_fd, result_fd = os.pipe()
    probe = _in_child(cfg, lambda: "confined", read_fd, result_fd)
    if probe != "confined":
        why = probe if probe is not None else "it exited in its lock-down (rlimits, no_new_privs or seccomp refused)"
        print(f"E the scoring child could not be confined: {why}", flush=True)
        return
    print("ready", flush=True)
    scorers = {}
    for line in sys.stdin:
        dataset, answer, entry = pickle.loads(base64.b64decode(line))
        if dataset not in scorers:
            scorers[dataset] = reasoning_gym.get_score_answer_fn(dataset)
        fn = scorers[dataset]
        read_fd, result_fd = os.pipe()
        print(json.dumps(_score(_in_child(cfg, lambda: fn(answer, entry), read_fd, result_fd))), flush=True)


if __name__ == "__main__":
    main()
