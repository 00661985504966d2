"""The RLTrainer's resumable state <-> a checkpoint's (device state, host state).

Everything a step reads that a later step depends on is saved, so a resumed run repeats the
uninterrupted run from the restored step on:

  device state  'params', 'opt_state' (AdamW moments and the applied-update counter that drives
                the learning-rate schedule). A LoRA run (`models.lora.AdaptedParams`) saves its
                adapter as 'params', never the base: that is read again from its HF directory.
  host state    'step' (RL steps done), 'params_version', 'tasks' (the TaskStream's seed, epoch and
                index: its permutation is a pure function of (seed, epoch), so this *is* its RNG),
                'longest_first' (the predicted group durations that order the launches),
                'carry_over' (one_step_off: the previous step's micro-batches, arrays and all),
                'rollout' (the rollout source's own state if it has one: `state_dict()` /
                `load_state_dict()`), 'config' (a fingerprint of the configs that shape the
                trajectory of the run, checked on resume).

Sampling randomness needs no saved key: the engine draws each request's tokens from the
request's own seed, which the agents derive from (seed, task, sample, turn).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from sfrrl_jax.checkpoints.orbax_store import abstract_of, check_json_exact
from sfrrl_jax.models.lora import frozen_part, join_parts, trained_part
from sfrrl_jax.rl.microbatch import MicroBatch, as_microbatch
from sfrrl_jax.trainer.rl_trainer import RLTrainer, MicroStepUnit

if TYPE_CHECKING:
    from sfrrl_jax.models.transformer import Params

HOST_FORMAT = 2  # 2: 'longest_first' (durations in seconds) replaced 'length_history' (tokens)


@dataclasses.dataclass
class RestoredGroup:
    """What a carried-over group contributes to a micro-step's accounting (not its trajectories)."""

    group_id: str
    params_version: int
    num_generated: int


def _array_to_json(a: np.ndarray) -> dict:
    a = np.asarray(a)
    # float32 -> Python float (float64) -> float32 is exact, so .tolist() round-trips bit for bit.
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.reshape(-1).tolist()}


