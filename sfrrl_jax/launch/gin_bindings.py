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
error too: gin would drop it silently, and the run would not be the one the file describes. So is
one parameter bound twice with different values in the files (the same file, two files, or a file
and one it includes; `conflicting_bindings` names each place): gin would keep the last silently.
--gin_param bindings apply after the files, in order: each overrides on purpose
(`--gin_param=ExperimentConfig.num_steps=50`), a later one an earlier one.
Job kinds other than 'rl' are recipes, registered by experiment code (`sfrrl_jax.launch.recipes`).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
from typing import Any, NamedTuple, Sequence

import gin
from gin import config_parser

from sfrrl_jax.models.lora import LoraConfig
from sfrrl_jax.rl.config import AdvantageConfig, LossConfig
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.launch.runner import ExperimentConfig, validate_experiment
from sfrrl_jax.launch.recipes import (BUILTIN_KINDS, get_recipe, recipe_kinds, registered_recipes,
                                      unknown_kind_message)
from sfrrl_jax.agents.loop import AgentConfig
from sfrrl_jax.agents.tasks.bfcl_multi_turn import BfclMultiTurnEnvironment, multi_turn_match, multi_turn_progress
from sfrrl_jax.agents.tasks.code_tasks import code_environment
from sfrrl_jax.agents.mcp_tools import mcp_tools
from sfrrl_jax.agents.tasks.environments import (ToolEnvironment, calculator_environment, countdown_tool_environment,
                                                 qa_environment)
from sfrrl_jax.agents.tasks.function_calling import FunctionCallingEnvironment, function_call_match
from sfrrl_jax.agents.tasks.math_tasks import math_tool_environment
from sfrrl_jax.agents.tasks.reward_fns import answer_correct, answer_format, in_thread, tool_error_penalty
from sfrrl_jax.agents.tools import ToolRunnerConfig
from sfrrl_jax.launch.agentic import AgenticRollout
from sfrrl_jax.launch.preflight import PreflightError, check_job_files, tool_backend_problems  # noqa: F401 (re-export)


