"""What `RLTrainer` calls to roll out one sample, and the token budget such a function may declare.

    traj = await rollout_fn(engine, task, sample_index)

Any async callable of that shape is a `RolloutFn` (a plain `async def` function too). A rollout
function may also *declare* the most tokens one trajectory can hold (prompt, generated tokens and
tool observations together), duck-typed, as either

    rollout_fn.max_total_tokens               (e.g. `AgentRollout`, a property), or
    rollout_fn.agent_cfg.max_total_tokens     (an `agents.loop.AgentConfig` it runs with).

`RLTrainer` then checks, once, when it is built, the one length budget of a run:

    AgentConfig.max_total_tokens <= TrainerConfig.max_len <= ModelConfig.max_seq_len

(a trajectory must fit its KV-cache slot and a train row; the model's positions bound both).
A function that declares nothing is not checked: the engine cuts what outgrows `max_len`.

Across processes (multi-host) each process runs only its share of the groups. A rollout function
that keeps per-visit state (the k-th rollout of a (task, sample) draws fresh seeds) may define
`visited_elsewhere(task, sample_index)`: the trainer calls it for each rollout another process
ran, so every process counts every visit (`AgentRollout` and the test workload do).

A rollout function is user code: `call_rollout` calls one so that a SystemExit, KeyboardInterrupt
or GeneratorExit it raises comes out as a `UserCodeExit` (an Exception, which the trainer counts as
its group's failure) instead of ending the step; a cancellation of the caller still propagates.
`AgentRollout` itself never raises those (its loop contains them per sample).
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Protocol

from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.aio import UserCodeExit, own_cancellation


class RolloutFn(Protocol):
    """`async (engine, task, sample_index) -> Trajectory`; optionally declares `max_total_tokens`
    (an int attribute or property, or `agent_cfg.max_total_tokens`: see the module doc). A Protocol
    cannot mark an attribute optional, so the budget is read with `declared_token_budget`."""

    def __call__(self, engine: Any, task: Task, sample_index: int) -> Awaitable[Trajectory]: ...


async def call_rollout(rollout_fn: Any, engine: Any, task: Task, sample_index: int) -> Trajectory:
    """`await rollout_fn(engine, task, sample_index)`, with what it raises that is not an Exception
    (SystemExit, KeyboardInterrupt, GeneratorExit, a CancelledError nobody asked for) raised as a
    `UserCodeExit` naming it: see `sfrrl_jax.aio` for why that is safe."""
    try:
        return await rollout_fn(engine, task, sample_index)
    except Exception:
        raise
    except asyncio.CancelledError as e:
        if own_cancellation():
            raise
        raise UserCodeExit(e, "the rollout function") from e
    except BaseException as e:  # the rollout function's own (a real stop arrives as a cancellation)
        raise UserCodeExit(e, "the rollout function") from e


def declared_token_budget(rollout_fn: Any) -> int | None:
    """The `max_total_tokens` a rollout function declares (own attribute first, then its
    `agent_cfg`'s), or None when it declares none."""
    for owner in (rollout_fn, getattr(rollout_fn, "agent_cfg", None)):
        budget = getattr(owner, "max_total_tokens", None) if owner is not None else None
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int):
                raise TypeError(f"the rollout function's max_total_tokens must be an int, got {budget!r}")
            return budget
    return None


def check_length_budget(rollout_fn: Any, max_len: int, max_seq_len: int) -> None:
    """Raises ValueError unless max_total_tokens (if declared) <= max_len <= max_seq_len, naming
    all three fields and their values."""
    budget = declared_token_budget(rollout_fn)
    if max_len > max_seq_len or (budget is not None and budget > max_len):
        declared = "None (not declared)" if budget is None else str(budget)
        raise ValueError(
            f"length budget violated: AgentConfig.max_total_tokens={declared}, TrainerConfig.max_len={max_len}, "
            f"ModelConfig.max_seq_len={max_seq_len}; need max_total_tokens <= max_len <= max_seq_len "
            "(a trajectory must fit its KV-cache slot and a train row)")
