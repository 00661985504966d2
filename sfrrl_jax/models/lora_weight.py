"""A weight with a low-rank adapter beside it: `LoraWeight(base, a, b, scale)` acts as base + scale * a @ b.

The model's layers read their weights as `self.q_proj[...].astype(dt)` and multiply through
`layers.project` (dense) or the experts' grouped matmul (`models.moe`). An adapted leaf holds a
`LoraWeight` in the base array's place (`models.lora.with_adapter` builds that view, inside the
jitted function: no copy), which answers `[...]`, `astype`, `shape`, `ndim` and `dtype` as the base
array does, so the layers need no second code path: only the matmuls look at the type and apply
the adapter unmerged, x W + s (x A) B, the low-rank product never formed as a full matrix.

Layout of one adapted weight (leading stacked-layer dim `[layers]` where the base has it):
  base [*batch, *in, *out]   e.g. q_proj [embed, heads, head_dim]; experts' w_gate [experts, embed, mlp]
  a    [*batch, *in, rank]   the input side (PEFT's lora_A transposed)
  b    [*batch, rank, *out]  the output side (PEFT's lora_B transposed), zero at init
`n_batch` leading dims are per-slice weights (the experts: each expert its own A and B), `n_in`
dims are contracted with the input. It is a pytree whose children are (base, a, b), so jit,
grad, scan over layers, shard_map and vmap see three arrays.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """base + scale * a @ b, applied unmerged.

    Attributes:
      base: the base weight `[*lead, *batch, *in, *out]` (lead: a stacked-layer dim, when stacked).
      a: `[*lead, *batch, *in, rank]`.
      b: `[*lead, *batch, rank, *out]`.
      scale: the LoRA scale (alpha / rank, or alpha / sqrt(rank) with rsLoRA); static.
      n_in: how many of base's dims (after the batch dims) are contracted with the input; static.
      n_batch: the per-slice dims after any stacked-layer dim (1 for the experts: each expert its own
        A and B); static.
    """

    base: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    n_in: int = dataclasses.field(default=1, metadata=dict(static=True))
    n_batch: int = dataclasses.field(default=0, metadata=dict(static=True))

    # -- the array protocol the layers read weights through ---------------------------------------
    def __getitem__(self, index):
        if index is Ellipsis:
            return self
        raise TypeError(f"a LoraWeight reads whole ([...]), not by index {index!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def ndim(self) -> int:
        return self.base.ndim

    @property
    def dtype(self):
        return self.base.dtype

    def astype(self, dtype) -> "LoraWeight":
        """The weight in `dtype` (base, a and b cast alike, as the layers cast weights to the compute dtype)."""
        return dataclasses.replace(self, base=self.base.astype(dtype), a=self.a.astype(dtype),
                                   b=self.b.astype(dtype))

    def merged(self) -> jax.Array:
        """base + scale * a @ b as one array of base's shape and dtype (for tests and export; the
        model never forms it)."""
        batch = self.a.ndim - 1 - self.n_in            # stacked-layer dims + n_batch
        in_shape = self.a.shape[batch:-1]
        out_shape = self.b.shape[batch + 1:]
        a = self.a.reshape(self.a.shape[:batch] + (math.prod(in_shape), self.a.shape[-1]))
        b = self.b.reshape(self.b.shape[:batch + 1] + (math.prod(out_shape),))
        delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)) * self.scale
        return (self.base.astype(jnp.float32) + delta.reshape(self.base.shape)).astype(self.base.dtype)


def adapted_axes(base_axes: Sequence, n_in: int, n_batch: int, lead: int = 0) -> tuple[tuple, tuple]:
    """(a's, b's) logical axes from the base weight's: a keeps the base's input dims and adds an
    unsharded rank dim; b the rank dim then the base's output dims. `lead`: leading stacked dims."""
    base_axes = tuple(base_axes)
    cut = lead + n_batch + n_in
    return base_axes[:cut] + (None,), base_axes[:lead + n_batch] + (None,) + base_axes[cut:]


def low_rank_delta(x: jax.Array, w: LoraWeight, matmul) -> jax.Array:
    """scale * (x A) B through `matmul(x, weight, n_in)`, the caller's product (a dense projection
    or the experts' grouped one): the rank-r intermediate is scaled, then mapped out, so the
    low-rank product is never a full matrix."""
    low = matmul(x, w.a, w.n_in)
    return matmul(low * jnp.asarray(w.scale, low.dtype), w.b, 1)
