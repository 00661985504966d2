"""math-verify in a child process with a hard time and memory limit: the child program of
`isolated.MathVerifierProcess` (run as a script; it imports math-verify, nothing of `sfrrl_jax`).

An answer such as `2^{2^{2^{2^{20}}}}` makes sympy build an integer no memory holds. math-verify's
own timeouts are `signal.alarm`, which fires only on the main thread, so off it (a notebook runs the
trainer's event loop in a worker thread, `aio.run_sync`) that answer held the GIL and froze the
whole process for good; on the main thread it stalled the event loop (every rollout) until the
alarm. Here the comparison runs on this process's main thread (math-verify's alarms work) under an
address-space limit; the parent kills this process when no reply comes within its timeout plus a
margin, scores the answer as not equal, and starts a fresh one for the next.

Protocol: one JSON line per request, `[prediction, answer, boxed, timeout_s]`, one line back: `1`,
`0` or `N` (the gold answer is not math). The first line written is `ready`, or `E <message>` when
math-verify is missing.
"""
from __future__ import annotations

import json
import math
import re
import sys
from decimal import Decimal
from functools import lru_cache

VERIFY_TIMEOUT_S = 5.0        # math-verify's parse and verify timeouts (the parent sends its own)
MEMORY_LIMIT_BYTES = 4 << 30  # this process's address space: a runaway integer ends as MemoryError
_LATEX = re.compile(r"[\\^_{}]")


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


if __name__ == "__main__":
    _serve()
