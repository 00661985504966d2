"""Whether a run can still learn: the streaks that end it loudly or warn about it.

Two ways a run goes on forever without learning, exiting 0 at the end:

* **every update skipped.** The train step skips an update whose loss or gradient norm is not
  finite (`metrics['train/update_skipped']` is 1; params and optimizer state are left as they
  were). One such step is noise; a learning rate of 1e30 makes every step one. After
  `TrainerConfig.max_nonfinite_steps` consecutive skipped updates `TrainingDivergedError` ends the
  run: the trainer's params are still those of the last applied update, and the runner saves no
  checkpoint on the way out, so the newest checkpoint is the last one written before the error
  (`sfrrl-train` exits with `EXIT_DIVERGED`).
* **no signal.** A group whose rewards are all equal has advantage 0 under the group-relative
  estimators: it trains nothing. A step in which every kept group is so learns nothing, whatever
  the optimizer does. After `TrainerConfig.warn_no_signal_steps` such steps in a row the log warns
  (and again every that many steps); the metrics carry the count every step
  (`train/no_signal_steps`), beside the step's own `rollout/zero_variance_groups`.

Steps that applied no update at all (every group failed, or one_step_off's first step) neither
extend nor reset the skip streak. The streaks start from 0 when a run resumes.
"""
from __future__ import annotations

import logging
import math

from sfrrl_jax.trainer.config import TrainerConfig

_log = logging.getLogger(__name__)

# `sfrrl-train`'s exit status for a run ended by TrainingDivergedError (0 done, 2 bad config,
# 3 unusable run dir or checkpoints, 128+signal stopped by a signal).
EXIT_DIVERGED = 4


class TrainingDivergedError(RuntimeError):
    """`steps` consecutive updates were skipped as non-finite; `last` holds the last step's train
    metrics (loss, grad_norm) that show why."""

    def __init__(self, message: str, steps: list[int], last: dict):
        super().__init__(message)
        self.steps, self.last = steps, last


class TrainingHealth:
    """Counts the streaks of one trainer across its steps (see the module doc).

    Args:
      cfg: the trainer's config (`max_nonfinite_steps`, `warn_no_signal_steps`; 0 turns either off).
    """

    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.skipped_steps: list[int] = []   # the current streak of skipped updates (step indices)
        self.no_signal_steps = 0

    def observe(self, metrics: dict) -> dict:
        """Reads one finished step's metrics; returns the health metrics to add to them.

        Args:
          metrics: the step's metrics (`step`, `train/update_skipped` if an update ran,
            `rollout/zero_variance_groups` and `rollout/kept_groups`).
        Returns:
          {'train/nonfinite_streak': int, 'train/no_signal_steps': int}.
        Raises:
          TrainingDivergedError: the skip streak reached `cfg.max_nonfinite_steps`.
        """
        step = int(metrics.get("step", -1))
        skipped = metrics.get("train/update_skipped")
        if skipped is not None:   # an update ran (or was skipped): the streak moves
            self.skipped_steps = self.skipped_steps + [step] if skipped >= 0.5 else []
        kept = metrics.get("rollout/kept_groups", 0)
        flat = metrics.get("rollout/zero_variance_groups", 0)
        self.no_signal_steps = self.no_signal_steps + 1 if kept and flat == kept else 0
        limit = self.cfg.warn_no_signal_steps
        if limit and self.no_signal_steps and self.no_signal_steps % limit == 0:
            _log.warning(
                "no learning signal for %d steps: in every kept group all samples got the same reward, so "
                "every advantage is 0 (reward/mean %.4g). Check the reward function, raise group_size or the "
                "sampling temperature, or drop such groups (TrainerConfig.dynamic_sampling=True)",
                self.no_signal_steps, metrics.get("reward/mean", math.nan))
        n = self.cfg.max_nonfinite_steps
        if n and len(self.skipped_steps) >= n:
            loss, norm = metrics.get("train/loss", math.nan), metrics.get("train/grad_norm", math.nan)
            raise TrainingDivergedError(
                f"training cannot learn: the last {len(self.skipped_steps)} updates (steps "
                f"{self.skipped_steps[0]}..{self.skipped_steps[-1]}) were skipped because the loss or gradient "
                f"norm was not finite (last: train/loss={loss}, train/grad_norm={norm}). The params are those "
                f"of the last applied update and no checkpoint is written now. Lower "
                f"OptimizerConfig.learning_rate, clip gradients (OptimizerConfig.max_grad_norm) or check the "
                f"loss inputs; TrainerConfig.max_nonfinite_steps={n} sets how many skips in a row end a run "
                f"(0: never)", list(self.skipped_steps), {"train/loss": loss, "train/grad_norm": norm})
        return {"train/nonfinite_streak": len(self.skipped_steps), "train/no_signal_steps": self.no_signal_steps}
