"""Block-scaled FP8 weights (`quant_method: "fp8"`), as DeepSeek-V3 / R1 and the `-FP8` releases
of Qwen3 and others store them, dequantised on load.

config.json says `"quantization_config": {"quant_method": "fp8", "weight_block_size": [bo, bi],
"activation_scheme": "dynamic", "fmt": "e4m3"}`. Each quantised linear weight `X` of shape
[..., out, in] is stored as float8_e4m3fn, next to `X_scale_inv` (`....weight_scale_inv` for a
`....weight`) of shape [..., ceil(out / bo), ceil(in / bi)] in float32 (bfloat16 or UE8M0 in
some releases): tile (i, j) of the weight, rows i*bo.. and columns j*bi.. (the last tiles cut
short where bo or bi does not divide), is value = fp8 x scale_inv[i, j]. Embeddings, norms, the
router and the head stay in bf16 and have no scale.

We train in bf16/fp32, so the weights are dequantised once, on the host, as they are read:
`Fp8BlockFiles` presents a checkpoint's tensors with each (weight, scale) pair as the one float32
tensor it stands for; the tensor map and the validation downstream see a plain checkpoint. The
product is taken in float32 (exact for the e4m3 value; one rounding), then cast to the param
dtype: what transformers' own dequantisation computes. Export writes the dense weights.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from sfrrl_jax.checkpoints.hf.safetensors_io import CheckpointError

SCALE_SUFFIX = "_scale_inv"
WEIGHT_CODES = ("F8_E4M3",)
SCALE_CODES = ("F32", "BF16", "F8_E8M0")


def fp8_block_size(hf: Mapping[str, Any], where: str) -> tuple[int, int] | None:
    """(bo, bi) of a block-scaled FP8 checkpoint's config; None when its weights are not FP8.

    Raises `CheckpointError` naming the key for a quantisation we cannot load exactly: another
    quant_method (GPT-OSS's "mxfp4" is read by the tensor map), a static activation scheme, a
    format other than e4m3, a missing or malformed weight_block_size."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        raise CheckpointError(f"{where}: quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method == "mxfp4" and hf.get("model_type") == "gpt_oss":
        return None
    if method != "fp8":
        raise CheckpointError(f"{where}: quantization_config.quant_method={method!r} is not supported: load a "
                              "checkpoint with bf16/fp32 weights, block-scaled FP8 ('fp8') or GPT-OSS's 'mxfp4'")
    for key, allowed in (("activation_scheme", ("dynamic",)), ("fmt", ("e4m3",))):
        if quant.get(key, allowed[0]) not in allowed:
            raise CheckpointError(f"{where}: quantization_config.{key}={quant[key]!r} is not supported "
                                  f"(supported: {list(allowed)})")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size={block!r} must be two positive "
                              "integers [rows, columns] (per-tensor FP8 scales are not supported)")
    return int(block[0]), int(block[1])


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `shape` [..., out, in]."""
    if len(shape) < 2:
        raise ValueError(f"a block-scaled FP8 weight has at least 2 dims, got shape {shape}")
    return tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """weight [..., out, in] float8_e4m3fn, scale_inv [..., ceil(out/bo), ceil(in/bi)] -> float32
    [..., out, in], each tile times its scale."""
    want = scale_grid(weight.shape, block)
    if scale_inv.shape != want:
        raise ValueError(f"FP8 weight {weight.shape} with block {list(block)} needs scales of shape {want}, "
                         f"got {scale_inv.shape}")
    out_dim, in_dim = weight.shape[-2:]
    scale = np.repeat(scale_inv.astype(np.float32), block[0], axis=-2)[..., :out_dim, :]
    scale = np.repeat(scale, block[1], axis=-1)[..., :in_dim]
    return weight.astype(np.float32) * scale


class Fp8BlockFiles:
    """A checkpoint's tensors (`files`: `.directory`, `.tensors`, `.read`) with every FP8 weight and
    its `_scale_inv` presented as one float32 tensor of the weight's shape.

    Every pairing is checked when built: an FP8 weight without its scale, a scale without its
    weight, a scale of the wrong shape or dtype raise `CheckpointError` naming the tensor."""

    def __init__(self, files, block: tuple[int, int]):
        self.directory, self.block, self._files = files.directory, block, files
        self.tensors: dict = {}
        self._quantized: set[str] = set()
        found = files.tensors
        where = f"{files.directory} (block-scaled FP8, weight_block_size {list(block)})"
        for name, info in found.items():
            if name.endswith(SCALE_SUFFIX):
                if name[:-len(SCALE_SUFFIX)] not in found:
                    raise CheckpointError(f"{where}: scale {name!r} has no weight "
                                          f"{name[:-len(SCALE_SUFFIX)]!r}")
                continue
            scale = found.get(name + SCALE_SUFFIX)
            if scale is None:
                if info.dtype in WEIGHT_CODES:
                    raise CheckpointError(f"{where}: FP8 tensor {name!r} has no scale {name + SCALE_SUFFIX!r}")
                self.tensors[name] = info
                continue
            if info.dtype not in WEIGHT_CODES:
                raise CheckpointError(f"{where}: tensor {name!r} has a scale but dtype {info.dtype}, "
                                      f"expected {WEIGHT_CODES[0]}")
            if scale.dtype not in SCALE_CODES:
                raise CheckpointError(f"{where}: scale {scale.name!r}: dtype {scale.dtype}, expected one of "
                                      f"{list(SCALE_CODES)}")
            if len(info.shape) < 2:
                raise CheckpointError(f"{where}: FP8 tensor {name!r} has shape {info.shape}: block scales need "
                                      "a weight of 2 dims or more")
            if scale.shape != scale_grid(info.shape, block):
                raise CheckpointError(f"{where}: scale {scale.name!r} has shape {scale.shape}; weight {name!r} "
                                      f"{info.shape} needs {scale_grid(info.shape, block)}")
            # what the weight stands for: float32 of its shape (the byte range is the FP8 one)
            self.tensors[name] = dataclasses.replace(info, dtype="F32")
            self._quantized.add(name)

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor, dequantised if stored as FP8; `rows` a range of its leading dim."""
        if name not in self._quantized:
            return self._files.read(name, rows)
        shape = self._files.tensors[name].shape
        if rows is None or len(shape) > 2:   # leading dims above [out, in] index weight and scale alike
            return dequantize_fp8_blocks(self._files.read(name, rows), self._files.read(name + SCALE_SUFFIX, rows),
                                         self.block)
        # rows of a 2-D weight: dequantise the whole tiles that hold them, then cut
        start, stop, _ = rows.indices(shape[0])
        bo = self.block[0]
        first, last = start // bo, -(-stop // bo)
        weight = self._files.read(name, slice(first * bo, min(last * bo, shape[0])))
        tiles = dequantize_fp8_blocks(weight, self._files.read(name + SCALE_SUFFIX, slice(first, last)), self.block)
        return tiles[start - first * bo:stop - first * bo]
