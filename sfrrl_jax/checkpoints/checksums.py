"""Content checksums of a state's arrays: a flipped bit in a checkpoint is caught at restore.

Orbax checks that a checkpoint's files are there and decode; a bit flipped inside a weight (a bad
disk sector, a stray write) decodes to a finite, plausible number and restores silently. So each
save records two 32-bit checksums per leaf, computed on the devices from the arrays' bits, and a
restore recomputes them from what it read.

For a leaf whose bits, read as unsigned words w_i (i = the element's row-major position), are
summed with wrap-around:

    s1 = sum_i w_i            mod 2**32
    s2 = sum_i w_i * (2i + 1) mod 2**32

Integer sums with wrap-around are exact in any order, so the checksums do not depend on the mesh
or sharding a state was saved or restored on. Any change of one word changes s1 (a flipped bit
changes its word by +-2**k, k < 32); the odd weight keeps s2 sensitive to it too, and s2 also
changes when words swap places. Elements narrower than 32 bits are zero-extended; 64-bit ones
count as two words.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sfrrl_jax.mesh import in_device_memory

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
# Elements of a host-memory leaf summed at a time (`_host_sums`).
_HOST_BLOCK_ELEMENTS = 1 << 22


def _words(x: jax.Array) -> jax.Array:
    """x's bits as uint32 words, shape x.shape (x.shape + (2,) for 64-bit elements)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _position(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position, uint32 with wrap-around, built per axis so that the
    array keeps its sharding (no reshape to one dimension)."""
    pos = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        pos = pos + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return pos


@jax.jit
def _sums(leaves):
    out = []
    for x in leaves:
        w = _words(x)
        odd = _position(w.shape) * jnp.uint32(2) + jnp.uint32(1)
        out.append(jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)]))
    return out


def _checksummable(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return (isinstance(x, jax.Array) and dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            and (dtype == jnp.bool_ or np.dtype(dtype).itemsize in (1, 2, 4, 8)))


def _host_words(data: np.ndarray) -> np.ndarray:
    """numpy's `_words`: the bits as uint64 holding uint32 words (64-bit elements: two, low first)."""
    if data.dtype == np.bool_:
        return data.astype(np.uint64)
    size = data.dtype.itemsize
    if size == 8:
        return data.view(np.uint32).reshape(data.shape + (2,)).astype(np.uint64)
    return data.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint64)


def _host_sums(x: jax.Array) -> np.ndarray:
    """[s1, s2] of a leaf in host memory (an offloaded optimizer state), summed on the host over
    this process's shards (each element once: replica 0 only), as uint64 partial sums mod 2**64
    (= mod 2**32 once reduced). Device programs cannot read host-memory arrays next to iotas in
    device memory, and copying the leaf to the device would undo its offload."""
    wide = x.shape + ((2,) if np.dtype(x.dtype).itemsize == 8 else ())
    strides = [int(np.prod(wide[d + 1:], dtype=np.int64)) for d in range(len(wide))]
    out = np.zeros(2, np.uint64)
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        data = np.asarray(shard.data)
        ranges = [(shard.index[d] if d < len(shard.index) else slice(None)).indices(dim)[:2]
                  for d, dim in enumerate(wide)]
        # In blocks of leading rows: the uint64 words and positions of a whole offloaded leaf
        # would be four times its size in host memory at once.
        rows = data.shape[0] if data.ndim else 1
        step = max(1, _HOST_BLOCK_ELEMENTS // max(1, data.size // max(rows, 1)))
        for r0 in range(0, rows, step):
            block = data[r0:r0 + step] if data.ndim else data
            words = _host_words(block)
            pos = np.zeros((), np.uint64)
            for d, (lo, hi) in enumerate(ranges):
                if d == 0:
                    lo, hi = lo + r0, min(hi, lo + r0 + step)
                axis = np.arange(lo, hi, dtype=np.uint64) * np.uint64(strides[d])
                pos = pos[..., None] + axis if d else axis
            with np.errstate(over="ignore"):   # wrap-around is the point
                out += np.array([words.sum(dtype=np.uint64),
                                 (words * (pos * np.uint64(2) + np.uint64(1))).sum(dtype=np.uint64)], np.uint64)
    return out


def leaf_checksums(tree, names) -> dict[str, list[int]]:
    """{leaf name: [s1, s2]} for the array leaves of `tree` (see the module doc).

    Leaves in device memory are summed by one jitted program; leaves in host memory (an
    offloaded optimizer state) on the host, each process over its shards, then across processes.
    Every process must call it (a collective, like the save it belongs to).

    Args:
      tree: a pytree of jax.Arrays (any sharding; a multi-process global array too).
      names: fn(path) -> the leaf's name (`orbax_store.leaf_name`).
    Returns:
      JSON-ready ints, one pair per leaf that has a fixed-width dtype (others are left out).
    """
    named = [(names(p), x) for p, x in jax.tree.leaves_with_path(tree) if _checksummable(x)]
    on_device = [(n, x) for n, x in named if in_device_memory(x)]
    on_host = [(n, x) for n, x in named if not in_device_memory(x)]
    out = {}
    if on_device:
        sums = jax.device_get(_sums([x for _, x in on_device]))
        out.update({name: [int(v) for v in np.asarray(s)] for (name, _), s in zip(on_device, sums)})
    if on_host:
        partial = np.stack([_host_sums(x) for _, x in on_host]) % np.uint64(2**32)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            partial = np.asarray(multihost_utils.process_allgather(partial.astype(np.uint32))).astype(
                np.uint64).sum(axis=0)
        out.update({name: [int(v) % 2**32 for v in row] for (name, _), row in zip(on_host, partial)})
    return dict(sorted(out.items()))


def changed_leaves(tree, recorded: dict[str, list[int]], names) -> list[str]:
    """Names of the leaves of `tree` whose checksums differ from `recorded` (leaves `recorded`
    does not name are not checked: a checkpoint written before checksums were)."""
    now = leaf_checksums(tree, names)
    return sorted(name for name, sums in recorded.items() if name in now and now[name] != list(sums))

