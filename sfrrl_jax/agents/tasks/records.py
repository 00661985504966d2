"""JSON-lines records <-> Tasks, with every error naming '<file>:<line>' and the field.

`read_records(path)` yields `(where, record)` for each non-blank line of a JSONL file (a '.gz'
file is read through gzip; BFCL's '.json' files are JSON lines too). `task_from_record` turns one
record into a Task through the task-kind registry (`kinds.register_task_kind`), the one reader
of records every loader uses (`load_tasks_jsonl`, `load_tasks`, the BFCL and HumanEval sets):

  kind   record['kind'], else the caller's `default_kind` (one of them is required);
  id     record['id'], else record['task_id'] (HumanEval's name for it), else '<file stem>-<line>'
         (the stem: the file name up to its first '.', so 'data.jsonl.gz' gives 'data-<line>');
  body   the kind's `fields` must be present, then the kind's `from_record(record, id)` builds the
         Task; a ValueError or KeyError it raises names the bad or missing field.

The built-in kinds' record fields are listed in `builtin_kinds.py`; a kind registered without a
record format of its own reads `prompt: str, [answer: str|number]`, any other field -> metadata.
Any bad line raises `DatasetError` (a ValueError) whose message starts with '<path>:<line>:'.
Duplicate ids are an error too (they would merge two groups' statistics in training).
`save_tasks_jsonl` writes records `load_tasks_jsonl` reads back into equal tasks.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tasks.kinds import get_task_kind, registered_task_kinds


class DatasetError(ValueError):
    """A bad dataset line; the message starts with '<path>:<line>:'."""


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """`('<path>:<line>', record)` for each non-blank line of a JSONL file.

    Args:
      path: the JSONL file; a name ending in '.gz' is read gzip-compressed. Read as UTF-8 text.
    Yields:
      `(where, record)`: `where` is '<path>:<line>' (lines counted from 1), `record` the line's
      JSON object as a dict. Blank lines are skipped.
    Raises:
      FileNotFoundError: `path` does not exist.
      DatasetError: a line is bad JSON or not a JSON object (the message names the line, and the
        column of a JSON error), or the file is not UTF-8 text.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        f = opener(path, "rt", encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"task file {path} does not exist") from None
    with f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{where}: invalid JSON: {e.msg} at column {e.colno}") from None
                if not isinstance(record, dict):
                    raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
                yield where, record
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a line)") from None


def task_from_record(record: dict, where: str, default_id: str, default_kind: str | None) -> Task:
    """One record -> Task (see the module docstring); DatasetError names `where` and the field."""
    kind = record.get("kind", default_kind)
    if kind is None:
        raise DatasetError(f"{where}: missing field 'kind' (or pass kind=... to the loader for lines without one)")
    if not isinstance(kind, str) or kind not in registered_task_kinds():
        raise DatasetError(f"{where}: field 'kind' must be one of {registered_task_kinds()}, got {kind!r} "
                           f"(add a kind with sfrrl_jax.agents.register_task_kind(name, verify))")
    spec = get_task_kind(kind)
    for field in spec.fields:
        if field not in record:
            raise DatasetError(f"{where}: missing required field {field!r} (kind {kind!r})")
    task_id = record.get("id", record.get("task_id", default_id))
    if not isinstance(task_id, str) or not task_id:
        raise DatasetError(f"{where}: field 'id' must be a non-empty string, got {task_id!r}")
    try:
        task = spec.from_record({**record, "kind": kind}, task_id)
    except KeyError as e:  # a from_record that indexed a field the record lacks
        raise DatasetError(f"{where}: missing required field {e.args[0]!r} (kind {kind!r})") from None
    except ValueError as e:  # names the bad field
        raise DatasetError(f"{where}: {e}") from None
    except Exception as e:
        raise DatasetError(f"{where}: {type(e).__name__}: {e}") from None
    if not isinstance(task, Task) or task.kind != kind or task.task_id != task_id:
        raise DatasetError(f"{where}: kind {kind!r}: from_record must return a Task with kind {kind!r} and id "
                           f"{task_id!r}, got {task!r}")
    return task


def tasks_from_records(records: Iterable[tuple[str, dict]], default_kind: str | None, stem: str,
                       limit: int | None = None) -> list[Task]:
    """Tasks from `(where, record)` pairs, in order, at most `limit`; ids must be distinct."""
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for where, record in records:
        if limit is not None and len(tasks) >= limit:
            break
        line = where.rsplit(":", 1)[-1]
        task = task_from_record(record, where, f"{stem}-{line}", default_kind)
        if task.task_id in seen:
            raise DatasetError(f"{where}: duplicate id {task.task_id!r} (first on line {seen[task.task_id]})")
        seen[task.task_id] = line
        tasks.append(task)
    return tasks


def load_tasks_jsonl(path: str | os.PathLike, default_kind: str | None = "qa", *,
                     limit: int | None = None) -> list[Task]:
    """Tasks from a JSONL file (record formats: module doc); blank lines are skipped.

    Args:
      path: the JSONL file (gzip-compressed when its name ends in '.gz'; see `read_records`).
      default_kind: the kind of a record without a `kind` field (a registered kind's name); None:
        every record must have one.
      limit: keep the first `limit` tasks; None keeps all.
    Returns:
      The tasks in file order. A record without `id` (or HumanEval's `task_id`) gets
      '<file stem>-<line>', the stem being the file name up to its first '.'.
    Raises:
      FileNotFoundError: `path` does not exist.
      DatasetError: (a ValueError) any bad line: bad JSON, a missing or unregistered kind, a
        missing or bad field, a bad or duplicate id, or a `from_record` that fails; the message
        names the line and the field.
    """
    path = Path(path)
    stem = path.name.split(".")[0] or "task"
    return tasks_from_records(read_records(path), default_kind, stem, limit)


def task_to_record(task: Task) -> dict:
    """The JSONL record `load_tasks_jsonl` reads back into an equal task (the kind's `to_record`)."""
    return {"id": task.task_id, "kind": task.kind, **get_task_kind(task.kind).to_record(task)}


def save_tasks_jsonl(tasks: Iterable[Task], path: str | os.PathLike) -> Path:
    """Writes `tasks` as a JSONL file that `load_tasks_jsonl` reads back into equal tasks.

    Each line is `task_to_record(task)`: 'id', 'kind' and the kind's `to_record` fields.

    Args:
      tasks: the tasks to write, in order.
      path: the file to write, gzip-compressed when its name ends in '.gz' (as `read_records` reads
        it); overwritten if it exists.
    Returns:
      `path` as a `Path`.
    Raises:
      UnknownTaskKindError: a task's kind is not registered.
    """
    path = Path(path)
    with (gzip.open(path, "wt") if path.suffix == ".gz" else path.open("w")) as f:
        for task in tasks:
            f.write(json.dumps(task_to_record(task)) + "\n")
    return path
