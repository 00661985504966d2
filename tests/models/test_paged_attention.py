"""The paged decode kernel (Pallas interpret mode on CPU) == the engine's gather path
(`paged_decode_reference`: a slot's pages copied into a [k_len] view, the new token's keys/values
overlaid, `layers.attend` with the cache mask), for every mask the engine's decode uses; it
lowers for a GPU (Triton) too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.models.paged_attention import check_paged_kernel, paged_decode_attention, paged_decode_reference

TOL = 1e-5


def _case(seed, b, h, kvh, d, page_size, n_units, pages_per_row, dtype=jnp.float32, cache_dtype=None):
    """Random queries and pool; each row's pages are distinct random units (rows share none)."""
    rng = np.random.default_rng(seed)
    cache_dtype = cache_dtype or dtype
    q = jnp.asarray(rng.normal(size=(b, h, d)), dtype)
    pool_k = jnp.asarray(rng.normal(size=(n_units, page_size, kvh, d)), cache_dtype)
    pool_v = jnp.asarray(rng.normal(size=(n_units, page_size, kvh, d)), cache_dtype)
    units = jnp.asarray(rng.permutation(n_units)[:b * pages_per_row].reshape(b, pages_per_row), jnp.int32)
    k_new = jnp.asarray(rng.normal(size=(b, kvh, d)), dtype)
    v_new = jnp.asarray(rng.normal(size=(b, kvh, d)), dtype)
    return q, pool_k, pool_v, units, k_new, v_new


# name, (batch, heads, kv_heads, head_dim, page_size, pages a row), q_pos, valid_len, window,
# sinks, k_len, block_k, splits. Positions sit on and off page and block edges on purpose.
CASES = [
    ("full_gqa2_pages4", (4, 4, 2, 16, 4, 12), [0, 5, 16, 47], None, 0, False, 48, 16, 1),
    ("window_sinks_gqa3", (3, 6, 2, 16, 8, 8), [7, 30, 63], None, 5, True, 64, 16, 1),
    ("window_gt_block_splits3", (3, 4, 1, 32, 4, 16), [9, 40, 63], None, 21, True, 64, 16, 3),
    ("splits_more_than_blocks", (2, 2, 2, 16, 16, 4), [3, 50], None, 0, False, 64, 64, 7),
    # valid_len below q_pos + 1 (a parked row's pending write) and a row past k_len (garbage in,
    # but finite); k_len below the table's pages
    ("valid_len_and_k_len", (4, 4, 2, 16, 4, 12), [10, 20, 30, 47], [5, 21, 30, 48], 0, True, 32, 16, 2),
    # a page larger than block_k; a group of 8 (no padding past 16 rows)
    ("big_page_gqa8", (2, 8, 1, 16, 32, 4), [31, 100], None, 64, False, 128, 16, None),
]


@pytest.mark.parametrize("name,dims,q_pos,valid_len,window,use_sinks,k_len,block_k,splits", CASES,
                         ids=[c[0] for c in CASES])
def test_kernel_equals_gather_path(name, dims, q_pos, valid_len, window, use_sinks, k_len, block_k, splits):
    b, h, kvh, d, page_size, pages = dims
    q, pool_k, pool_v, units, k_new, v_new = _case(1, b, h, kvh, d, page_size, b * pages + 3, pages)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    valid_len = q_pos + 1 if valid_len is None else jnp.asarray(valid_len, jnp.int32)
    sinks = jnp.asarray(np.random.default_rng(2).normal(size=(h,)), jnp.float32) if use_sinks else None
    got = paged_decode_attention(q, pool_k, pool_v, units, q_pos, valid_len, k_new, v_new, window, sinks,
                                 k_len=k_len, block_k=block_k, splits=splits, interpret=True)
    want = paged_decode_reference(q, pool_k, pool_v, units, q_pos, valid_len, k_new, v_new, window, sinks, k_len=k_len)
    live = np.asarray(q_pos < jnp.minimum(valid_len, k_len))   # the rows whose output a caller uses
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=TOL, rtol=TOL)