class GinConfigError(ValueError):
    """A gin file or binding could not be parsed or built (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Job:
    """What `sfrrl-train` runs.

    kind: 'rl' (`run_experiment(experiment)`) or a registered recipe kind (`sfrrl_jax.launch.recipes`:
      `recipe` is that kind's config, run as `run(recipe, run_dir)`; e.g. 'quickstart', registered
      by experiments/recipes/quickstart.py: SFT warm start on the calculator task, then RL, with
      held-out success before/after).
    In gin the recipe is bound under its kind's name (`Job.quickstart = @QuickstartRecipe()`, see
    `make_job`); in Python, `Job(kind='quickstart', recipe=QuickstartRecipe(), run_dir=...)`.
    """

    kind: str = "rl"
    experiment: ExperimentConfig | None = None
    recipe: Any = None
    run_dir: str | None = None

    def __post_init__(self):
        if self.kind not in recipe_kinds():
            raise ValueError(unknown_kind_message(self.kind))
        if self.kind == "rl":
            if self.experiment is None:
                raise ValueError("Job.kind='rl' needs Job.experiment = @ExperimentConfig()")
            if self.recipe is not None:
                raise ValueError(f"Job.kind='rl' runs Job.experiment; it has no recipe, got {self.recipe!r}")
            return
        entry = get_recipe(self.kind)
        name = entry.recipe_cls.__name__
        if self.recipe is None:
            raise ValueError(f"Job.kind={self.kind!r} needs Job.{self.kind} = @{name}()")
        if not isinstance(self.recipe, entry.recipe_cls):
            raise ValueError(f"Job.{self.kind} must be a {name}, got {type(self.recipe).__name__}")
        if self.experiment is not None:
            raise ValueError(f"Job.kind={self.kind!r} runs its recipe; Job.experiment would be ignored")
        if not self.run_dir:
            raise ValueError(f"Job.kind={self.kind!r} needs Job.run_dir")


def make_job(kind: str = "rl", experiment: ExperimentConfig | None = None, run_dir: str | None = None,
             **recipes: Any) -> Job:
    """The Job that gin's `Job` builds: a recipe's config comes under its kind's name.

    `Job.quickstart = @QuickstartRecipe()` passes recipes={'quickstart': ...}. A name that is no
    registered recipe kind (a misspelt parameter), or a recipe bound under another kind than
    `Job.kind`, is a ValueError: gin would otherwise accept any name here.
    """
    kinds = recipe_kinds()
    if kind not in kinds:   # first: then `Job.quickstart` of an unregistered recipe reads as such
        raise ValueError(unknown_kind_message(kind))
    for name in recipes:
        if name not in kinds:
            raise ValueError(f"Job has no parameter {name!r}: Job takes kind, experiment, run_dir, and a "
                             f"recipe under its kind's name (recipe kinds: {list(kinds[len(BUILTIN_KINDS):])})")
    other = sorted(set(recipes) - {kind})
    if other:
        raise ValueError(f"Job.kind={kind!r} but Job.{other[0]} is bound: that recipe would not run")
    return Job(kind=kind, experiment=experiment, recipe=recipes.get(kind), run_dir=run_dir)


_REGISTERED: set[type] = set()


def register() -> None:
    """Registers the config classes, and every recipe class registered so far, with gin (idempotent).

    Called by every `load_job`, so a recipe whose module is imported later is picked up then.
    """
    if not _REGISTERED:
        for cls in (ExperimentConfig, TrainerConfig, LossConfig, AdvantageConfig, OptimizerConfig, ToolRunnerConfig,
                    LoraConfig):
            gin.external_configurable(cls, module="sfrrl")
        # the real experiment path (launch.agentic): the rollout factory, the agent's limits, and
        # the environments a gin file may pass as values (`AgenticRollout.environment = @code_environment()`)
        for cls in (AgenticRollout, AgentConfig):
            gin.external_configurable(cls, module="sfrrl")
        for fn in (code_environment, math_tool_environment, countdown_tool_environment, calculator_environment,
                   qa_environment, FunctionCallingEnvironment, BfclMultiTurnEnvironment, ToolEnvironment):
            gin.external_configurable(fn, module="sfrrl")
        # an MCP server's tools as an environment's: `ToolEnvironment.tools = @mcp_tools()`,
        # `mcp_tools.server = 'python3 my_server.py'` (or an http(s) URL)
        gin.external_configurable(mcp_tools, module="sfrrl")
        # reward functions, passed as values: `qa_environment.reward_fns = [@answer_correct, @answer_format]`;
        # a blocking one off the agent loop: `[@judge/in_thread()]` with `judge/in_thread.fn = @my_judge`
        for fn in (answer_correct, answer_format, tool_error_penalty, function_call_match, multi_turn_match,
                   multi_turn_progress, in_thread):
            gin.external_configurable(fn, module="sfrrl")
        gin.external_configurable(make_job, name="Job", module="sfrrl")
        _REGISTERED.add(Job)
    for entry in registered_recipes():
        if entry.recipe_cls not in _REGISTERED:
            gin.external_configurable(entry.recipe_cls, module="sfrrl")
            _REGISTERED.add(entry.recipe_cls)


def load_job(gin_files: Sequence[str] = (), gin_params: Sequence[str] = (),
             optional_params: Sequence[str] = ()) -> Job:
    """Parses the files then the bindings (later ones win) and builds the Job. Clears gin first.

    optional_params: bindings parsed last that the built Job may leave unused (the CLI's
    --run_dir / --resume bind ExperimentConfig fields, which a recipe Job never builds). Every
    other binding must be used by the build, else GinConfigError names the unused ones.
    A recipe's class is known to gin only once its module has been imported (it registers
    itself, `sfrrl_jax.launch.recipes`); the error for an unknown name lists the kinds there are.
    """
    register()
    gin.clear_config()
    where = f"files {list(gin_files)}, bindings {list(gin_params) + list(optional_params)}"
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(gin_params), finalize_config=False)
        before = _bound_keys()
        gin.parse_config(list(optional_params))
    except (ValueError, KeyError, TypeError, ImportError, SyntaxError) as e:
        hint = ""
        if "No configurable matching" in str(e):  # e.g. @QuickstartRecipe() with its module not imported
            hint = (f"\n  (registered job kinds: {list(recipe_kinds())}; a recipe's configurable exists once its "
                    f"module is imported: experiments/train.py imports experiments/recipes/; sfrrl-train "
                    f"--recipe_module imports yours)")
        raise GinConfigError(f"gin config ({where}) is invalid: {type(e).__name__}: {e}{hint}") from e
    except OSError as e:
        raise GinConfigError(f"cannot read gin file: {e}") from e
    conflicts = conflicting_bindings(gin_files)
    if conflicts:
        raise GinConfigError(f"gin config ({where}) binds a parameter twice with different values in its files (gin "
                             f"would keep the last silently; to override a file's value, use --gin_param):\n  "
                             + "\n  ".join(conflicts))
    # before building: a tool backend this host cannot use fails here, naming the binding
    tool_problems = [p for where, backend, address in _tool_backend_bindings()
                     for p in tool_backend_problems(backend, address, where)]
    if tool_problems:
        raise GinConfigError(f"gin config ({where}) binds tool backends this host cannot use:\n  "
                             + "\n  ".join(tool_problems))
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


def _tool_backend_bindings() -> list[tuple[str, Any, Any]]:
    """(scoped name, bound backend or None, bound ray_address or None) of each ToolRunnerConfig binding."""
    parsed, _ = _gin_tables()
    return [((f"{scope}/" if scope else "") + _short(sel), params.get("backend"), params.get("ray_address"))
            for (scope, sel), params in sorted(parsed.items())
            if sel == "sfrrl.ToolRunnerConfig" and ("backend" in params or "ray_address" in params)]


# -- bindings that disagree ------------------------------------------------------------------------

class _Ref(NamedTuple):       # `@name` / `@name()` as a comparable value
    name: str
    evaluate: bool


class _Macro(NamedTuple):     # `%name`
    name: str


class _Delegate(config_parser.ParserDelegate):
    """Parses references and macros into plain values (gin's own delegate would look them up)."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        scope, _, name = scoped_configurable_name.rpartition("/")
        return _Ref((f"{scope}/" if scope else "") + _canonical(name), evaluate)

    def macro(self, macro_name):
        return _Macro(macro_name)


def _canonical(selector: str) -> str:
    """The registered configurable's full selector ('ExperimentConfig' -> 'sfrrl.ExperimentConfig'),
    so that two spellings of one configurable are one parameter."""
    match = gin.config._REGISTRY.get_match(selector)
    return match.selector if match is not None else selector


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types throughout (1 and True or 1.0 are different bindings)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and not isinstance(a, (_Ref, _Macro)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _read_bindings(text: str, label, out: dict, seen_files: tuple = ()) -> None:
    """Appends (where, value, line) to out[(scope, selector, param)] for each binding of `text`,
    following includes as gin does. label(line_num) -> 'file:line'."""
    for statement in config_parser.ConfigParser(text, _Delegate()):
        if isinstance(statement, config_parser.IncludeStatement):
            path = _include_path(statement.filename)
            if path is not None and path not in seen_files:   # gin reports a missing one itself
                with open(path) as f:
                    text = f.read()
                _read_bindings(text, lambda n, p=path: f"{p}:{n}", out, seen_files + (path,))
            continue
        if not isinstance(statement, config_parser.BindingStatement):
            continue
        scope, selector, param, value, location = statement
        key = (scope, selector, "") if not param else (scope, _canonical(selector), param)
        out[key].append((label(location.line_num), value, location.line_content.strip()))


def _include_path(filename: str) -> str | None:
    # where gin.parse_config_file looks: the search paths (`gin.add_config_file_search_path`),
    # for a relative name, in order
    prefixes = [""] if os.path.isabs(filename) else getattr(gin.config, "_LOCATION_PREFIXES", [""])
    for prefix in prefixes:
        candidate = os.path.join(prefix, filename)
        if os.path.isfile(candidate):
            return candidate
    return None


def conflicting_bindings(gin_files: Sequence[str] = ()) -> list[str]:
    """Parameters bound more than once with different values among the gin files (and the files
    they include). --gin_param bindings are not counted: they apply after the files, in order, so
    a later one overrides on purpose (a sweep script appending its overrides).

    Args:
      gin_files: the .gin files, in order.
    Returns:
      One line per parameter, naming each place it is bound ('file:line') with what is written
      there; [] when every repeat binds the same value.
    """
    out = []
    for (scope, selector, param), places in _file_bindings(gin_files).items():
        if all(_same(places[0][1], value) for _, value, _ in places[1:]):
            continue
        scoped = (f"{scope}/" if scope else "") + (f"{_short(selector)}.{param}" if param else selector)
        name = scoped if param else f"macro {scoped}"
        out.append(f"{name}: " + "; ".join(f"{where}: {line}" for where, _, line in places))
    return out


def _file_bindings(gin_files: Sequence[str]) -> dict:
    out = collections.defaultdict(list)
    for path in gin_files:
        try:
            with open(_include_path(path) or path) as f:   # found where gin finds it
                text = f.read()
        except OSError:   # gin read it through a file reader of its own (gin.config.register_file_reader)
            continue
        _read_bindings(text, lambda n, p=path: f"{p}:{n}", out, (path,))
    return out


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


def validate_job(job: Job, num_devices: int | None = None, check_files: bool = False):
    """Checks the job's configs fit together without allocating; returns the ModelConfig (rl) or None
    (a recipe: its registered `validate`, if any, is called).

    Args:
      num_devices: the devices the run will have (default `ExperimentConfig.num_devices`, else this
        process's); check_files: first check the files the job reads (`preflight.check_job_files`:
        the HF directory's config, shards and tokenizer, the task file), as `--validate_only` does.
        Without it a config is validated on a machine without its files (an absent HF directory's
        shapes are taken from the `ExperimentConfig.model` preset).
    Raises:
      PreflightError (a ValueError) listing every missing or unreadable file; ValueError (and
      KeyError, FileNotFoundError) naming the first config field that does not fit.
    """
    if check_files:
        check_job_files(job)   # all file problems at once, before checks that would trip over one
    if job.kind == "rl":
        return validate_experiment(job.experiment, num_devices)
    entry = get_recipe(job.kind)
    if entry.validate is not None:
        entry.validate(job.recipe)
    return None


def run_job(job: Job, operative: str | None = None, log=print) -> dict:
    """Runs the job: 'rl' through `run_experiment`; a recipe kind through its registered `run`,
    into `Job.run_dir` (created, with `operative_config.gin` written there first).

    An 'rl' job's files are checked first (`preflight.check_job_files`): a missing shard or
    tokenizer raises `PreflightError` naming it before anything is allocated or written.
    """
    if job.kind == "rl":
        check_job_files(job)
        from sfrrl_jax.launch.runner import run_experiment
        return run_experiment(job.experiment, operative_config=operative, log=log)
    entry = get_recipe(job.kind)
    from pathlib import Path
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    if operative is not None:
        (Path(job.run_dir) / "operative_config.gin").write_text(operative)
    return entry.run(job.recipe, job.run_dir, log=log)
