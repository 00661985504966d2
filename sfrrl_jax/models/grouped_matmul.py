"""`grouped_matmul`: the experts' matmul over rows sorted by expert, in two implementations.

Shapes: rows [m, k] sorted by group; w [g, k, n]; group_sizes [g] int32 (sum <= m; rows past the
sum are zero in the output). Returns [m, n] in the operands' dtype (products accumulate in f32).

Implementations (`impl`, resolved from `ModelConfig.grouped_matmul` by `choose_impl`):
  'ragged_dot' -- `jax.lax.ragged_dot` and its VJP. Where XLA has no grouped GEMM for a ragged
                  dot it rewrites it to a dense dot over every group: XLA:CPU for all three
                  products, XLA:GPU for the weight gradient (its cuDNN path covers the forward and
                  the row gradient). That expansion builds [g, m, k] buffers: for gpt-oss-120b's
                  32 local experts at 64k rows, 24 GB each, several per layer.
  'tiled'      -- a loop over row tiles of `tile` rows that each hold one group's rows (a group
                  spans ceil(size / tile) tiles, the last one partly masked), one [tile, k] x
                  [k, n] dot per tile. Memory O(m x n); work proportional to the rows present
                  (the loop's trip count is the tiles in use, so the padding rows a worst-case
                  capacity buffer carries past sum(group_sizes) cost nothing).
  'ragged_dot_tiled_wgrad' -- the forward and row gradient by `ragged_dot`, the weight gradient
                  tiled: the GPU choice (cuDNN's grouped GEMM where it exists, no dense weight-
                  gradient expansion).
All three compute the same function; the tiled loop is sequential over tiles, so rows of one
tile that belong to a neighbouring group are read but masked out, and written back unchanged.

`jax.vmap`: `ragged_dot` batches only when every operand is mapped over axis 0, and under
`jax.vmap` of the model the expert weights are not mapped at all (nor are `group_sizes` shaped
for it), so the matmul and its backward are `custom_vmap` functions whose rule maps the
per-example call over the mapped axis (`lax.map`: each example keeps its own expert groups;
unmapped operands are closed over, not broadcast), and `custom_vjp` supplies the backward (a
custom_vmap function cannot be transposed by JAX itself). Unmapped, 'ragged_dot' is exactly
`ragged_dot` and its VJP: the same XLA ops as before this module had a second implementation.
"""
from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import custom_batching

GroupedImpl = Literal["ragged_dot", "tiled", "ragged_dot_tiled_wgrad"]
IMPLS: tuple[str, ...] = GroupedImpl.__args__

# 'auto' keeps ragged_dot while its dense expansion [g, m, max(k, n)] is at most this many
# elements: on CPU, where the expansion is all XLA has, the tiled loop is as fast at 64 x 8 x 64
# x 64 and faster above (`python experiments/bench/grouped_matmul.py`: 11x at 2048 x 8 x 64 x 64,
# 30x at 8192 x 32 x 512 x 512, forward and grads); on GPU, cuDNN's grouped GEMM runs the forward
# and the row gradient, and only the weight gradient's expansion is tiled away, once it is large.
AUTO_DENSE_LIMIT = {"cpu": 1 << 15, "gpu": 1 << 24}
TILE_ROWS = 128   # rows per tile: one [128, k] x [k, n] dot keeps a CPU core's or an SM's units fed


def choose_impl(setting: str, m: int, g: int, k: int, n: int, backend: str | None = None) -> str:
    """The implementation for a [m, k] x [g, k, n] grouped matmul under `setting`.

    setting: 'auto' or one of IMPLS. 'auto': on CPU 'tiled' once the dense expansion exceeds
    AUTO_DENSE_LIMIT['cpu'] elements, on GPU 'ragged_dot_tiled_wgrad' once it exceeds
    AUTO_DENSE_LIMIT['gpu'], else (and on TPU, whose grouped GEMM is native) 'ragged_dot'.
    """
    if setting != "auto":
        if setting not in IMPLS:
            raise ValueError(f"grouped matmul implementation {setting!r}; valid: ['auto', {', '.join(map(repr, IMPLS))}]")
        return setting
    backend = backend or jax.default_backend()
    kind = "cpu" if backend == "cpu" else "gpu" if backend in ("gpu", "cuda", "rocm") else None
    if kind is None or g * m * max(k, n) <= AUTO_DENSE_LIMIT[kind]:
        return "ragged_dot"
    return "tiled" if kind == "cpu" else "ragged_dot_tiled_wgrad"


# -- the tiled loop ----------------------------------------------------------------------------

def _tiles(group_sizes, tile: int):
    """Per-group tile counts and the running end of each group's tiles and rows."""
    sizes = group_sizes.astype(jnp.int32)
    per_group = (sizes + tile - 1) // tile            # [g]
    tile_end = jnp.cumsum(per_group)                  # [g] one past each group's last tile
    row_start = jnp.cumsum(sizes) - sizes             # [g]
    return sizes, per_group, tile_end, row_start