def _array_from_json(obj: dict, where: str) -> np.ndarray:
    try:
        return np.asarray(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint host state {where} is not a saved array ({e})") from None


def _unit_to_json(unit: MicroStepUnit) -> dict:
    return {
        "groups": [{"group_id": str(g.group_id), "params_version": int(g.params_version),
                    "num_generated": int(g.num_generated)} for g in unit.groups],
        "batch": {k: _array_to_json(v) for k, v in sorted(as_microbatch(unit.batch).fields().items())},
    }


def _unit_from_json(obj: dict, where: str) -> MicroStepUnit:
    groups = [RestoredGroup(g["group_id"], int(g["params_version"]), int(g["num_generated"]))
              for g in obj["groups"]]
    batch = {k: _array_from_json(v, f"{where}.batch[{k!r}]") for k, v in obj["batch"].items()}
    return MicroStepUnit(groups, MicroBatch.from_mapping(batch))


_DEFAULTS = "__defaults__"


def config_fingerprint(**configs) -> dict:
    """JSON-exact description of frozen config dataclasses (and plain values), for resume checks.

    Each dataclass also records its fields' defaults under `__defaults__`, so a checkpoint written
    before a field existed still resumes while that field keeps its default (`diff_fingerprints`)."""
    def default_of(f):
        if f.default is not dataclasses.MISSING:
            return plain(f.default)
        if f.default_factory is not dataclasses.MISSING:
            return plain(f.default_factory())
        return None

    def plain(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            out = {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
            out[_DEFAULTS] = {f.name: default_of(f) for f in dataclasses.fields(x)}
            return out
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in sorted(x.items())}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        return repr(x)
    return {k: plain(v) for k, v in configs.items()}


def diff_fingerprints(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two fingerprints. A field the saved one lacks
    (added to the code after the checkpoint was written) counts only if it is not at its default."""
    out = []
    defaults = current.get(_DEFAULTS, {})
    for k in sorted((set(saved) | set(current)) - {_DEFAULTS}):
        if k not in saved and k in defaults and current[k] == defaults[k]:
            continue
        a, b, name = saved.get(k, "<absent>"), current.get(k, "<absent>"), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_fingerprints(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: checkpoint {a!r}, now {b!r}")
    return out


def trainer_state(trainer: RLTrainer, rollout: Any = None, fingerprint: dict | None = None) -> tuple[dict, dict]:
    """(device state, host state) of `trainer` at a step boundary, ready for `Checkpointer.maybe_save`.

    The host state is a deep copy: the async writer may serialise it after the loop moved on.

    Args:
      trainer: the RL trainer, between steps.
      rollout: the rollout source; its `state_dict()` is saved under 'rollout' if it has one (else None).
      fingerprint: `config_fingerprint(...)` of the configs that shape the run, checked on resume; None skips
        the check.
    Returns:
      `(state, host)`: the device state `{'params', 'opt_state'}` (the trainer's arrays, not copies; a LoRA
      run's 'params' are its adapter, the base is not saved), and the
      JSON-exact host state (module docstring).
    Raises:
      TypeError: when the host state would not survive a JSON round trip unchanged (e.g. the rollout's
        `state_dict()` holds a tuple or a non-str key).
    """
    state = {"params": trained_part(trainer.params), "opt_state": trainer.opt_state}   # LoRA: the adapter only
    host = {
        "format": HOST_FORMAT,
        "step": int(trainer.step_index),
        "params_version": int(trainer.params_version),
        "tasks": {"seed": int(trainer.tasks.seed), "num_tasks": len(trainer.tasks.tasks),
                  **{k: int(v) for k, v in trainer.tasks.state().items()}},
        "longest_first": trainer.longest_first.state_dict(),
        "carry_over": [_unit_to_json(u) for u in trainer.carry_over],
        "rollout": copy.deepcopy(rollout.state_dict()) if hasattr(rollout, "state_dict") else None,
        "config": copy.deepcopy(fingerprint) if fingerprint is not None else None,
    }
    check_json_exact(host, "trainer host state")
    return state, host


def abstract_trainer_state(params: Params, opt_state: Any) -> dict:
    """The restore target (shapes, dtypes, shardings) of `trainer_state`'s device state.

    Args:
      params: the model params (a nested dict of `jax.Array`, or `AdaptedParams`: then the adapter is the
        target), in the shardings to restore into.
      opt_state: the optimizer state pytree of arrays (`OptState`, or any optax state), likewise.
    Returns:
      `{'params': ..., 'opt_state': ...}` with every array replaced by its `jax.ShapeDtypeStruct` (shape,
      dtype, sharding), for `Checkpointer.restore` / `restore_latest`.
    """
    return {"params": abstract_of(trained_part(params)), "opt_state": abstract_of(opt_state)}


def check_resumable(host: dict, fingerprint: dict | None, num_tasks: int, where: str) -> None:
    """Raises ValueError naming what differs if the checkpoint was made by another configuration."""
    if host.get("format") != HOST_FORMAT:
        raise ValueError(f"{where}: trainer host state format {host.get('format')!r}, this code reads "
                         f"{HOST_FORMAT}")
    if host["tasks"]["num_tasks"] != num_tasks:
        raise ValueError(f"{where}: the task stream had {host['tasks']['num_tasks']} tasks when saved, "
                         f"now {num_tasks}: the data position would not mean the same")
    if fingerprint is not None and host.get("config") is not None:
        diffs = diff_fingerprints(host["config"], fingerprint)
        if diffs:
            raise ValueError(f"{where} was written by a different configuration; resuming would not "
                             "continue the same run. Differences: " + "; ".join(diffs))


def load_trainer_state(trainer: RLTrainer, state: dict, host: dict, rollout: Any = None) -> None:
    """Puts a restored (state, host) into `trainer` (and the rollout source's own state).

    Sets the trainer's params (also pushed to its engine with `set_params`), optimizer state, step,
    params version, task-stream position, longest-first durations and carried-over micro-batches.

    Args:
      trainer: the RL trainer to resume.
      state: the restored device state, `{'params', 'opt_state'}` (as `trainer_state` returns it).
      host: the restored host state (as `trainer_state` returns it); check it first with `check_resumable`.
      rollout: the rollout source; gets `load_state_dict(host['rollout'])` when the host state holds one.
    Returns:
      None: `trainer` (and `rollout`) are updated in place.
    Raises:
      ValueError: when a carried-over array is not a saved array, or the checkpoint holds rollout state but
        `rollout` has no `load_state_dict()`.
    """
    # a LoRA run restores its adapter onto the base it holds (read from its HF directory)
    trainer.params = join_parts(state["params"], frozen_part(trainer.params))
    trainer.opt_state = state["opt_state"]
    trainer.engine.set_params(trainer.params)
    trainer.step_index = int(host["step"])
    trainer.params_version = int(host["params_version"])
    t = host["tasks"]
    trainer.tasks.seed, trainer.tasks.epoch, trainer.tasks.index = int(t["seed"]), int(t["epoch"]), int(t["index"])
    trainer.longest_first.load_state_dict(host["longest_first"])
    trainer.carry_over = [_unit_from_json(u, f"carry_over[{i}]") for i, u in enumerate(host["carry_over"])]
    if host.get("rollout") is not None:
        if not hasattr(rollout, "load_state_dict"):
            raise ValueError("the checkpoint holds rollout state but the rollout source has no load_state_dict()")
        rollout.load_state_dict(host["rollout"])
