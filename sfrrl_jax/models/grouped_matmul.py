"""`grouped_matmul`: the experts' matmul over rows sorted by expert (`jax.lax.ragged_dot`), made
to compose with `jax.vmap` as well as `jax.jit` and `jax.grad`.

`ragged_dot` batches only when every operand is mapped over axis 0, and under `jax.vmap` of the
model the expert weights are not mapped at all (nor are `group_sizes` shaped for it), so a vmap
of `forward` failed inside XLA's batching rule. Here the matmul and its backward are
`custom_vmap` functions whose rule maps the per-example call over the mapped axis (`lax.map`:
each example keeps its own expert groups; unmapped operands are closed over, not broadcast), and
`custom_vjp` supplies the backward (a custom_vmap function cannot be transposed by JAX itself).
Unmapped, both are exactly `ragged_dot` and its VJP: the same XLA ops as before.

Shapes: rows [m, k] sorted by group; w [g, k, n]; group_sizes [g] int32 (sum <= m; rows past the
sum are zero in the output). Returns [m, n].
"""
from __future__ import annotations

import jax
from jax import custom_batching


def _map_over_axis(fn, axis_size: int, in_batched, args):
    """Calls fn per example along axis 0 of the mapped args, closing over the unmapped ones."""
    mapped = tuple(a for a, b in zip(args, in_batched) if b)

    def one(example):
        it = iter(example)
        return fn(*(next(it) if b else a for a, b in zip(args, in_batched)))

    del axis_size  # implied by the mapped args
    return jax.lax.map(one, mapped)


@custom_batching.custom_vmap
def _ragged(rows, w, group_sizes):
    return jax.lax.ragged_dot(rows, w, group_sizes)


@_ragged.def_vmap
def _ragged_vmap(axis_size, in_batched, rows, w, group_sizes):
    return _map_over_axis(_ragged, axis_size, in_batched, (rows, w, group_sizes)), True


@custom_batching.custom_vmap
def _ragged_vjp(rows, w, group_sizes, cotangent):
    _, vjp = jax.vjp(lambda r, v: jax.lax.ragged_dot(r, v, group_sizes), rows, w)
    return vjp(cotangent)


@_ragged_vjp.def_vmap
def _ragged_vjp_vmap(axis_size, in_batched, rows, w, group_sizes, cotangent):
    out = _map_over_axis(_ragged_vjp, axis_size, in_batched, (rows, w, group_sizes, cotangent))
    return out, (True, True)


@jax.custom_vjp
def grouped_matmul(rows, w, group_sizes):
    """rows [m, k] (sorted by group) @ w[group] -> [m, n]; see the module doc."""
    return _ragged(rows, w, group_sizes)


def _fwd(rows, w, group_sizes):
    return _ragged(rows, w, group_sizes), (rows, w, group_sizes)


def _bwd(residuals, cotangent):
    rows, w, group_sizes = residuals
    d_rows, d_w = _ragged_vjp(rows, w, group_sizes, cotangent)
    return d_rows, d_w, None


grouped_matmul.defvjp(_fwd, _bwd)
