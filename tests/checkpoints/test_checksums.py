"""Per-leaf checksums of a checkpoint (checkpoints/checksums.py): exact values from the arrays' bits,
the same on any mesh, in device or host memory, and changed by any one flipped bit."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.checkpoints import checksums
from sfrrl_jax.checkpoints.checksums import changed_leaves, leaf_checksums
from sfrrl_jax.checkpoints.orbax_store import leaf_name
from sfrrl_jax.mesh import HOST_MEMORY


def _reference(a: np.ndarray) -> list[int]:
    """The module doc's definition, in numpy: wrap-around sums of the uint32 words."""
    a = np.asarray(a)
    words = (a.astype(np.uint64) if a.dtype == np.bool_ else
             a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.uint64)).reshape(-1)
    odd = np.arange(words.size, dtype=np.uint64) * 2 + 1
    return [int(words.sum() % 2**32), int((words * odd).sum() % 2**32)]


def _tree():
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(16, 12)).astype(np.float32),
            "b": rng.normal(size=(24,)).astype(jnp.bfloat16),
            "step": np.int32(7), "mask": rng.random((8, 3)) > 0.5, "q": rng.integers(0, 255, (8, 8)).astype(np.uint8)}


def test_checksums_are_the_defined_sums_on_any_mesh_and_in_host_memory(monkeypatch):
    tree = _tree()
    want = {k: _reference(v) for k, v in tree.items()}
    one = jax.tree.map(jnp.asarray, tree)
    assert leaf_checksums(one, leaf_name) == want
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    spec = {"w": P("a", "b"), "b": P("a"), "step": P(), "mask": P("a", None), "q": P(None, "b")}
    sharded = {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in tree.items()}
    assert leaf_checksums(sharded, leaf_name) == want
    on_host = {k: jax.device_put(v, NamedSharding(mesh, spec[k], memory_kind=HOST_MEMORY)) for k, v in tree.items()}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(on_host)} == {HOST_MEMORY}
    assert leaf_checksums(on_host, leaf_name) == want   # summed on the host, shard by shard
    monkeypatch.setattr(checksums, "_HOST_BLOCK_ELEMENTS", 7)   # and in blocks of a few rows
    assert leaf_checksums(on_host, leaf_name) == want


def test_any_flipped_bit_and_a_swap_change_the_checksums():
    tree = _tree()
    recorded = leaf_checksums(jax.tree.map(jnp.asarray, tree), leaf_name)
    w = tree["w"]
    for bit in (0, 12, 23, 31):   # mantissa, exponent, sign
        flipped = w.copy()
        flipped.view(np.uint32)[5, 7] ^= np.uint32(1 << bit)
        assert changed_leaves({**tree, "w": jnp.asarray(flipped)}, recorded, leaf_name) == ["w"], bit
    swapped = w.copy()
    swapped[[2, 3]] = swapped[[3, 2]]   # the same words in other places: s1 equal, s2 not
    assert changed_leaves({**tree, "w": jnp.asarray(swapped)}, recorded, leaf_name) == ["w"]
    assert changed_leaves(jax.tree.map(jnp.asarray, tree), recorded, leaf_name) == []
    # a checkpoint written before checksums existed records none: nothing to compare
    assert changed_leaves({**tree, "w": jnp.asarray(swapped)}, {}, leaf_name) == []