def test_traced_window_and_jit():
    """window may be a traced scalar (the layers' scan carries it); the call jits."""
    q, pool_k, pool_v, units, k_new, v_new = _case(3, 2, 4, 2, 16, 4, 20, 8)
    q_pos = jnp.asarray([13, 31], jnp.int32)

    @jax.jit
    def run(window):
        return paged_decode_attention(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new, window,
                                      k_len=32, block_k=16, interpret=True)
    for window in (0, 3, 17):
        want = paged_decode_reference(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new, window, None, k_len=32)
        np.testing.assert_allclose(np.asarray(run(window)), np.asarray(want), atol=TOL, rtol=TOL)


def test_bf16_inputs_over_f32_cache():
    """q in bf16 reading an f32 pool: the pool is read as bf16 (the gather path's astype)."""
    q, pool_k, pool_v, units, k_new, v_new = _case(4, 2, 4, 2, 16, 8, 10, 4, jnp.bfloat16, jnp.float32)
    q_pos = jnp.asarray([9, 30], jnp.int32)
    got = paged_decode_attention(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new, 0, k_len=32,
                                 block_k=16, interpret=True)
    want = paged_decode_reference(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new, 0, None, k_len=32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def test_mesh_rows_and_heads_split():
    """Under a data=2 x tensor=2 mesh the kernel runs per device (rows over data, kv heads over
    tensor) and returns the single-device result."""
    q, pool_k, pool_v, units, k_new, v_new = _case(5, 4, 8, 4, 16, 4, 40, 8)
    q_pos = jnp.asarray([3, 12, 20, 31], jnp.int32)
    sinks = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    want = paged_decode_reference(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new, 7, sinks, k_len=32)
    mesh = make_mesh(data=2, tensor=2, devices=jax.devices()[:4])
    pool_sharding = NamedSharding(mesh, P(None, None, "tensor", None))
    pool_k, pool_v = jax.device_put((pool_k, pool_v), pool_sharding)
    fn = jax.jit(lambda *a: paged_decode_attention(*a, 7, sinks, k_len=32, block_k=16, interpret=True))
    with jax.set_mesh(mesh):
        got = fn(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new)
        hlo = fn.lower(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new).compile().as_text()
    # each device reads its own half of the pool: the pool is never all-gathered
    assert "all-gather" not in hlo
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


def test_lowers_to_a_triton_kernel_for_gpu():
    """Compiled for a GPU (lowering only: this machine has none), the call is one Triton custom
    call: every block shape and op passes Pallas' Triton lowering rules."""
    q, pool_k, pool_v, units, k_new, v_new = _case(6, 2, 8, 2, 64, 16, 12, 6, jnp.bfloat16)
    q_pos = jnp.asarray([40, 90], jnp.int32)
    sinks = jnp.zeros((8,), jnp.float32)
    fn = jax.jit(lambda *a: paged_decode_attention(*a, 32, sinks, k_len=96, interpret=False))
    text = fn.trace(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]


def test_layout_checks():
    assert check_paged_kernel(16, 64) is None
    assert "page_size=12" in check_paged_kernel(12, 64)
    assert "head_dim=8" in check_paged_kernel(16, 8)
    q, pool_k, pool_v, units, k_new, v_new = _case(7, 1, 2, 1, 16, 4, 4, 2)
    pool_k3 = jnp.zeros((4, 3, 1, 16))
    with pytest.raises(ValueError, match="page_size=3"):
        paged_decode_attention(q, pool_k3, pool_k3, units, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                               k_new, v_new, k_len=4, interpret=True)


def test_vmap_over_an_extra_axis():
    """jax.vmap of the call over a leading axis of q, k_new, v_new equals the calls one by one."""
    q, pool_k, pool_v, units, k_new, v_new = _case(8, 2, 4, 2, 16, 4, 20, 8)
    q_pos = jnp.asarray([5, 20], jnp.int32)

    def one(q, k_new, v_new):
        return paged_decode_attention(q, pool_k, pool_v, units, q_pos, q_pos + 1, k_new, v_new, 0, k_len=32,
                                      block_k=16, interpret=True)
    qs, ks, vs = jnp.stack([q, 0.5 * q, -q]), jnp.stack([k_new, -k_new, k_new]), jnp.stack([v_new, v_new, 2 * v_new])
    got = jax.vmap(one)(qs, ks, vs)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(one(qs[i], ks[i], vs[i])), atol=TOL, rtol=TOL)
