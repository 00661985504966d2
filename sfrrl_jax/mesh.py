"""The one device mesh and the one table that maps logical axis names to its axes.

Every parameter and every annotated activation names its dimensions with *logical* names
(`embed`, `heads`, `experts`, ...). `LOGICAL_AXIS_RULES` is the only place that says which mesh
axis each logical name is sharded over; nothing else in the library names mesh axes for params.

Mesh axes:
  data    -- replicas of the params; the batch is split over it.
  expert  -- experts are split over it (expert parallelism); outside the MoE layer it acts as a
             further batch axis, so no device holds idle replicas of the attention work; when
             the rows do not split over it (one long trajectory per micro-step) it splits the
             sequence instead, ahead of `context` (`"seq"` lists it; see `logical_to_spec`).
  context -- a training sequence is split over it (context parallelism, `models.context_parallel`):
             activations [batch, seq, ...] shard their `seq` dim here; attention all-gathers the
             keys/values along it. Outside attention it is one more token axis (MoE, engine slots).
  tensor  -- dense weights (heads, mlp hidden, vocab) may be split over it.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

# The mesh's axis names: spelt here once, used everywhere by these constants (one assignment each,
# so the API reference sees each constant).
DATA_AXIS = "data"
"""Mesh axis of data parallelism: batch rows split over it."""
EXPERT_AXIS = "expert"
"""Mesh axis of expert parallelism: the experts' weight stacks split over it (and batch rows too)."""
CONTEXT_AXIS = "context"
"""Mesh axis of context parallelism: a training sequence split over it."""
TENSOR_AXIS = "tensor"
"""Mesh axis of tensor parallelism: heads and MLP width split over it."""
MESH_AXES = (DATA_AXIS, EXPERT_AXIS, CONTEXT_AXIS, TENSOR_AXIS)
BATCH_AXES = (DATA_AXIS, EXPERT_AXIS)  # the axes a batch's rows are split over
# The axes tokens are split over: rows over BATCH_AXES, then each row's sequence over `context`.
# A [batch, seq] array so sharded and flattened row-major is split over TOKEN_AXES in this order
# (the MoE layer's token shards; engine slots use them all too).
TOKEN_AXES = (DATA_AXIS, EXPERT_AXIS, CONTEXT_AXIS)

# Logical name -> mesh axis (or tuple of mesh axes, or None = replicated). One table.
LOGICAL_AXIS_RULES: Mapping[str, Any] = {
    "batch": BATCH_AXES,
    # `expert` first: it takes a share of the sequence only where `batch` could not use it
    # (rows not divisible over data x expert); then the sequence splits over (expert, context).
    "seq": (EXPERT_AXIS, CONTEXT_AXIS),
    "layers": None,
    "embed": None,
    "vocab": TENSOR_AXIS,
    "heads": TENSOR_AXIS,
    "kv_heads": TENSOR_AXIS,
    "head_dim": None,
    "latent": None,          # latent attention's compressed query / key-value dims (models.mla)
    "mlp": TENSOR_AXIS,
    "experts": EXPERT_AXIS,
    "experts_router": None,  # router logits are computed for all experts on every token shard
    "slots": TOKEN_AXES,
    "cache_len": None,
}


