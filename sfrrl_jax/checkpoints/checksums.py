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

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


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


def leaf_checksums(tree, names) -> dict[str, list[int]]:
    """{leaf name: [s1, s2]} for the array leaves of `tree` (see the module doc).

    Args:
      tree: a pytree of jax.Arrays (any sharding; a multi-process global array too).
      names: fn(path) -> the leaf's name (`orbax_store.leaf_name`).
    Returns:
      JSON-ready ints, one pair per leaf that has a fixed-width dtype (others are left out).
    """
    named = [(names(p), x) for p, x in jax.tree.leaves_with_path(tree) if _checksummable(x)]
    if not named:
        return {}
    sums = jax.device_get(_sums([x for _, x in named]))
    return {name: [int(v) for v in np.asarray(s)] for (name, _), s in zip(named, sums)}


def changed_leaves(tree, recorded: dict[str, list[int]], names) -> list[str]:
    """Names of the leaves of `tree` whose checksums differ from `recorded` (leaves `recorded`
    does not name are not checked: a checkpoint written before checksums were)."""
    now = leaf_checksums(tree, names)
    return sorted(name for name, sums in recorded.items() if name in now and now[name] != list(sums))

