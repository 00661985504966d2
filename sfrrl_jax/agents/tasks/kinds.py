"""The task-kind registry: what a `Task.kind` means, added to without editing the library.

A kind is a name, a verifier, (for JSONL datasets) how its records read and write, and
(optionally) its default environment:

    def verify_haiku(task, final_text) -> float:        # the kind's notion of "answer correct"
        return float(extract_answer(final_text) == task.answer)

    register_task_kind("haiku", verify_haiku,           # one place; no library edit
                       environment=haiku_environment)   # optional: a zero-argument Environment factory

Then `Task(..., kind="haiku")` is verified by `reward_fns.answer_correct` (the default reward of
`ToolEnvironment`) and `verifiers.task_reward`, `records.load_tasks_jsonl` reads lines such as
`{"kind": "haiku", "prompt": "...", "answer": "...", <any other field>: ...}` (the generic record:
`prompt` required, `answer` optional, every other field goes to `Task.metadata`; pass
`from_record` / `to_record` for a record of your own), and `launch.agentic.AgenticRollout` runs
a set of such tasks in `haiku_environment()` unless it is given an environment. The built-in
kinds ('arithmetic', 'countdown', 'qa') are registered the same way, in `builtin_kinds.py`, and
the task sets' kinds in their own modules (all imported with `sfrrl_jax.agents`).
Registering a name that exists raises unless `override=True`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sfrrl_jax.agents.protocols import Environment, Task

Verifier = Callable[[Task, str], float]       # (task, final assistant text) -> reward
FromRecord = Callable[[dict, str], Task]      # (JSONL record with 'kind' set, task id) -> Task; a ValueError
#                                               names the bad field (the loader prefixes '<path>:<line>: ')
ToRecord = Callable[[Task], dict]             # Task -> the record's fields other than 'id' and 'kind'
EnvironmentFactory = Callable[[], Environment]  # () -> a fresh environment for a set of tasks of the kind

_RESERVED = ("id", "kind", "prompt", "answer")


class UnknownTaskKindError(ValueError):
    """A kind nobody registered; the message lists the registered kinds and how to add one."""


def prompt_task_from_record(record: dict, task_id: str) -> Task:
    """The generic record: `prompt` (str, required), `answer` (str or number, optional), every
    other field except 'id' and 'kind' into `Task.metadata`."""
    kind = record.get("kind")
    if "prompt" not in record:
        raise ValueError(f"missing required field 'prompt' (kind {kind!r})")
    prompt, answer = record["prompt"], record.get("answer")
    if not isinstance(prompt, str):
        raise ValueError(f"field 'prompt' must be a string, got {type(prompt).__name__}")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise ValueError(f"field 'answer' must be a string or number, got {type(answer).__name__}")
    metadata = {k: v for k, v in record.items() if k not in _RESERVED}
    return Task(task_id=task_id, kind=kind, prompt=prompt, answer=None if answer is None else str(answer),
                metadata=metadata)


def prompt_task_to_record(task: Task) -> dict:
    """Inverse of `prompt_task_from_record`."""
    clash = sorted(set(task.metadata) & set(_RESERVED))
    if clash:
        raise ValueError(f"task {task.task_id}: metadata keys {clash} clash with the record's own fields")
    record: dict[str, Any] = {"prompt": task.prompt}
    if task.answer is not None:
        record["answer"] = task.answer
    record.update(task.metadata)
    return record


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """A registered kind. `fields`: JSONL fields a record of this kind must have (checked before
    `from_record`, with a line-numbered error). `environment`: the kind's default environment, a
    zero-argument factory (None: the kind has none; a run must be given one)."""

    name: str
    verify: Verifier
    from_record: FromRecord = prompt_task_from_record
    to_record: ToRecord = prompt_task_to_record
    fields: tuple[str, ...] = ()
    environment: EnvironmentFactory | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TaskKind.name must be a non-empty string, got {self.name!r}")
        for attr in ("verify", "from_record", "to_record"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"TaskKind {self.name!r}: {attr} must be callable, got {getattr(self, attr)!r}")
        if isinstance(self.fields, str) or not all(isinstance(f, str) for f in self.fields):
            raise TypeError(f"TaskKind {self.name!r}: fields must be a tuple of field names, got {self.fields!r}")
        if self.environment is not None and not callable(self.environment):
            raise TypeError(f"TaskKind {self.name!r}: environment must be a zero-argument factory of an "
                            f"Environment (or None), got {self.environment!r}")
        object.__setattr__(self, "fields", tuple(self.fields))


_REGISTRY: dict[str, TaskKind] = {}


def register_task_kind(name: str, verify: Verifier, *, from_record: FromRecord | None = None,
                       to_record: ToRecord | None = None, fields: tuple[str, ...] = (),
                       environment: EnvironmentFactory | None = None, override: bool = False) -> TaskKind:
    """Registers (and returns) the kind `name`, so that `Task(kind=name)` is verified and loaded.

    JSONL records go through `from_record(record, task_id) -> Task` / `to_record(task) -> dict`
    (default: the generic prompt/answer/metadata record, `prompt_task_from_record` /
    `prompt_task_to_record`).

    Args:
      name: the kind's name, as written in `Task.kind` and a JSONL record's `kind`; a non-empty string.
      verify: `verify(task, final_text) -> float`, the kind's reward for the final assistant text.
      from_record: `from_record(record, task_id) -> Task` for JSONL records (the record has `kind` set);
        a ValueError it raises names the bad field. None: `prompt_task_from_record`.
      to_record: `to_record(task) -> dict`, the record's fields other than 'id' and 'kind'. None:
        `prompt_task_to_record`.
      fields: JSONL fields a record of this kind must have, checked before `from_record` with a
        line-numbered error.
      environment: the kind's default environment, a zero-argument factory returning an
        `Environment` (a class such as `FunctionCallingEnvironment` is one), called once per run
        whose tasks are all of this kind and that names no environment of its own
        (`AgenticRollout.environment`). None: the kind has none. Overriding a kind replaces it too.
      override: replace a kind already registered under `name` instead of raising.
    Returns:
      The registered `TaskKind`.
    Raises:
      ValueError: `name` is already registered and `override` is False, or `name` is not a
        non-empty string.
      TypeError: `verify`, `from_record`, `to_record` or a given `environment` is not callable, or
        `fields` is a string or holds a non-string.
    """
    kind = TaskKind(name, verify, from_record or prompt_task_from_record, to_record or prompt_task_to_record,
                    fields, environment)
    if name in _REGISTRY and not override:
        raise ValueError(f"task kind {name!r} is already registered; pass override=True to replace it")
    _REGISTRY[name] = kind
    return kind


def unregister_task_kind(name: str) -> TaskKind:
    """Removes (and returns) the kind `name` from the registry.

    Args:
      name: the registered kind's name.
    Returns:
      The `TaskKind` that was registered under `name`.
    Raises:
      UnknownTaskKindError: `name` is not registered.
    """
    kind = get_task_kind(name)
    del _REGISTRY[name]
    return kind


def registered_task_kinds() -> list[str]:
    """The registered kind names, sorted.

    Returns:
      A new sorted list of the names of all registered kinds (the built-in 'arithmetic',
      'countdown' and 'qa' once `builtin_kinds.py` is imported).
    """
    return sorted(_REGISTRY)


def get_task_kind(name: str) -> TaskKind:
    """The registered kind `name`.

    Args:
      name: the kind's name (`Task.kind`).
    Returns:
      The `TaskKind` registered under `name`.
    Raises:
      UnknownTaskKindError: `name` is not a registered kind (or not a string); the message lists
        the registered kinds and how to add one.
    """
    kind = _REGISTRY.get(name) if isinstance(name, str) else None
    if kind is None:
        raise UnknownTaskKindError(
            f"no verifier for kind {name!r}: the registered task kinds are {registered_task_kinds()}; add one "
            f"with sfrrl_jax.agents.register_task_kind({name!r}, verify), verify(task, final_text) -> float")
    return kind
