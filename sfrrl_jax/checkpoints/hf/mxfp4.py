"""MXFP4 (OCP Microscaling FP4) dequantisation, as published GPT-OSS checkpoints store experts.

A tensor whose last (input) dim has K values is stored as
  blocks [..., K/32, 16] uint8 -- 32 FP4 (e2m1) codes per block, two per byte, low nibble first;
  scales [..., K/32]     uint8 -- one shared power-of-two exponent per block, biased by 127.
value = e2m1(code) * 2**(scale - 127). e2m1 = 1 sign bit, 2 exponent bits (bias 1), 1 mantissa
bit: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

GPT-OSS names them `<proj>_blocks` / `<proj>_scales` with `<proj>` in {gate_up_proj, down_proj}
and keeps the output dim before the blocks: gate_up_proj_blocks [E, 2F, D/32, 16] dequantises to
[E, 2F, D], the transpose of the in-memory gate_up_proj [E, D, 2F].
"""
from __future__ import annotations

import numpy as np

BLOCK = 32  # values per scale
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantises MXFP4 blocks and their scales (module docstring) to float32.

    Args:
      blocks: `[..., G, 16]` uint8, 32 e2m1 codes per block of the input dim, two per byte, low nibble first.
      scales: `[..., G]` uint8, one power-of-two exponent per block, biased by 127.
    Returns:
      `[..., G * 32]` float32: each code's e2m1 value times `2 ** (scale - 127)` (exact).
    Raises:
      ValueError: when `blocks` or `scales` is not uint8, or their shapes are not `[..., G, 16]` and `[..., G]`.
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} / scales {scales.shape}: expected blocks "
                         f"[..., G, {BLOCK // 2}] and scales [..., G]")
    values = np.empty(blocks.shape[:-1] + (BLOCK,), np.float32)
    values[..., 0::2] = _E2M1[blocks & 0x0F]
    values[..., 1::2] = _E2M1[blocks >> 4]
    # ldexp is exact (a power-of-two scale); the int32 exponent avoids uint8 wrap-around.
    np.ldexp(values, (scales.astype(np.int32) - 127)[..., None], out=values)
    return values.reshape(blocks.shape[:-2] + (blocks.shape[-2] * BLOCK,))


def mxfp4_shapes(out_dim_shape: tuple[int, ...], in_dim: int, name: str) -> tuple[tuple, tuple]:
    """(blocks shape, scales shape) for a [*out_dim_shape, in_dim] tensor."""
    if in_dim % BLOCK:
        raise ValueError(f"{name}: MXFP4 needs the input dim ({in_dim}) to be a multiple of {BLOCK}")
    g = in_dim // BLOCK
    return tuple(out_dim_shape) + (g, BLOCK // 2), tuple(out_dim_shape) + (g,)
