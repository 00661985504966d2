"""Reward scorers that read a model's text, run in child processes: a model's answer is hostile input.

* `MathVerifierProcess` (the 'math' kind): math-verify in a child (`math_worker.py`) with a memory
  limit, killed past its time. `2^{2^{2^{2^{20}}}}` is an integer no memory holds, and
  math-verify's timeouts are signal.alarm (main thread only): off the main thread (a notebook runs
  the loop in a worker thread) that answer froze the whole process.
* `ReasoningGymScorer` (the 'reasoning_gym' kind): some reasoning-gym scorers eval the answer
  (countdown's `sympy.parse_expr` runs Python: `__import__('os').system(...)` ran in the trainer).
  Each answer is scored in a fresh fork that may only compute (`rg_worker.py`: seccomp, rlimits).

Both are one child per process (started on first use, restarted after a kill; a forked copy of
the owner starts its own), one request at a time, lines over pipes. A request with no reply in
time kills the child; the answer scores as wrong (False / 0.0).
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from sfrrl_jax.agents.sandbox.seccomp import build_compute_filter

KILL_MARGIN_S = 5.0           # the parent kills the child this long after the child's own timeout
START_TIMEOUT_S = 120.0       # importing sympy / reasoning-gym on a loaded 2-core machine
_HERE = Path(__file__).resolve().parent


class ScriptWorker:
    """A child Python process running `script` (this package's file, run with `python -P`, so it
    imports nothing of ours), spoken to in lines. `hello`: a first line sent after start; the
    child's first line must be `ready` (`E <why>` raises `start_error(why)`)."""

    script: str = ""

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.kills = 0          # children killed for running too long (or found dead)
        self._lock = threading.Lock()
        self._proc = None
        self._pid = None

    def hello(self) -> str | None:
        return None

    def start_error(self, why: str) -> Exception:
        return RuntimeError(f"{type(self).__name__}: {why}")

    def request(self, line: str) -> str | None:
        """The child's reply to one line, or None (no reply within timeout_s + KILL_MARGIN_S, or the
        child died: it is killed, and the next request starts a fresh one)."""
        with self._lock:
            proc = self._child()
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
                reply = self._read(proc, self.timeout_s + KILL_MARGIN_S)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:
                self._kill()
            return reply

    def close(self) -> None:
        with self._lock:
            self._kill(count=False)

    def _child(self):
        if self._proc is not None and self._pid == os.getpid() and self._proc.poll() is None:
            return self._proc
        self._proc, self._pid = None, os.getpid()
        # one thread per math library: the rg worker forks, and a forked BLAS pool deadlocks
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-P", str(_HERE / self.script)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        hello = self.hello()
        if hello is not None:
            proc.stdin.write(hello + "\n")
            proc.stdin.flush()
        first = self._read(proc, START_TIMEOUT_S)
        if first != "ready":
            proc.kill()
            proc.wait()
            if first is not None and first.startswith("E "):
                raise self.start_error(first[2:])
            raise RuntimeError(f"{type(self).__name__}: its worker did not start within {START_TIMEOUT_S:.0f} s")
        self._proc = proc
        return proc

    @staticmethod
    def _read(proc, timeout: float):
        """The child's next line (stripped), or None if it wrote none within `timeout` s or exited."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if select.select([proc.stdout], [], [], left)[0]:
                line = proc.stdout.readline()
                return line.strip() if line else None
        return None

    def _kill(self, count: bool = True) -> None:
        proc, self._proc = self._proc, None
        if proc is None or self._pid != os.getpid():
            return
        self.kills += count
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class MathVerifierProcess(ScriptWorker):
    """`equal(prediction, answer, boxed)` -> True / False / None (None: the gold answer is not
    math): `math_worker.equal_here` in the child, math-verify's own timeouts set to timeout_s."""

    script = "math_worker.py"

    def __init__(self, timeout_s: float = 5.0):
        super().__init__(timeout_s)

    def start_error(self, why):
        return ImportError(f"the 'math' task kind needs math-verify ({why}): "
                           "pip install 'sfrrl_jax[tasks]' (or: pip install math-verify)")

    def equal(self, prediction: str, answer: str, boxed: bool):
        reply = self.request(json.dumps([prediction, answer, bool(boxed), self.timeout_s]))
        if reply is None:   # ran too long, or died (out of memory): not equal
            return False
        return None if reply == "N" else reply == "1"


class ReasoningGymScorer(ScriptWorker):
    """`score(dataset, answer, entry)` -> reasoning-gym's `score_answer(answer, entry)` for the
    dataset's generator, computed in a fresh confined fork per answer (`rg_worker.py`): 0.0 when
    it runs past timeout_s or its CPU seconds, outgrows memory_bytes, raises, or returns anything
    but a number in [0, 1]. The dataset name is the caller's to check."""

    script = "rg_worker.py"

    def __init__(self, timeout_s: float = 10.0, memory_bytes: int = 2 << 30, cpu_seconds: int = 10):
        super().__init__(timeout_s)
        self.memory_bytes, self.cpu_seconds = int(memory_bytes), int(cpu_seconds)

    def hello(self):
        return json.dumps({"filter": build_compute_filter().hex(), "memory_bytes": self.memory_bytes,
                           "cpu_seconds": self.cpu_seconds, "timeout_s": self.timeout_s})

    def start_error(self, why):
        if why.startswith("No module"):
            return ImportError(f"reasoning-gym tasks need the reasoning-gym package ({why}): "
                               "pip install 'sfrrl_jax[tasks]' (or: pip install reasoning-gym)")
        return RuntimeError(f"reasoning-gym answers are scored in a confined process, and here {why}")

    def score(self, dataset: str, answer: str, entry: dict) -> float:
        reply = self.request(base64.b64encode(pickle.dumps((dataset, answer, entry))).decode())
        return 0.0 if reply is None else float(json.loads(reply))
