"""The experiment edge: gin names for the library's config dataclasses, and the job they build.

The library itself never reads gin: this module registers its frozen config classes with
`gin.external_configurable` (a gin-aware subclass; the library's classes are untouched), so a
.gin file says

    Job.kind = 'rl'
    Job.experiment = @ExperimentConfig()
    ExperimentConfig.trainer = @TrainerConfig()
    TrainerConfig.mode = 'pipelined'

A misspelt name fails at parse time with gin's message, which names the binding, the file and
the line; `load_job` adds which files and bindings were being read. A binding that is parsed but
never used -- its configurable is never built (`LossConfig.policy_loss = 'gspo'` without
`ExperimentConfig.loss = @LossConfig()`), a scope nothing calls, a macro nothing refers to -- is an
error too: gin would drop it silently, and the run would not be the one the file describes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import gin

from sfrrl_jax.rl.config import AdvantageConfig, LossConfig
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.launch.runner import ExperimentConfig, validate_experiment
from sfrrl_jax.testing.workload import WorkloadConfig

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


def load_job(gin_files: Sequence[str] = (), gin_params: Sequence[str] = (),
             optional_params: Sequence[str] = ()) -> Job:
    """Parses the files then the bindings (later ones win) and builds the Job. Clears gin first.

    optional_params: bindings parsed last that the built Job may leave unused (the CLI's
    --run_dir / --resume bind ExperimentConfig fields, which a quickstart Job never builds). Every
    other binding must be used by the build, else GinConfigError names the unused ones.
    """
    register()
    gin.clear_config()
    where = f"files {list(gin_files)}, bindings {list(gin_params) + list(optional_params)}"
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(gin_params), finalize_config=False)
        before = _bound_keys()
        gin.parse_config(list(optional_params))
    except (ValueError, KeyError, TypeError, ImportError, SyntaxError) as e:
        raise GinConfigError(f"gin config ({where}) is invalid: {type(e).__name__}: {e}") from e
    except OSError as e:
        raise GinConfigError(f"cannot read gin file: {e}") from e
    exempt = _bound_keys() - before   # keys only the optional bindings introduced
    try:
        job = gin.get_configurable("sfrrl.Job")()
    except (ValueError, TypeError) as e:
        raise GinConfigError(f"gin config (files {list(gin_files)}) built an invalid config: {e}") from e
    unused = unused_bindings(exempt)
    if unused:
        raise GinConfigError(f"gin config ({where}) binds parameters that the {job.kind!r} Job never uses "
                             f"(gin would drop them silently): " + "; ".join(unused))
    return job


def _gin_tables() -> tuple[dict, dict]:
    # gin keeps what was parsed (_CONFIG) and what calls used (_OPERATIVE_CONFIG), both keyed by
    # (scope, selector), and has no public accessor for them; `config_str()` /
    # `operative_config_str()` render the same tables as text but leave out values that are not
    # literals, so comparing those would miss bindings.
    parsed, operative = getattr(gin.config, "_CONFIG", None), getattr(gin.config, "_OPERATIVE_CONFIG", None)
    if not isinstance(parsed, dict) or not isinstance(operative, dict):
        raise RuntimeError("this gin-config version has no gin.config._CONFIG / _OPERATIVE_CONFIG dicts; "
                           "sfrrl_jax.launch.gin_bindings.unused_bindings needs updating")
    return parsed, operative


def _bound_keys() -> set[tuple[str, str, str]]:
    parsed, _ = _gin_tables()
    return {(scope, selector, p) for (scope, selector), params in parsed.items() for p in params}


def _short(selector: str) -> str:
    return selector[len("sfrrl."):] if selector.startswith("sfrrl.") else selector


def unused_bindings(exempt: set = frozenset()) -> list[str]:
    """The parsed bindings no configurable call used so far (call after building), each with why.

    A binding in scope 'a' is used by calls made in scope 'a' or below it ('a/b'); an unscoped one
    by any call of its configurable (gin's own lookup goes by scope prefixes the same way).
    """
    parsed, operative = _gin_tables()
    with gin.config._OPERATIVE_CONFIG_LOCK:
        calls = list(operative.items())
    out = []
    for (scope, selector), params in sorted(parsed.items()):
        seen = [op for (s, sel), op in calls
                if sel == selector and (not scope or s == scope or s.startswith(scope + "/"))]
        if selector == "gin.macro":
            if not seen and (scope, selector, "value") not in exempt:
                out.append(f"macro {scope} (nothing refers to %{scope})")
            continue
        name = (f"{scope}/" if scope else "") + _short(selector)
        for p in sorted(params):
            if (scope, selector, p) in exempt or any(p in op for op in seen):
                continue
            if not seen:
                why = (f"no {_short(selector)} is built: no binding refers to @{_short(selector)}()" if not scope
                       else f"no {_short(selector)} is built in scope {scope!r}")
            else:
                why = f"every {_short(selector)} built passed {p} itself"
            out.append(f"{name}.{p} ({why})")
    return out


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
        from sfrrl_jax.launch.runner import run_experiment
        return run_experiment(job.experiment, operative_config=operative, log=log)
    qs = _quickstart_module()
    if qs is None:
        raise NotImplementedError("Job.kind='quickstart' needs sfrrl_jax.trainer.quickstart (not installed)")
    from pathlib import Path
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    if operative is not None:
        (Path(job.run_dir) / "operative_config.gin").write_text(operative)
    return qs.run_quickstart(job.quickstart, job.run_dir, log=log)