def _tile_at(t, m: int, tile: int, plan):
    """Tile t's group, where its [tile]-row window starts, and which window rows are its own.

    The window starts at the tile's first row, pulled back so it ends inside [0, m) (so no
    dynamic slice is clamped behind our back); `mine` [tile] marks the rows of this tile.
    """
    sizes, per_group, tile_end, row_start = plan
    grp = jnp.sum(tile_end <= t).astype(jnp.int32)
    first = row_start[grp] + (t - (tile_end[grp] - per_group[grp])) * tile
    count = jnp.minimum(tile, row_start[grp] + sizes[grp] - first)
    window = jnp.minimum(first, m - tile)
    i = jnp.arange(tile) + window
    mine = (i >= first) & (i < first + count)
    return grp, window, mine


def _tile_rows(m: int) -> int:
    return min(TILE_ROWS, m)


def _tiled_matmul(rows, w, group_sizes, transpose_w: bool = False):
    """rows [m, k] @ w[group] ([g, k, n]; [g, n, k] used as its transpose when transpose_w)."""
    m = rows.shape[0]
    n = w.shape[1] if transpose_w else w.shape[2]
    dtype = jnp.result_type(rows, w)
    out = jnp.zeros((m, n), dtype)
    if m == 0:
        return out
    tile = _tile_rows(m)
    plan = _tiles(group_sizes, tile)
    contract = ((1,), (1 if transpose_w else 0,))   # w[group] is [k, n], or [n, k] to transpose

    def body(t, out):
        grp, window, mine = _tile_at(t, m, tile, plan)
        x = jax.lax.dynamic_slice_in_dim(rows, window, tile, 0)
        wg = jax.lax.dynamic_index_in_dim(w, grp, 0, keepdims=False)
        y = jax.lax.dot_general(x, wg, (contract, ((), ())), preferred_element_type=jnp.float32)
        kept = jax.lax.dynamic_slice_in_dim(out, window, tile, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], y.astype(dtype), kept), window, 0)

    return jax.lax.fori_loop(0, plan[2][-1], body, out)


def _tiled_wgrad(rows, cotangent, group_sizes, w_shape, w_dtype):
    """d w [g, k, n] = per group, rows[group]^T @ cotangent[group] (accumulated in f32)."""
    m = rows.shape[0]
    dw = jnp.zeros(w_shape, jnp.float32)
    if m == 0:
        return dw.astype(w_dtype)
    tile = _tile_rows(m)
    plan = _tiles(group_sizes, tile)

    def body(t, dw):
        grp, window, mine = _tile_at(t, m, tile, plan)
        x = jnp.where(mine[:, None], jax.lax.dynamic_slice_in_dim(rows, window, tile, 0), 0)
        dy = jax.lax.dynamic_slice_in_dim(cotangent, window, tile, 0)
        part = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_index_in_dim(
            dw, jax.lax.dynamic_index_in_dim(dw, grp, 0, keepdims=False) + part, grp, 0)

    return jax.lax.fori_loop(0, plan[2][-1], body, dw).astype(w_dtype)


# -- forward and backward per implementation, each batched by mapping over the examples ---------

def _map_over_axis(fn, in_batched, args):
    """Calls fn per example along axis 0 of the mapped args, closing over the unmapped ones."""
    mapped = tuple(a for a, b in zip(args, in_batched) if b)

    def one(example):
        it = iter(example)
        return fn(*(next(it) if b else a for a, b in zip(args, in_batched)))

    return jax.lax.map(one, mapped)


def _forward_of(impl: str):
    def forward(rows, w, group_sizes):
        if impl == "tiled":
            return _tiled_matmul(rows, w, group_sizes)
        return jax.lax.ragged_dot(rows, w, group_sizes)
    return forward


def _backward_of(impl: str):
    def backward(rows, w, group_sizes, cotangent):
        if impl == "ragged_dot":
            _, vjp = jax.vjp(lambda r, v: jax.lax.ragged_dot(r, v, group_sizes), rows, w)
            return vjp(cotangent)
        if impl == "tiled":
            d_rows = _tiled_matmul(cotangent, w, group_sizes, transpose_w=True).astype(rows.dtype)
        else:
            _, vjp = jax.vjp(lambda r: jax.lax.ragged_dot(r, w, group_sizes), rows)
            (d_rows,) = vjp(cotangent)
        return d_rows, _tiled_wgrad(rows, cotangent, group_sizes, w.shape, w.dtype)
    return backward


def _vmappable(fn, out_batched):
    wrapped = custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        del axis_size  # implied by the mapped args
        return _map_over_axis(wrapped, in_batched, args), out_batched

    return wrapped


_FORWARD = {impl: _vmappable(_forward_of(impl), True) for impl in IMPLS}
_BACKWARD = {impl: _vmappable(_backward_of(impl), (True, True)) for impl in IMPLS}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(rows, w, group_sizes, impl: GroupedImpl = "ragged_dot"):
    """rows [m, k] (sorted by group) @ w[group] -> [m, n]; see the module doc."""
    return _FORWARD[impl](rows, w, group_sizes)


def _fwd(rows, w, group_sizes, impl):
    return _FORWARD[impl](rows, w, group_sizes), (rows, w, group_sizes)


def _bwd(impl, residuals, cotangent):
    rows, w, group_sizes = residuals
    d_rows, d_w = _BACKWARD[impl](rows, w, group_sizes, cotangent)
    return d_rows, d_w, None


grouped_matmul.defvjp(_fwd, _bwd)
