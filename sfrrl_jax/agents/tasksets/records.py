"""JSON-lines records -> Tasks, with every error naming '<file>:<line>' and the field.

`read_records(path)` yields `(where, record)` for each non-blank line of a JSONL file (a '.gz'
file is read through gzip; BFCL's '.json' files are JSON lines too). `tasks_from_records` turns
records into Tasks through the task-kind registry (`task_kinds.register_task_kind`):

  kind   record['kind'], else the caller's `default_kind` (one of them is required);
  id     record['id'], else record['task_id'] (HumanEval's name for it), else '<file stem>-<line>';
  body   the kind's `fields` must be present, then the kind's `from_record(record, id)` builds the
         Task; a ValueError or KeyError it raises names the bad or missing field.

Any bad line raises `DatasetError` (a ValueError) whose message starts with '<path>:<line>:'.
Duplicate ids are an error too (they would merge two groups' statistics in training).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.task_kinds import get_task_kind, registered_task_kinds
from sfrrl_jax.agents.tasks import DatasetError, read_records  # noqa: F401  (read_records: re-exported)


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
        default_id = f"{stem}-{where.rsplit(':', 1)[-1]}"
        task = task_from_record(record, where, default_id, default_kind)
        if task.task_id in seen:
            raise DatasetError(f"{where}: duplicate id {task.task_id!r} (first at {seen[task.task_id]})")
        seen[task.task_id] = where
        tasks.append(task)
    return tasks


def load_tasks_file(path: str | os.PathLike, kind: str | None = None, limit: int | None = None) -> list[Task]:
    """Tasks from a JSONL file (optionally gzipped): each line a record of its 'kind' (default `kind`)."""
    path = Path(path)
    stem = path.name.split(".")[0] or "task"
    return tasks_from_records(read_records(path), kind, stem, limit)
