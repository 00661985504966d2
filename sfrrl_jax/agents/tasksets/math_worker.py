"""math-verify in a child process with a hard time and memory limit: a model's answer is hostile input.

An answer such as `2^{2^{2^{2^{20}}}}` makes sympy build an integer no memory holds. math-verify's
own timeouts are `signal.alarm`, which fires only on the main thread, so off it (a notebook runs the
trainer's event loop in a worker thread, `aio.run_sync`) that answer held the GIL and froze the
whole process for good; on the main thread it stalled the event loop (every rollout) until the
alarm. Here the comparison runs in a separate Python process (`MathVerifierProcess`), on that
process's main thread (so math-verify's alarms work there too) under an address-space limit; the
parent waits at most `timeout_s` plus a margin, then kills the process and scores the answer as
not equal, and the next call starts a fresh one.

The child is this file run as a script (`python -P math_worker.py`): it imports math-verify only,
not this package (no jax), and starts in about a second. Protocol: one JSON line per request,
`[prediction, answer, boxed, timeout_s]`, one line back: `1`, `0` or `N` (the gold answer is not
math). The first line the child writes is `ready`, or `E <message>` when math-verify is missing.

This file is the child's whole program: it imports nothing from `sfrrl_jax`.
"""
from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from decimal import Decimal
from functools import lru_cache

VERIFY_TIMEOUT_S = 5.0        # math-verify's own parse and verify timeouts in the child (default)
KILL_MARGIN_S = 5.0           # the parent kills the child this long after VERIFY_TIMEOUT_S
START_TIMEOUT_S = 120.0       # importing sympy on a loaded 2-core machine
MEMORY_LIMIT_BYTES = 4 << 30  # the child's address space: a runaway integer ends as MemoryError
INSTALL_HINT = "pip install 'sfrrl_jax[tasks]' (or: pip install math-verify)"
_LATEX = re.compile(r"[\\^_{}]")


# -- the child ---------------------------------------------------------------------------------
# A number in E notation, not inside a word or a longer number: math-verify reads a predicted
# '6.02e23' as 6.02 (so '1e20' equalled 1) and a gold one, as LaTeX, as 6.02 * e * 23 (Euler's e:
# it matched nothing, itself included).
_E_NUMBER = re.compile(r"(?<![\w.])(\d+\.?\d*|\.\d+)[eE]([+-]?\d+)(?!\w|\.\d)")
MAX_EXPANDED_EXPONENT = 40   # beyond: written as m \times 10^{n}, not as that many digits


def expand_e_notation(text: str) -> str:
    """`text` with each E-notation number written out: '6.02e23' -> '602000000000000000000000',
    '1e-3' -> '0.001', '2.5E3' -> '2500'; an exponent past +-MAX_EXPANDED_EXPONENT as LaTeX
    ('1e999' -> '1 \\times 10^{999}')."""
    def expand(m):
        mantissa, exponent = m.group(1), int(m.group(2))
        if abs(exponent) > MAX_EXPANDED_EXPONENT:
            return f"{mantissa} \\times 10^{{{exponent}}}"
        digits = format(Decimal(mantissa).scaleb(exponent), "f")
        return digits.rstrip("0").rstrip(".") if "." in digits else digits
    return _E_NUMBER.sub(expand, text)


@lru_cache(maxsize=4096)
def _parse_gold(mv, answer: str, timeout):
    text = answer.strip()
    if not ("\\boxed" in text or text.startswith("$")):
        text = "\\boxed{" + text + "}"
    return mv.parse(text, extraction_config=[mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
                    parsing_timeout=timeout)


def equal_here(mv, prediction: str, answer: str, boxed: bool, timeout=VERIFY_TIMEOUT_S):
    """math-verify's verdict in this process: True / False, or None when the gold answer does not
    parse as math (the caller compares the texts). timeout: math-verify's (main thread only)."""
    gold = _parse_gold(mv, expand_e_notation(answer), timeout)
    if not gold:
        return None
    prediction = expand_e_notation(prediction)
    if boxed and _LATEX.search(prediction) and "\\boxed" not in prediction and "$" not in prediction.replace("\\$", ""):
        prediction = "\\boxed{" + prediction + "}"  # a bare LaTeX answer, e.g. 1 + x^2: read it whole
    pred = mv.parse(prediction, parsing_timeout=timeout)
    return bool(pred) and bool(mv.verify(gold, pred, timeout_seconds=timeout))


def _serve() -> None:
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):  # no such limit here: the parent's kill still bounds time
        pass
    try:
        import math_verify as mv
    except ImportError as e:
        print(f"E {e}", flush=True)
        return
    print("ready", flush=True)
    for line in sys.stdin:
        prediction, answer, boxed, timeout = json.loads(line)
        timeout = max(1, math.ceil(timeout))   # signal.alarm's whole seconds
        try:
            verdict = equal_here(mv, prediction, answer, boxed, timeout)
        except Exception:   # MemoryError, RecursionError, sympy's own: the answer is not equal
            verdict = False
        print("N" if verdict is None else int(verdict), flush=True)


# -- the parent --------------------------------------------------------------------------------
class MathVerifierProcess:
    """`equal(prediction, answer, boxed)` -> True / False / None (None: the gold answer is not
    math), computed in a child process that is killed when it runs past timeout_s + KILL_MARGIN_S
    (the verdict is then False). Thread-safe (one request at a time); a forked copy of the owner
    starts its own child."""

    def __init__(self, timeout_s: float = VERIFY_TIMEOUT_S):
        self.timeout_s = float(timeout_s)
        self.kills = 0          # children killed for running too long (or dying)
        self._lock = threading.Lock()
        self._proc = None
        self._pid = None

    def equal(self, prediction: str, answer: str, boxed: bool):
        request = json.dumps([prediction, answer, bool(boxed), self.timeout_s]) + "\n"
        with self._lock:
            proc = self._child()
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                reply = self._read(proc, self.timeout_s + KILL_MARGIN_S)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:   # ran too long, or died (out of memory): not equal, and a fresh child next
                self._kill()
                return False
        return None if reply == "N" else reply == "1"

    def close(self) -> None:
        with self._lock:
            self._kill(count=False)

    def _child(self):
        if self._proc is not None and self._pid == os.getpid() and self._proc.poll() is None:
            return self._proc
        self._proc, self._pid = None, os.getpid()
        proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        first = self._read(proc, START_TIMEOUT_S)
        if first != "ready":
            proc.kill()
            proc.wait()
            if first is not None and first.startswith("E "):
                raise ImportError(f"the 'math' task kind needs math-verify ({first[2:]}): {INSTALL_HINT}")
            raise RuntimeError(f"the math-verify worker did not start within {START_TIMEOUT_S:.0f} s")
        self._proc = proc
        return proc

    @staticmethod
    def _read(proc, timeout: float):
        """The child's next line (stripped), or None if it wrote none within `timeout` s or exited."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                line = proc.stdout.readline()
                return line.strip() if line else None

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


if __name__ == "__main__":
    _serve()