def make_mesh(
    data: int = 1,
    expert: int = 1,
    tensor: int = 1,
    devices: Sequence[jax.Device] | None = None,
    *,
    context: int = 1,
) -> Mesh:
    """Builds the single mesh `(data, expert, context, tensor)` over all (or the given) devices.

    Axis types are `Auto`: XLA propagates shardings through the dense parts, and the MoE layer
    enters `shard_map` explicitly. The product of the sizes must equal the device count.

    Args:
      data: size of the `data` axis (batch rows; the one that crosses hosts).
      expert: size of the `expert` axis (experts; also batch rows and sequence).
      tensor: size of the `tensor` axis (heads, MLP and vocab dims).
      devices: the devices to lay out (default: `jax.devices()`); sorted by (process, id), so each
        process's devices are contiguous on the leading axes.
      context: size of the `context` axis (sequence).
    Returns:
      The `Mesh` of shape `(data, expert, context, tensor)`, axes named `MESH_AXES`.
    Raises:
      ValueError: when a size is not a positive int, or their product differs from the device count.
    """
    sizes = {DATA_AXIS: data, EXPERT_AXIS: expert, CONTEXT_AXIS: context, TENSOR_AXIS: tensor}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"make_mesh: axis {name!r} must be a positive int, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    product = math.prod(sizes.values())
    if product != len(devices):
        raise ValueError(
            f"make_mesh: data={data} x expert={expert} x context={context} x tensor={tensor} = {product} devices, "
            f"but {len(devices)} devices are available ({devices[0].platform}); "
            "the product of the axis sizes must equal the device count"
        )
    # Keep process-local devices contiguous on the leading axes (multi-host: `data` crosses hosts,
    # `expert`/`context`/`tensor` stay within a host where possible).
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    arr = np.asarray(devices, dtype=object).reshape(data, expert, context, tensor)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(logical_axes: Sequence[str | None], rules: Mapping[str, Any] | None = None,
                    shape: Sequence[int] | None = None, mesh: Any = None) -> P:
    """Maps a tuple of logical names, one per dimension, to a `PartitionSpec` via the rules table.

    A mesh axis is used at most once per spec: a later dimension that maps to an axis already used
    stays replicated on it (e.g. `slots` and `batch` both want `data`). Given the array's `shape`
    and the `mesh`, a dimension takes an axis only where the mesh has it and it divides the
    dimension (with the axes it already took: 2 kv heads over tensor=4 stay replicated); an axis
    a dimension could not take stays free for a later one: [1, seq] `("batch", "seq")` on
    expert=4 splits seq over (expert, context).
    """
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(
                f"logical axis {name!r} has no rule; known logical axes: {sorted(rules)}"
            )
        target = rules[name]
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        axes = tuple(a for a in axes if a not in used)
        if shape is not None:
            dim, kept = shape[len(out)], []
            for a in axes:
                if a in mesh.shape and dim % (math.prod(mesh.shape[k] for k in kept) * mesh.shape[a]) == 0:
                    kept.append(a)
            axes = tuple(kept)
        used.update(axes)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return P(*out)


def seq_axes(mesh: Any, rows: int) -> tuple[str, ...]:
    """The mesh axes (of size > 1) a [rows, seq] training sequence is split over, in order: what
    `logical_to_spec(("batch", "seq"))` gives the seq dim for a seq long enough (context
    parallelism pads it to a multiple). () without a mesh."""
    if mesh is None or mesh.empty:
        return ()
    spec = logical_to_spec(("batch", "seq"), shape=(rows, 2 * math.prod(mesh.shape.values())), mesh=mesh)
    entry = tuple(spec)[1] if len(spec) > 1 else None
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(a for a in axes if mesh.shape[a] > 1)


def sharding_for(
    mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None
) -> NamedSharding:
    """`NamedSharding` for an array with these logical dims (fitted to `shape` if given)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape=shape, mesh=None if shape is None else mesh))


def shard_by_logical(tree: Any, logical_tree: Any, mesh: Mesh) -> Any:
    """Places every leaf of `tree` with the sharding its logical names give (same structure).

    `logical_tree` holds, for each leaf, a tuple of logical names (one per dim). Works for host
    numpy arrays and for `jax.Array`s (which are resharded if needed).

    Args:
      tree: a pytree of arrays (host numpy or `jax.Array`).
      logical_tree: the same structure with, for each leaf, a tuple of logical axis names or None, one per dim
        (e.g. `("batch", "seq")`); mapped to mesh axes by `LOGICAL_AXIS_RULES`, fitted to the leaf's shape.
      mesh: the mesh to place on.
    Returns:
      `tree` with every leaf a `jax.Array` in its `NamedSharding` (same structure).
    """
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
    shardings = jax.tree.map(
        lambda axes, leaf: sharding_for(mesh, axes, np.shape(leaf)), logical_tree, tree, is_leaf=is_axes
    )
    return jax.tree.map(jax.device_put, tree, shardings)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names, against the mesh in context.

    Outside a mesh context (or on a single device) this is the identity.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    spec = logical_to_spec(logical_axes, shape=x.shape, mesh=mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


_CONCRETE_MESH_IN_TRACE: contextvars.ContextVar = contextvars.ContextVar("concrete_mesh_in_trace", default=None)


def concrete_mesh_in_trace() -> Mesh | None:
    """The concrete mesh of params closed over inside a user's `jax.jit` (see `use_mesh_in_trace`)."""
    return _CONCRETE_MESH_IN_TRACE.get()


