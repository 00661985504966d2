"""The experiment edge: gin names for the library's config dataclasses, and the job they build.

The library itself never reads gin: this module registers its frozen config classes with
`gin.external_configurable` (a gin-aware subclass; the library's classes are untouched), so a
.gin file says

    Job.kind = 'rl'
    Job.experiment = @ExperimentConfig()
    ExperimentConfig.trainer = @TrainerConfig()
    TrainerConfig.mode = 'pipelined'

A misspelt name fails at parse time with gin's message, which names the binding, the file and
the line; `load_job` adds which files and bindings were being read.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import gin

from sfrrl_jax.rl.config import AdvantageConfig, LossConfig
from sfrrl_jax.train.optimizer import OptimizerConfig
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.runner import ExperimentConfig, validate_experiment
from sfrrl_jax.trainer.workload import WorkloadConfig

JOB_KINDS = ("rl", "quickstart")


class GinConfigError(ValueError):
    """A gin file or binding could not be parsed or built (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Job:
    """What `sfrrl-train` runs.

    kind: 'rl' (`run_experiment(experiment)`) or 'quickstart' (`run_quickstart(quickstart, run_dir)`:
      SFT warm start on the calculator task, then RL, with held-out success before/after).
    """

    kind: str = "rl"
    experiment: ExperimentConfig | None = None
    quickstart: Any = None
    run_dir: str | None = None

    def __post_init__(self):
        if self.kind not in JOB_KINDS:
            raise ValueError(f"Job.kind={self.kind!r}; valid: {list(JOB_KINDS)}")
        if self.kind == "rl" and self.experiment is None:
            raise ValueError("Job.kind='rl' needs Job.experiment = @ExperimentConfig()")
        if self.kind == "quickstart":
            if self.quickstart is None:
                raise ValueError("Job.kind='quickstart' needs Job.quickstart = @QuickstartRecipe()")
            if not self.run_dir:
                raise ValueError("Job.kind='quickstart' needs Job.run_dir")


def _quickstart_module():
    try:
        from sfrrl_jax.trainer import quickstart
    except ImportError:
        return None
    return quickstart


_REGISTERED = False


def register() -> None:
    """Registers the config classes with gin (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    for cls in (ExperimentConfig, TrainerConfig, LossConfig, AdvantageConfig, OptimizerConfig, WorkloadConfig, Job):
        gin.external_configurable(cls, module="sfrrl")
    qs = _quickstart_module()
    if qs is not None:
        gin.external_configurable(qs.QuickstartRecipe, module="sfrrl")
    _REGISTERED = True


def load_job(gin_files: Sequence[str] = (), gin_params: Sequence[str] = ()) -> Job:
    """Parses the files then the bindings (later ones win) and builds the Job. Clears gin first."""
    register()
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(gin_params), finalize_config=False)
    except (ValueError, KeyError, TypeError, ImportError, SyntaxError) as e:
        raise GinConfigError(f"gin config (files {list(gin_files)}, bindings {list(gin_params)}) is invalid: "
                             f"{type(e).__name__}: {e}") from e
    except OSError as e:
        raise GinConfigError(f"cannot read gin file: {e}") from e
    try:
        return gin.get_configurable("sfrrl.Job")()
    except (ValueError, TypeError) as e:
        raise GinConfigError(f"gin config (files {list(gin_files)}) built an invalid config: {e}") from e


def operative_config() -> str:
    """The bindings the built Job actually used (call after `load_job`)."""
    return gin.operative_config_str()


def validate_job(job: Job, num_devices: int | None = None):
    """Checks the job's configs fit together without allocating; returns the ModelConfig (rl) or None."""
    if job.kind == "rl":
        return validate_experiment(job.experiment, num_devices)
    qs = _quickstart_module()
    if qs is None:
        raise NotImplementedError("Job.kind='quickstart' needs sfrrl_jax.trainer.quickstart")
    return None


def run_job(job: Job, operative: str | None = None, log=print) -> dict:
    if job.kind == "rl":
        from sfrrl_jax.trainer.runner import run_experiment
        return run_experiment(job.experiment, operative_config=operative, log=log)
    qs = _quickstart_module()
    if qs is None:
        raise NotImplementedError("Job.kind='quickstart' needs sfrrl_jax.trainer.quickstart (not installed)")
    from pathlib import Path
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    if operative is not None:
        (Path(job.run_dir) / "operative_config.gin").write_text(operative)
    return qs.run_quickstart(job.quickstart, job.run_dir, log=log)
