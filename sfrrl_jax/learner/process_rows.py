"""A micro-batch whose rows come from every process (multi-host: each trains its own trajectories).

    batch = global_microbatch(local_rows, mesh)   # on every process, at the same point
    acc = ts.grad_microstep(params, acc, batch)

Each process passes the host arrays of its own rows, a `rl.MicroBatch` (`[rows_p, width_p]`;
per-row `advantages` may be `[rows_p]`), with the same fields and dtypes everywhere. One small
all-gather agrees on the shape: rows are padded to the largest count (rounded so the global rows
split evenly over the mesh's batch shards) with all-zero rows, which hold no loss token and so add
nothing to the gradient sums or the loss normaliser; columns are padded to the widest with zeros
after the sequence. The result is a `MicroBatch` of global `jax.Array`s `[P * rows, width]`, rows
sharded over the batch axes like the train step's own host batches, process p's rows at
`[p * rows, (p+1) * rows)` (`jax.make_array_from_process_local_data`). With one process it is the
host batch, padded.
"""
from __future__ import annotations

import math
import zlib
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from sfrrl_jax.learner.train_step import batch_sharding  # the train step's own batch layout
from sfrrl_jax.rl.microbatch import MicroBatch, as_microbatch
from sfrrl_jax.mesh import BATCH_AXES


def _agree(values: np.ndarray) -> np.ndarray:
    """[processes, len(values)]: every process's `values` (one all-gather; one process: itself)."""
    if jax.process_count() == 1:
        return values[None]
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(values))


def global_microbatch(local: MicroBatch | Mapping[str, np.ndarray], mesh: Mesh) -> MicroBatch:
    """Global micro-batch from this process's rows (module doc). Call it on every process.

    Args:
      local: this process's rows, a `rl.MicroBatch` (or a mapping `rl.as_microbatch` takes) of host
        arrays: every field `[rows_p, width_p]` like 'tokens' (trailing dims allowed, e.g. 'routes'
        `[rows_p, width_p, moe layers, top_k]`), or `[rows_p]` (per-row 'advantages'). The same
        fields and dtypes on every process.
      mesh: the train step's mesh (the params').
    Returns:
      A `MicroBatch` of global `jax.Array`s `[P * rows, width, ...]` (per-row fields `[P * rows]`),
      batch-sharded: P processes, rows the largest rows_p rounded up so the rows split over the
      batch shards, width the largest width_p; process p's rows at `[p * rows, p * rows + rows_p)`,
      zeros elsewhere.
    Raises:
      KeyError: when the rows have no 'tokens'. TypeError: `local` is neither a MicroBatch nor a mapping.
      ValueError: when a field's rows (or width) differ from 'tokens', or processes pass different
        fields or dtypes.
    """
    if isinstance(local, Mapping) and local.get("tokens") is None:
        raise KeyError(f"global_microbatch: the rows need 'tokens'; got {sorted(local)}")
    host = {k: np.asarray(v) for k, v in as_microbatch(local).fields().items()}   # the present fields
    rows, width = host["tokens"].shape
    for k, v in host.items():
        if v.shape[:1] != (rows,) or (v.ndim >= 2 and v.shape[1] != width):
            raise ValueError(f"global_microbatch: '{k}' has shape {v.shape}; rows are [{rows}, {width}, ...] "
                             f"(or [{rows}] for per-row advantages)")
    keys = sorted(host)
    # str hashes are salted per process: a checksum of the text is the same everywhere; trailing
    # dims past [rows, width] (routes: [moe layers, top_k]) must agree too
    signature = zlib.crc32(repr([(k, host[k].dtype.str, host[k].ndim, host[k].shape[2:]) for k in keys]).encode())
    shapes = _agree(np.array([rows, width, signature], np.int64))
    if len(set(shapes[:, 2])) != 1:
        raise ValueError(f"global_microbatch: processes pass different fields or dtypes (this one: "
                         f"{[(k, host[k].dtype.str) for k in keys]})")
    processes = shapes.shape[0]
    shards = int(np.prod([mesh.shape[a] for a in BATCH_AXES if a in mesh.shape]))
    step = shards // math.gcd(shards, processes)   # processes * rows_max must split over the shards
    rows_max = -(-int(shapes[:, 0].max()) // step) * step
    width_max = int(shapes[:, 1].max())
    out = {}
    for k in keys:
        v = host[k]
        padded = np.zeros((rows_max,) + ((width_max,) + v.shape[2:] if v.ndim >= 2 else ()), v.dtype)
        padded[tuple(slice(0, n) for n in v.shape)] = v
        global_shape = (processes * rows_max,) + padded.shape[1:]
        out[k] = jax.make_array_from_process_local_data(batch_sharding(mesh, global_shape), padded, global_shape)
    return MicroBatch.from_mapping(out)
