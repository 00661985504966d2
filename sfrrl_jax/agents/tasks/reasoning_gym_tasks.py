"""reasoning-gym's procedural task generators, scored by reasoning-gym's own scorers.

Kind 'reasoning_gym' (registered on import). A record is reasoning-gym's own entry, so a dataset
written with `json.dumps(entry)` loads as is:
    {"kind": "reasoning_gym", "question": str, "answer": str, "metadata": {"source_dataset": name, ...}}
(`dataset` may name the generator instead of `metadata.source_dataset`). The prompt is the question
plus `RG_INSTRUCTION`; the whole entry metadata is kept in `Task.metadata['entry_metadata']`.

`verify_reasoning_gym(task, final_text)`: the last `<answer>...</answer>` block (reasoning-gym's
own convention, `reasoning_gym.utils.extract_answer`), scored by the generator's `score_answer(answer,
entry)` in a fresh confined fork per answer (`isolated.ReasoningGymScorer`: some scorers eval the
answer, e.g. countdown's `sympy.parse_expr`); no block scores 0.0, and neither does an answer that
runs past the scorer's time or memory or makes it raise, nor one to a scorer that evaluates it
holding code that could write its own score (`answer_screen`). The value is the scorer's own, in [0, 1]:
most give 1.0 for a correct answer and 0.0 otherwise, but some give partial credit (gsm_symbolic
gives 0.01 to a wrong number, its reward for the format), which we keep so rewards match
reasoning-gym's published numbers.

`reasoning_gym_tasks(name, size, seed, **config)` generates tasks with `reasoning_gym.create_dataset`
(e.g. 'gsm_symbolic': GSM8K-style templated word problems; 'basic_arithmetic', 'chain_sum', ...).
"""
from __future__ import annotations

import atexit
from functools import lru_cache
from typing import Any

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tasks.answer_screen import EVALUATED_DATASETS, code_in_answer
from sfrrl_jax.agents.tasks.isolated import ReasoningGymScorer
from sfrrl_jax.agents.tasks.kinds import register_task_kind
from sfrrl_jax.agents.tasks.math_tasks import math_tool_environment
from sfrrl_jax.agents.tasks.verifiers import extract_answer

RG_INSTRUCTION = "Give the final answer as <answer>...</answer>."
INSTALL_HINT = "pip install 'sfrrl_jax[tasks]' (or: pip install reasoning-gym)"
# The answer is scored in a confined fork (isolated.ReasoningGymScorer): countdown's scorer evals it.
_SCORER = ReasoningGymScorer()
atexit.register(_SCORER.close)


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"reasoning-gym tasks need the reasoning-gym package: {INSTALL_HINT}") from e
    return reasoning_gym


@lru_cache(maxsize=None)
def _scorer(dataset: str):
    rg = _reasoning_gym()
    try:
        return rg.get_score_answer_fn(dataset)
    except ValueError:
        raise ValueError(f"reasoning-gym has no dataset {dataset!r}; known: "
                         f"{sorted(rg.factory.DATASETS)}") from None


def _entry(task: Task) -> dict:
    return {"question": task.metadata["question"], "answer": task.answer, "metadata": task.metadata["entry_metadata"]}


def verify_reasoning_gym(task: Task, final_text: str) -> float:
    """reasoning-gym's `score_answer` for the task's generator on the last <answer> block.

    The 'reasoning_gym' kind's verifier (module docstring): the answer is scored in a fresh confined fork
    (`isolated.ReasoningGymScorer`).

    Args:
      task: a 'reasoning_gym' task (`metadata` holds 'dataset', 'question' and 'entry_metadata').
      final_text: the model's final assistant text.
    Returns:
      The scorer's value in [0, 1]; 0.0 when the text has no <answer> block, when the scorer runs past its
      time or memory or raises, or when the answer holds code a scorer that evaluates it could run
      (`answer_screen`).
    Raises:
      ValueError: reasoning-gym has no generator named `task.metadata['dataset']`.
      ImportError: reasoning-gym is not installed.
      RuntimeError: the confined scoring process could not start.
    """
    answer = extract_answer(final_text)
    if answer is None:
        return 0.0
    dataset = task.metadata["dataset"]
    _scorer(dataset)   # an unknown dataset is the task's error, named here
    if dataset in EVALUATED_DATASETS and code_in_answer(answer) is not None:
        return 0.0   # it could write its own score inside the scorer (answer_screen)
    return _SCORER.score(dataset, answer, _entry(task))


def reasoning_gym_task(entry: dict, task_id: str, dataset: str | None = None) -> Task:
    """A task from one reasoning-gym entry ({'question', 'answer', 'metadata'})."""
    metadata = entry.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"field 'metadata' must be an object, got {type(metadata).__name__}")
    dataset = dataset or metadata.get("source_dataset")
    if not isinstance(dataset, str) or not dataset:
        raise ValueError("missing field 'dataset' (or 'metadata.source_dataset'): which reasoning-gym generator "
                         "scores this task")
    question, answer = entry["question"], entry["answer"]
    if not isinstance(question, str) or not question:
        raise ValueError(f"field 'question' must be a non-empty string, got {question!r}")
    if answer is None or isinstance(answer, (dict, list, bool)):
        raise ValueError(f"field 'answer' must be a string or number, got {answer!r}")
    return Task(task_id=task_id, kind="reasoning_gym", prompt=f"{question}\n\n{RG_INSTRUCTION}", answer=str(answer),
                metadata={"dataset": dataset, "question": question, "entry_metadata": metadata})


def _rg_from_record(record: dict, task_id: str) -> Task:
    return reasoning_gym_task(record, task_id, record.get("dataset"))


def _rg_to_record(task: Task) -> dict:
    return {"dataset": task.metadata["dataset"], **_entry(task)}


register_task_kind("reasoning_gym", verify_reasoning_gym, from_record=_rg_from_record, to_record=_rg_to_record,
                   fields=("question", "answer"), environment=math_tool_environment)


def reasoning_gym_tasks(name: str, size: int = 100, seed: int = 0, **config: Any) -> list[Task]:
    """`size` tasks from reasoning-gym's generator `name`, made with `reasoning_gym.create_dataset`.

    Deterministic in (name, size, seed, config).

    Args:
      name: the generator, a key of `reasoning_gym.factory.DATASETS` (e.g. 'gsm_symbolic', 'chain_sum').
      size: how many tasks to generate.
      seed: the generator's seed.
      **config: the generator's config keywords.
    Returns:
      `size` 'reasoning_gym' tasks with ids '<name>-<seed>-<i>', `i` from 0.
    Raises:
      ValueError: reasoning-gym has no generator `name`, or an entry it generated is malformed.
      ImportError: reasoning-gym is not installed.
    """
    rg = _reasoning_gym()
    if name not in rg.factory.DATASETS:
        raise ValueError(f"reasoning-gym has no dataset {name!r}; known: {sorted(rg.factory.DATASETS)}")
    data = rg.create_dataset(name, size=size, seed=seed, **config)
    return [reasoning_gym_task(entry, f"{name}-{seed}-{i}", name) for i, entry in enumerate(data)]
