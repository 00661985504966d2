"""The experts' grouped matmul: the tiled loop computes what `ragged_dot` computes (values, both
gradients, under jit and vmap), whatever the group sizes (empty groups, groups inside one tile,
groups across tile edges, rows past the last group), and 'auto' tiles only large products."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.models import grouped_matmul as gm
from sfrrl_jax.models import moe as moe_lib

from model_fixtures import TINY_GPT_OSS, randomize

IMPLS = ("tiled", "ragged_dot_tiled_wgrad")


def _case(sizes, m, k=24, n=40, seed=0, dtype=np.float32):
    rng = np.random.RandomState(seed)
    rows = rng.randn(m, k).astype(dtype)
    w = rng.randn(len(sizes), k, n).astype(dtype)
    probe = rng.randn(m, n).astype(np.float32)
    return jnp.asarray(rows), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), jnp.asarray(probe)


def _value_and_grads(impl, rows, w, sizes, probe):
    def loss(r, v):
        return jnp.sum(gm.grouped_matmul(r, v, sizes, impl).astype(jnp.float32) * probe)
    out = jax.jit(lambda r, v: gm.grouped_matmul(r, v, sizes, impl))(rows, w)
    return (out,) + jax.jit(jax.grad(loss, argnums=(0, 1)))(rows, w)


# tile = min(128, m): sizes chosen against a 128-row tile (and m < 128 for the small cases)
SIZES = {
    "empty groups and a tail past the sum": ([0, 130, 0, 257, 1, 0], 420),
    "every group inside one tile": ([5, 0, 17, 3], 30),
    "one group, whole matrix": ([300], 300),
    "exact tile multiples": ([128, 256, 0, 128], 512),
    "all rows padding": ([0, 0, 0], 50),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(SIZES))
def test_tiled_equals_ragged_dot_values_and_grads(impl, name):
    sizes, m = SIZES[name]
    rows, w, gs, probe = _case(sizes, m)
    ref = _value_and_grads("ragged_dot", rows, w, gs, probe)
    got = _value_and_grads(impl, rows, w, gs, probe)
    for what, a, b in zip(("out", "d_rows", "d_w"), ref, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-4, err_msg=what)
    used = int(sum(sizes))
    assert not np.any(np.asarray(got[0])[used:]), "rows past the last group must be zero"


def test_tiled_bf16_matches_ragged_dot():
    rows, w, gs, probe = _case([70, 0, 200, 30], 320, seed=3)
    rows, w = rows.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    ref = _value_and_grads("ragged_dot", rows, w, gs, probe)
    got = _value_and_grads("tiled", rows, w, gs, probe)
    for what, a, b in zip(("out", "d_rows", "d_w"), ref, got):
        assert b.dtype == a.dtype, what
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # both accumulate in f32 and round once to bf16: at most a bf16 ulp or two apart
        assert np.max(np.abs(a - b)) <= 2 ** -6 * max(1.0, np.max(np.abs(a))), what


def test_tiled_under_vmap_with_per_example_groups():
    rows, w, _, probe = _case([1], 150, seed=5)
    batch_rows = jnp.stack([rows, rows[::-1]])
    batch_sizes = jnp.asarray([[100, 0, 50], [10, 130, 0]], jnp.int32)
    w3 = jnp.concatenate([w, w * 2, w - 1])
    for impl in IMPLS:
        f = lambda r, s: gm.grouped_matmul(r, w3, s, impl)
        got = jax.vmap(f)(batch_rows, batch_sizes)
        ref = jnp.stack([gm.grouped_matmul(batch_rows[i], w3, batch_sizes[i]) for i in range(2)])
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-4)
        g = jax.grad(lambda v: jnp.sum(jax.vmap(lambda r, s: gm.grouped_matmul(r, v, s, impl))(
            batch_rows, batch_sizes)))(w3)
        g_ref = jax.grad(lambda v: jnp.sum(jax.vmap(lambda r, s: gm.grouped_matmul(r, v, s))(
            batch_rows, batch_sizes)))(w3)
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-3)


def test_tiled_lowering_has_no_dense_expansion():
    """The point of tiling: no [groups, rows, ...] buffer in the compiled program (ragged_dot's
    has one on CPU), and temp memory a small multiple of one [rows, n] matrix."""
    g, m, k, n = 16, 2048, 64, 64
    rows, w, gs, _ = _case([m // g] * g, m, k=k, n=n)
    temps = {}
    for impl in ("ragged_dot", "tiled"):
        grad = jax.jit(jax.grad(lambda r, v: jnp.sum(gm.grouped_matmul(r, v, gs, impl)), argnums=(0, 1)))
        temps[impl] = grad.lower(rows, w).compile().memory_analysis().temp_size_in_bytes
    one_matrix = m * n * 4
    assert temps["tiled"] <= 4 * one_matrix + w.size * 4, temps
    assert temps["ragged_dot"] >= g * m * k * 4 // 2, temps   # the expansion this module avoids


def test_auto_tiles_only_large_products():
    assert gm.choose_impl("auto", 64, 8, 64, 64, backend="cpu") == "ragged_dot"
    assert gm.choose_impl("auto", 2048, 8, 64, 64, backend="cpu") == "tiled"
    assert gm.choose_impl("auto", 2048, 8, 64, 64, backend="gpu") == "ragged_dot"
    assert gm.choose_impl("auto", 65536, 32, 2880, 2880, backend="cpu") == "tiled"
    assert gm.choose_impl("auto", 65536, 32, 2880, 2880, backend="gpu") == "ragged_dot_tiled_wgrad"
    assert gm.choose_impl("auto", 65536, 32, 2880, 2880, backend="tpu") == "ragged_dot"
    assert gm.choose_impl("tiled", 4, 2, 4, 4) == "tiled"
    with pytest.raises(ValueError, match="grouped matmul implementation 'dense'"):
        gm.choose_impl("dense", 4, 2, 4, 4)


def test_moe_layer_grads_equal_across_impls_on_an_expert_mesh():
    """Through the MoE layer's dispatch (padded: worst-case buffers, most rows padding) on a
    data=2 x expert=4 mesh: values and gradients of x and the expert weights agree."""
    mesh = S.make_mesh(data=2, expert=4)
    params = randomize(S.init_params(TINY_GPT_OSS, mesh, seed=0), seed=5, scale=0.3)
    w = {k: v[0] for k, v in params["layers"]["moe"].items() if k.startswith(("w_", "b_"))}
    rng = np.random.RandomState(1)
    n, cfg = 40, TINY_GPT_OSS
    x = rng.randn(n, cfg.d_model).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_experts, cfg.top_k, replace=False) for _ in range(n)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(cfg.top_k), size=n).astype(np.float32)
    probe = rng.randn(n, cfg.d_model).astype(np.float32)
    results = {}
    for impl in ("ragged_dot", "tiled"):
        c = cfg.replace(grouped_matmul=impl)
        loss = lambda x_, w_: jnp.sum(moe_lib.moe_experts(c, x_, ids, weights, w_) * probe)
        with jax.set_mesh(mesh):
            results[impl] = jax.device_get(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w))
    (v0, (gx0, gw0)), (v1, (gx1, gw1)) = results["ragged_dot"], results["tiled"]
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    np.testing.assert_allclose(gx1, gx0, rtol=1e-5, atol=1e-5)
    for k in gw0:
        np.testing.assert_allclose(gw1[k], gw0[k], rtol=1e-5, atol=1e-5, err_msg=k)
