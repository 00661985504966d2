"""Device-work timeline: spans of engine and train work, as Chrome-trace JSON and a busy/idle PNG."""
from __future__ import annotations

import json
import pathlib
import threading
import time


class Timeline:
    """Thread-safe list of (name, lane, start, end) spans in `time.perf_counter` seconds."""

    def __init__(self):
        self._lock = threading.Lock()
        self.spans: list[tuple[str, str, float, float]] = []
        self.steps: list[tuple[int, float, float]] = []  # (step, start, end)
        self._open: tuple[int, float] | None = None

    def add(self, name: str, lane: str, start: float, end: float) -> None:
        with self._lock:
            self.spans.append((name, lane, start, end))

    def begin_step(self, step: int, t: float) -> None:
        self._open = (step, t)

    def end_step(self, t: float) -> None:
        if self._open is not None:
            self.steps.append((self._open[0], self._open[1], t))
            self._open = None

    def idle_split(self, start: float, end: float, work_waiting: list[tuple[float, float]]) -> dict:
        """Device-idle time in [start, end], split by whether train work was waiting meanwhile.

        work_waiting: intervals in which a finished group could have been trained on the current
        params (see `WaitingWork`). Returns {'idle_s': gaps between device spans, 'starved_s':
        the part of them with nothing waiting}. Starved idle is what no strictly on-policy
        schedule can fill: the work that would fill it does not exist yet.
        """
        spans = []
        with self._lock:
            # Device work is sequential, so spans are appended in end-time order: only the tail
            # of the list can reach into [start, end].
            for _, _, a, b in reversed(self.spans):
                if b <= start:
                    break
                if a < end:
                    spans.append((max(a, start), min(b, end)))
        gaps, cursor = [], start
        for a, b in sorted(spans):
            if a > cursor:
                gaps.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < end:
            gaps.append((cursor, end))
        idle = sum(b - a for a, b in gaps)
        return {"idle_s": idle, "starved_s": idle - _overlap(gaps, sorted(work_waiting))}

    def busy_per_step(self) -> list[dict]:
        """Per step: wall seconds and busy seconds per lane (engine, train)."""
        out = []
        for step, s, e in self.steps:
            lanes: dict[str, float] = {}
            for _, lane, a, b in self.spans:
                if a >= s and b <= e:
                    lanes[lane] = lanes.get(lane, 0.0) + (b - a)
            out.append({"step": step, "wall_s": e - s, **{f"{k}_s": v for k, v in lanes.items()}})
        return out

    def write_chrome_trace(self, path: str | pathlib.Path) -> pathlib.Path:
        path = pathlib.Path(path)
        t0 = min((s[2] for s in self.spans), default=0.0)
        lanes = {"engine": 1, "train": 2}
        events = [{"name": n, "ph": "X", "pid": 0, "tid": lanes.get(lane, 3), "ts": (a - t0) * 1e6,
                   "dur": (b - a) * 1e6, "cat": lane} for n, lane, a, b in self.spans]
        events += [{"name": f"step {k}", "ph": "X", "pid": 0, "tid": 0, "ts": (s - t0) * 1e6,
                    "dur": (e - s) * 1e6, "cat": "step"} for k, s, e in self.steps]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}}
                   for lane, tid in {"steps": 0, **lanes}.items()]
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path

    def write_busy_png(self, path: str | pathlib.Path, title: str = "device busy / idle per step") -> pathlib.Path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = self.busy_per_step()
        path = pathlib.Path(path)
        fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(rows) + 2), 3))
        steps = [r["step"] for r in rows]
        eng = [r.get("engine_s", 0.0) for r in rows]
        trn = [r.get("train_s", 0.0) for r in rows]
        idle = [max(r["wall_s"] - a - b, 0.0) for r, a, b in zip(rows, eng, trn)]
        ax.bar(steps, eng, label="decode/prefill", color="tab:blue")
        ax.bar(steps, trn, bottom=eng, label="train", color="tab:orange")
        ax.bar(steps, idle, bottom=[a + b for a, b in zip(eng, trn)], label="idle", color="lightgrey")
        ax.set_xlabel("RL step")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.legend(loc="upper right", fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


class WaitingWork:
    """Intervals in which train work was waiting (a count above zero), for `Timeline.idle_split`.

    `update(n)` is called with the number of waiting work items whenever it may have changed;
    only the transitions between zero and non-zero are kept. Not thread-safe: call it from one
    thread (the trainer's event loop).
    """

    def __init__(self):
        self.intervals: list[tuple[float, float]] = []
        self._since: float | None = None

    def update(self, waiting: int, t: float | None = None) -> None:
        t = time.perf_counter() if t is None else t
        if waiting and self._since is None:
            self._since = t
        elif not waiting and self._since is not None:
            self.intervals.append((self._since, t))
            self._since = None