@contextlib.contextmanager
def use_mesh_in_trace(mesh: Mesh):
    """Inside a trace `jax.set_mesh` is refused; a model called there on params closed over
    (concrete arrays on `mesh`) runs under `mesh`'s abstract mesh, and its `shard_map`s take the
    concrete `mesh` from here so the outer jit learns the devices it must compile for."""
    token = _CONCRETE_MESH_IN_TRACE.set(mesh)
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            yield
    finally:
        _CONCRETE_MESH_IN_TRACE.reset(token)


HOST_MEMORY = "pinned_host"   # the memory kind of arrays parked in host memory (offload, swaps)
HOST_KINDS = ("pinned_host", "unpinned_host")


def in_device_memory(leaf) -> bool:
    """Whether an array (or a ShapeDtypeStruct with a sharding) lives in device memory: its
    sharding names no memory kind (the default) or a non-host one."""
    return (getattr(getattr(leaf, "sharding", None), "memory_kind", None) or "device") not in HOST_KINDS


def shard_bytes(leaf) -> int:
    """Bytes of one device's shard of `leaf` (a ShapeDtypeStruct or array with a sharding)."""
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def device_bytes(tree) -> int:
    """Per-device bytes of the leaves of `tree` that live in device memory."""
    return sum(shard_bytes(x) for x in jax.tree.leaves(tree) if in_device_memory(x))


def host_bytes(tree) -> int:
    """Per-device bytes of the leaves of `tree` placed in a host memory kind (pinned_host)."""
    return sum(shard_bytes(x) for x in jax.tree.leaves(tree) if not in_device_memory(x))


def with_memory_kind(shardings: Any, kind: str, asked_by: str) -> Any:
    """The same shardings in memory `kind` ('device', 'pinned_host', ...); refuses a kind the
    devices do not have, naming `asked_by` (the switch that asked for it)."""
    leaves = jax.tree.leaves(shardings)
    if leaves and kind != "device":
        device = next(iter(leaves[0].mesh.devices.flat))
        kinds = {m.kind for m in device.addressable_memories()}
        if kind not in kinds:
            raise ValueError(f"{asked_by}: {device.platform} devices have no {kind!r} "
                             f"memory (they have {sorted(kinds)}); turn {asked_by} off")
    return jax.tree.map(lambda sh: sh.with_memory_kind(kind), shardings)


def moved(tree: Any, shardings: Any, delete: bool = True) -> Any:
    """`tree` copied to `shardings` (typically another memory kind: pinned_host and back); with
    `delete` its old buffers are deleted once the copy has landed, so one copy is ever held and
    the freed memory is usable at once (device_put cannot donate across memory kinds)."""
    out = jax.device_put(tree, shardings)
    if not delete:
        return out
    jax.block_until_ready(out)
    for old, new in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
        if old is not new:
            old.delete()
    return out


def memory_limit(device=None) -> tuple[float, bool]:
    """(bytes, per_device): the device's memory limit, or on CPU the host's available memory
    (shared by every fake device: per_device False).

    Args:
      device: a jax device (default: this process's first; multi-host: stats exist for own devices only).
    """
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return float(stats["bytes_limit"]), True
    import psutil
    return float(psutil.virtual_memory().available), False
