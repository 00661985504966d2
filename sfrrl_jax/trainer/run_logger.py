"""Per-run outputs: metrics JSONL, TensorBoard events, Chrome trace and the busy/idle PNG."""
from __future__ import annotations

import json
import pathlib

from sfrrl_jax.trainer.timeline import Timeline


class RunLogger:
    """Writes `metrics.jsonl` and TensorBoard scalars under `run_dir` (append-only, resumable)."""

    def __init__(self, run_dir: str | pathlib.Path, tensorboard: bool = True):
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items() if k != "step"}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        if self._writer is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._writer.add_scalar(k, v, step)
            self._writer.flush()

    def write_timeline(self, timeline: Timeline) -> dict:
        trace = timeline.write_chrome_trace(self.run_dir / "timeline.trace.json")
        png = timeline.write_busy_png(self.run_dir / "busy_idle.png")
        return {"trace": str(trace), "png": str(png)}

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _plain(v):
    try:
        return float(v) if not isinstance(v, (int, str, bool)) else v
    except (TypeError, ValueError):
        return str(v)


def read_metrics(run_dir: str | pathlib.Path) -> list[dict]:
    """The rows `RunLogger.log` appended to `run_dir/metrics.jsonl`, in the order written.

    Args:
      run_dir: the run directory.
    Returns:
      One dict per non-blank line: `'step'` (int) and the metrics logged at that step, as `RunLogger.log` wrote
      them (ints, bools and strings as given, other numbers as floats, anything else as its string). A resumed
      run appends to the same file, after the earlier rows.
    Raises:
      FileNotFoundError: when `run_dir` has no `metrics.jsonl`.
      json.JSONDecodeError: when a line is not valid JSON (e.g. a truncated last line).
    """
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
