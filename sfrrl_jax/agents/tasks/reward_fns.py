"""Reward functions: plain callable values `fn(task, trajectory) -> float`, summed with weights.

    def short(task, trajectory):                   # any function of the task and the trajectory
        return -len(trajectory.final_text) / 1000

    env = ToolEnvironment([CalculatorTool()], prompt, reward_fns=[answer_correct, short],
                          reward_weights=[1.0, 0.1])

The trajectory's reward is `sum(w * fn(task, traj))` (in list order); each component's value,
unweighted, is recorded as `traj.metadata["rewards"][name]`, and `reward_component_means(trajs)`
gives the `reward/<name>` means `RLTrainer` logs each step over the step's trained trajectories
(TRL's `reward_funcs` / `reward_weights`, logged as `rewards/<name>`); 'mean' and 'success_rate'
are taken by the summed reward's metrics. A function's name is its `__name__`; `named(fn, name)` gives one to a lambda, a
partial or a callable object. A function that raises (anything: a `sys.exit()` or a
KeyboardInterrupt too, see `sfrrl_jax.aio`), or returns something that is not a finite number,
makes that sample an error (`Trajectory.error` names the function and what it raised); the batch
goes on.

A reward function may also be `async def` (its result awaited): the sum is then awaitable, and the
agent loop awaits it, so the loop's other trajectories decode and run tools meanwhile. A plain
function runs on the loop and holds it while it runs; `in_thread(fn)` runs a blocking one (a
verifier that waits on a process, a sandbox or a server) in a worker thread instead, for functions
safe to call from several threads at once (the built-in verifiers are: `answer_correct`'s math,
reasoning-gym and code verifiers each serve their callers through a locked child process or the
sandbox's own loop).

Built-in: `answer_correct` (the verifier of `task.kind` from the task-kind registry: the default,
what `ToolEnvironment` did before), `answer_format` (1 if the final text has an <answer> block),
`tool_error_penalty` (minus the fraction of tool calls that errored).
"""
from __future__ import annotations

import asyncio
import inspect
import math
from typing import Awaitable, Iterable, Sequence

from sfrrl_jax.agents.protocols import RewardFn, Task
from sfrrl_jax.agents.tasks.verifiers import extract_answer, task_reward
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.aio import describe, own_cancellation

__all__ = ["RESERVED_NAMES", "REWARDS_KEY", "RewardError", "RewardFn", "RewardSum", "answer_correct", "answer_format", "in_thread",
           "named", "reward_component_means", "reward_name", "tool_error_penalty"]

REWARDS_KEY = "rewards"  # Trajectory.metadata[REWARDS_KEY] = {name: unweighted value}
# reward/mean and reward/success_rate are the trainer's metrics of the summed reward
RESERVED_NAMES = frozenset({"mean", "success_rate"})


class RewardError(RuntimeError):
    """A reward function raised or returned a value that is not a finite number."""


