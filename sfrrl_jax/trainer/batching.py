"""Finished groups of trajectories -> advantages -> train micro-batches.

A micro-batch holds whole groups, one trajectory per row, right-padded to a multiple of
`seq_bucket` (a bounded number of shapes, so the micro-step compiles a bounded number of times).
Arrays are aligned to the token they belong to, as the train step expects: `rollout_logprobs[t]`
is the engine's log-prob of `tokens[t]`; `loss_mask` is 1 exactly on policy-generated tokens.

A trajectory supplies the fields in `TRAJECTORY_FIELDS`; a micro-batch carries those the train
step's loss reads (`batch_fields(loss)`: its required fields, the optional ones trajectories
supply, and `segment_ids`). A loss that requires anything else cannot train on trajectories:
`batch_fields` raises naming the field.

Routing replay (`Loss.routing_replay='r3'`): the batch also carries 'routes' [rows, T, moe layers,
top_k] int16 (the engine's experts, `Trajectory.routes`) and 'routes_mask' [rows, T] int32 (1
where the engine recorded them); `route_dims` = (moe layers, top_k) gives the shape of rows
without routes. A trajectory with loss tokens but no routes raises, naming it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.rl.advantages import compute_advantages
from sfrrl_jax.rl.config import AdvantageConfig
from sfrrl_jax.rl.loss_fn import Loss

# What a micro-batch built from trajectories can carry, with each field's dtype (all [rows, T]).
TRAJECTORY_FIELDS = {"tokens": np.int32, "loss_mask": np.float32, "advantages": np.float32,
                     "rollout_logprobs": np.float32, "segment_ids": np.int32}
# Under routing replay: 'routes' [rows, T, moe layers, top_k], 'routes_mask' [rows, T].
ROUTE_FIELDS = {"routes": np.int16, "routes_mask": np.int32}


@dataclasses.dataclass
class Group:
    """The G trajectories of one prompt, with the params version that generated them."""

    group_id: str
    trajectories: list[Trajectory]
    params_version: int
    launch_index: int = 0  # order of launch within its step (longest expected first)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([t.reward if t.reward is not None else 0.0 for t in self.trajectories], np.float32)

    @property
    def num_generated(self) -> int:
        return sum(int(np.sum(t.loss_mask)) for t in self.trajectories)


@dataclasses.dataclass(frozen=True)
class TokenShare:
    """The generated tokens of some rows of a group (a micro-batch that splits a group)."""

    group_id: str
    params_version: int
    num_generated: int


def group_advantages(groups: Sequence[Group], cfg: AdvantageConfig) -> np.ndarray:
    """[groups, G] per-sample advantages of these groups: `rl.compute_advantages` (the one
    definition), returned as host numpy.

    This is called on the event-loop thread while the engine's driver thread may be running
    multi-device steps: the few element-wise ops run on one host CPU device, never as a
    multi-device program of the mesh (see `_host_device`).
    """
    rewards = np.stack([g.rewards for g in groups]).astype(np.float32)
    with jax.default_device(_host_device()):
        return np.asarray(compute_advantages(jnp.asarray(rewards), cfg))


@functools.lru_cache(maxsize=1)
def _host_device():
    """A CPU device for host-side arithmetic (with GPUs: the CPU backend, apart from them)."""
    try:
        return jax.local_devices(backend="cpu")[0]  # this process's own (multi-host: not process 0's)
    except RuntimeError:  # no CPU backend initialised (jax_platforms without cpu)
        return jax.local_devices()[0]


def group_advantage_slopes(groups: Sequence[Group], cfg: AdvantageConfig) -> np.ndarray:
    """[groups] d advantage / d reward of each group: the group estimators are affine in the reward,
    A_i = slope * (r_i - r_j) + A_j for any two samples i, j of a group (`learner.deferred` needs it)."""
    rewards = np.stack([g.rewards for g in groups]).astype(np.float32)
    g = rewards.shape[-1]
    if cfg.estimator == "grpo":
        std = rewards.std(axis=-1, ddof=cfg.std_ddof) if g - cfg.std_ddof > 0 else np.zeros(len(groups))
        return (1.0 / (std + np.float32(cfg.eps))).astype(np.float32)
    if cfg.estimator == "dr_grpo":
        return np.ones(len(groups), np.float32)
    if cfg.estimator == "rloo":
        return np.full(len(groups), 0.0 if g == 1 else g / (g - 1), np.float32)
    raise ValueError(f"advantage estimator {cfg.estimator!r} is not a per-group affine function of the "
                     "reward; advantage-deferred gradients need one of grpo, dr_grpo, rloo")


def batch_fields(loss: Loss) -> tuple[str, ...]:
    """The fields of the micro-batches built for `loss` (a `rl.Loss`, e.g. `TrainStep.loss`): its
    required fields, the optional ones a trajectory supplies, and 'segment_ids' (rows are padded),
    in `TRAJECTORY_FIELDS` order. Raises ValueError naming any required field that trajectories
    do not supply (they supply exactly `TRAJECTORY_FIELDS`)."""
    missing = [k for k in loss.required_fields if k not in TRAJECTORY_FIELDS]
    if missing:
        raise ValueError(f"the loss {loss.name!r} requires {missing} (Loss.required_fields="
                         f"{list(loss.required_fields)}), which micro-batches built from trajectories do not "
                         f"carry: they carry {list(TRAJECTORY_FIELDS)}")
    wanted = set(loss.fields) | {"segment_ids"}
    replay = tuple(ROUTE_FIELDS) if loss.routing_replay == "r3" else ()
    return tuple(k for k in TRAJECTORY_FIELDS if k in wanted) + replay


def zero_microbatch(fields: Sequence[str], rows: int, width: int,
                    route_dims: tuple[int, int] | None = None) -> dict:
    """All-zero [rows, width] arrays of `fields` (dtypes of `TRAJECTORY_FIELDS`; 'routes' is
    [rows, width, *route_dims]): a compile warm-up batch with the keys, shapes and dtypes real
    micro-batches of those fields have."""
    _check_fields(fields, route_dims)
    dtypes = {**TRAJECTORY_FIELDS, **ROUTE_FIELDS}
    return {k: np.zeros((rows, width) + (tuple(route_dims) if k == "routes" else ()), dtypes[k]) for k in fields}


def _check_fields(fields: Sequence[str], route_dims=None) -> None:
    unknown = [k for k in fields if k not in TRAJECTORY_FIELDS and k not in ROUTE_FIELDS]
    if unknown:
        raise ValueError(f"micro-batch fields {unknown} cannot be built from trajectories; they carry "
                         f"{list(TRAJECTORY_FIELDS) + list(ROUTE_FIELDS)}")
    if "routes" in fields and (route_dims is None or len(route_dims) != 2):
        raise ValueError(f"micro-batch field 'routes' needs route_dims=(moe layers, top_k), got {route_dims!r}")


def microbatch_from_trajectories(trajs: Sequence[Trajectory], advantages: np.ndarray, seq_bucket: int,
                                 max_len: int, fields: Sequence[str] | None = None,
                                 route_dims: tuple[int, int] | None = None) -> dict:
    """Host arrays [rows, T] for `grad_microstep`, one row per trajectory, T = the longest rounded up
    to `seq_bucket`; `advantages` holds one value per trajectory (spread over the row's loss tokens).
    fields: the keys to return (`batch_fields(loss)`; a field trajectories do not carry raises
    ValueError naming it); None: every field in `TRAJECTORY_FIELDS`. route_dims: (moe layers,
    top_k) of 'routes' (needed when fields hold it; see the module doc)."""
    fields = tuple(TRAJECTORY_FIELDS) if fields is None else tuple(fields)
    _check_fields(fields, route_dims)
    adv = np.asarray(advantages, np.float32).reshape(-1)
    if len(adv) != len(trajs):
        raise ValueError(f"{len(adv)} advantages for {len(trajs)} trajectories")
    longest = max(len(t.tokens) for t in trajs)
    width = min(max(seq_bucket, -(-longest // seq_bucket) * seq_bucket), max(max_len, longest))
    rows = len(trajs)
    tokens = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, width), np.float32)
    logp = np.zeros((rows, width), np.float32)
    seg = np.zeros((rows, width), np.int32)
    for i, t in enumerate(trajs):
        n = len(t.tokens)
        tokens[i, :n] = t.tokens
        mask[i, :n] = t.loss_mask
        logp[i, :n] = t.rollout_logprobs
        seg[i, :n] = 1
    out = {"tokens": tokens, "loss_mask": mask, "advantages": adv[:, None] * mask,
           "rollout_logprobs": logp, "segment_ids": seg}
    if "routes" in fields or "routes_mask" in fields:
        out["routes"], out["routes_mask"] = _routes(trajs, width, route_dims)
    return {k: out[k] for k in fields}


def _routes(trajs: Sequence[Trajectory], width: int, route_dims) -> tuple[np.ndarray, np.ndarray]:
    """[rows, width, *route_dims] int16 routes and the [rows, width] int32 mask of where they hold."""
    routes = np.zeros((len(trajs), width) + tuple(route_dims), ROUTE_FIELDS["routes"])
    held = np.zeros((len(trajs), width), ROUTE_FIELDS["routes_mask"])
    for i, t in enumerate(trajs):
        if t.routes is None:
            if any(t.loss_mask):  # (a failed trajectory's mask is all zeros)
                raise ValueError(f"trajectory {t.task_id}/{t.sample_index} has no routes but routing replay "
                                 "trains on them: the engine must record them (Engine(record_routes=True)) and the rollout "
                                 "keep them (TrajectoryBuilder.append_completion)")
            continue
        if t.routes.shape[1:] != tuple(route_dims):
            raise ValueError(f"trajectory {t.task_id}/{t.sample_index}: routes {t.routes.shape} are not "
                             f"[tokens, {route_dims[0]} moe layers, top_k {route_dims[1]}]")
        n = min(len(t.routes), width)
        routes[i, :n] = t.routes[:n]
        held[i, :n] = 1
    return routes, held
