"""The benchmarks' shared timer (scripts here import it as `from timing import timed`)."""
import statistics
import time

import jax


def timed(fn, *args, iters: int) -> float:
    """Median seconds of `iters` calls of fn(*args) after one warm-up call (compiles excluded)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