def reward_name(fn: RewardFn) -> str:
    """The log name of `fn`: its `__name__` (a lambda's '<lambda>' is refused: name it; so are the
    names of the trainer's own reward metrics, `RESERVED_NAMES`)."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name or name == "<lambda>" or "/" in name:
        what = "a lambda" if name == "<lambda>" else f"{fn!r}"
        raise ValueError(f"reward function {what} has no usable name ({name!r}; a name is non-empty, without "
                         f"'/'): give it one with sfrrl_jax.agents.named(fn, 'my_reward')")
    if name in RESERVED_NAMES:
        raise ValueError(f"reward function name {name!r} would be logged as reward/{name}, which the trainer "
                         f"logs itself (the summed reward); rename it with sfrrl_jax.agents.named(fn, name)")
    return name


def named(fn: RewardFn, name: str) -> RewardFn:
    """`fn` under the log name `name` (same values): names a lambda, a partial or a callable object.

    Args:
      fn: the reward function, `fn(task, trajectory) -> float`.
      name: the log name (the component is logged as `reward/<name>`); non-empty, without '/', not
        one of `RESERVED_NAMES`.
    Returns:
      A plain function calling `fn`, with `__name__` `name` and `__wrapped__` `fn`.
    Raises:
      TypeError: `fn` is not callable.
      ValueError: `name` is not a usable name (empty, '<lambda>', holding '/', or reserved).
    """
    if not callable(fn):
        raise TypeError(f"named: fn must be callable, got {fn!r}")

    def reward(task: Task, trajectory: Trajectory) -> float:
        return fn(task, trajectory)

    reward.__name__ = reward.__qualname__ = name
    reward.__wrapped__ = fn  # type: ignore[attr-defined]
    reward_name(reward)  # refuse a bad name here, not when the environment is built
    return reward


def in_thread(fn: RewardFn, name: str | None = None) -> RewardFn:
    """`fn` as an async reward function that runs it in a worker thread (`asyncio.to_thread`).

    For a blocking `fn` that is safe to call from several threads at once: the agent loop goes on
    with the other trajectories while it runs.

    Args:
      fn: a synchronous reward function, `fn(task, trajectory) -> float`.
      name: the log name; None: `fn`'s own (`reward_name(fn)`).
    Returns:
      An `async def` reward function awaiting `fn(task, trajectory)` in a worker thread, with
      `__name__` the log name and `__wrapped__` `fn`.
    Raises:
      TypeError: `fn` is not callable, or is already a coroutine function.
      ValueError: the log name is not usable (see `named`): `name` is bad, or, with `name` None,
        `fn` has no usable `__name__` (a lambda).
    """
    if not callable(fn):
        raise TypeError(f"in_thread: fn must be callable, got {fn!r}")
    if inspect.iscoroutinefunction(fn):
        raise TypeError(f"in_thread: {fn!r} is already async (the loop awaits it without a thread)")

    async def reward(task: Task, trajectory: Trajectory) -> float:
        return await asyncio.to_thread(fn, task, trajectory)

    reward.__name__ = reward.__qualname__ = reward_name(fn) if name is None else name
    reward.__wrapped__ = fn  # type: ignore[attr-defined]
    reward_name(reward)  # refuse a bad name here, not when the environment is built
    return reward


def answer_correct(task: Task, trajectory: Trajectory) -> float:
    """The verifier of `task.kind` (`kinds.register_task_kind`) on the final assistant text.

    The default reward of `ToolEnvironment`.

    Args:
      task: the task; `task.kind` picks the verifier.
      trajectory: the finished trajectory; its `final_text` is verified.
    Returns:
      The verifier's value (`verifiers.task_reward`; the built-in verifiers give a value in [0, 1]).
    Raises:
      UnknownTaskKindError: `task.kind` is not registered.
    """
    return task_reward(task, trajectory.final_text)


def answer_format(task: Task, trajectory: Trajectory) -> float:
    """1.0 if the final assistant text has an <answer>...</answer> block, else 0.0.

    Args:
      task: the task (unused; part of the reward-function signature).
      trajectory: the finished trajectory; its `final_text` is read (`verifiers.extract_answer`).
    Returns:
      1.0 or 0.0.
    """
    return float(extract_answer(trajectory.final_text) is not None)


def tool_error_penalty(task: Task, trajectory: Trajectory) -> float:
    """-(tool calls that errored) / (tool calls), in [-1, 0]; 0.0 without calls.

    Args:
      task: the task (unused; part of the reward-function signature).
      trajectory: the finished trajectory; its `num_tool_errors` and `num_tool_calls` (over all
        turns) are read.
    Returns:
      Minus the fraction of the trajectory's tool calls that errored, in [-1, 0].
    """
    calls = trajectory.num_tool_calls
    return -trajectory.num_tool_errors / calls if calls else 0.0


def _finite_weight(i: int, w) -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise ValueError(f"reward_weights[{i}] must be a finite number, got {w!r}")
    return float(w)


class RewardSum:
    """`(task, trajectory) -> sum_i w_i * fn_i(task, trajectory)`, recording each fn's unweighted
    value in `trajectory.metadata["rewards"]` (only when all succeed). Checked when built: at least
    one fn, each callable and named (`named`), names distinct, one finite weight per fn (default 1)."""

    def __init__(self, reward_fns: Sequence[RewardFn], reward_weights: Sequence[float] | None = None):
        if callable(reward_fns) or isinstance(reward_fns, (str, bytes)) or not isinstance(reward_fns, Iterable):
            raise TypeError(f"reward_fns must be a list of reward functions, got {reward_fns!r} (wrap one in [...])")
        fns = tuple(reward_fns)
        if not fns:
            raise ValueError("reward_fns is empty: give at least one reward function")
        for i, fn in enumerate(fns):
            if not callable(fn):
                raise TypeError(f"reward_fns[{i}] must be callable (task, trajectory) -> float, got {fn!r}")
        names = tuple(reward_name(fn) for fn in fns)
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate reward function names {duplicates}: each is logged as reward/<name>, so "
                             f"give them distinct names with sfrrl_jax.agents.named(fn, name)")
        if reward_weights is None:
            weights = (1.0,) * len(fns)
        else:
            if isinstance(reward_weights, (str, bytes)) or not isinstance(reward_weights, Iterable):
                raise TypeError(f"reward_weights must be a list of numbers or None, got {reward_weights!r}")
            weights = tuple(reward_weights)
            if len(weights) != len(fns):
                raise ValueError(f"reward_weights has {len(weights)} entries for {len(fns)} reward_fns {list(names)}")
            weights = tuple(_finite_weight(i, w) for i, w in enumerate(weights))
        self.fns, self.names, self.weights = fns, names, weights

    def __repr__(self) -> str:
        return f"RewardSum({dict(zip(self.names, self.weights))})"

    def __call__(self, task: Task, trajectory: Trajectory) -> float | Awaitable[float]:
        """The weighted sum, or, where a reward function is async, an awaitable of it (the async
        functions' results awaited together)."""
        raws = []
        for name, fn in zip(self.names, self.fns):
            try:
                raws.append(fn(task, trajectory))
            except BaseException as e:  # a synchronous call: whatever it raises is its own, never a stop
                for pending in raws:  # never awaited: closed, so they warn of nothing
                    if inspect.iscoroutine(pending):
                        pending.close()
                raise RewardError(f"reward function {name!r} raised {describe(e)}") from e
        if any(inspect.isawaitable(raw) for raw in raws):
            return self._settle(task, trajectory, raws)
        return self._total(task, trajectory, raws)

    async def _settle(self, task: Task, trajectory: Trajectory, raws: list) -> float:
        async def value(name: str, raw):
            if not inspect.isawaitable(raw):
                return raw
            try:
                return await raw
            except asyncio.CancelledError as e:
                if own_cancellation():
                    raise  # the trajectory is being stopped
                raise RewardError(f"reward function {name!r} raised {describe(e)}") from e
            except BaseException as e:  # held here, in its own task: asyncio would re-raise a
                # SystemExit or KeyboardInterrupt leaving a task out of the event loop
                raise RewardError(f"reward function {name!r} raised {describe(e)}") from e
        # every one settles before the first error (in list order) is raised: none is left running
        values = await asyncio.gather(*map(value, self.names, raws), return_exceptions=True)
        for v in values:
            if isinstance(v, BaseException):
                raise v
        return self._total(task, trajectory, values)

    def _total(self, task: Task, trajectory: Trajectory, raws: Sequence) -> float:
        components: dict[str, float] = {}
        total = 0.0
        for name, raw, weight in zip(self.names, raws, self.weights):
            try:
                value = float(raw) if not isinstance(raw, (str, bytes)) else None
            except BaseException:  # a returned object's __float__ is user code too
                value = None
            if value is None:
                raise RewardError(f"reward function {name!r} returned {raw!r}, not a number")
            if not math.isfinite(value):
                raise RewardError(f"reward function {name!r} returned {value} for task {task.task_id}: rewards "
                                  f"must be finite")
            components[name] = value
            total += weight * value
        if not math.isfinite(total):
            raise RewardError(f"the weighted sum of the rewards {components} is {total}")
        trajectory.metadata[REWARDS_KEY] = components
        return total


def reward_component_means(trajectories: Iterable[Trajectory]) -> dict[str, float]:
    """`{"reward/<name>": mean}` of each recorded component (`metadata["rewards"]`).

    Args:
      trajectories: the trajectories (e.g. a training step's); failed ones (`error` set) are left
        out.
    Returns:
      For each component name recorded in any kept trajectory, the mean of its unweighted values
      over the trajectories that have it, keyed `reward/<name>`; keys sorted. Empty when none
      recorded any.
    """
    values: dict[str, list[float]] = {}
    for traj in trajectories:
        if traj.error is not None:
            continue
        for name, value in traj.metadata.get(REWARDS_KEY, {}).items():
            values.setdefault(name, []).append(float(value))
    return {f"reward/{name}": math.fsum(v) / len(v) for name, v in sorted(values.items())}
