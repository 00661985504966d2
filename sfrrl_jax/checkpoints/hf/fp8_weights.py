"""Scaled FP8 weights, dequantised on load: the two formats FP8 releases on the Hub use.

- **Block-scaled** (`"quant_method": "fp8"`, `"weight_block_size": [bo, bi]`: DeepSeek-V3 / R1,
  the `-FP8` releases of Qwen3): each quantised linear weight `X` [..., out, in] is float8_e4m3fn,
  next to `X_scale_inv` (`....weight_scale_inv` for a `....weight`) [..., ceil(out / bo),
  ceil(in / bi)] in float32 (bf16 or UE8M0 in some releases).
- **compressed-tensors** (`"quant_method": "compressed-tensors"`, `"format": "float-quantized"`:
  GLM-4.5-FP8, the `FP8-dynamic` releases made with llm-compressor): `X.weight` e4m3 next to
  `X.weight_scale`, per tensor [1], per output channel [out, 1], per group of g inputs
  [out, in / g] or per block [ceil(out / bo), ceil(in / bi)], as the one weight scheme of the
  config's `config_groups` says.

Either way a tile of the weight (the edge tiles cut short where the tile does not divide) is
value = fp8 x its scale: a scale *multiplies* (DeepSeek's name "scale_inv" is the inverse of the
factor that quantised). Embeddings, norms, routers and heads stay dense, without a scale.

We train in bf16/fp32, so the weights are dequantised once, on the host, as they are read:
`Fp8WeightFiles` presents a checkpoint's tensors with each (weight, scale) pair as the float32
tensor it stands for; the tensor map and the validation downstream see a plain checkpoint. The
product is taken in float32, as transformers' dequantiser takes it (exact for a bf16 or UE8M0
scale: 4 significant bits times 8), then cast to the param dtype; compressed-tensors multiplies
in the scale's dtype (bf16), which rounds that exact product once: the same bf16 values.
Activation quantisation is an inference matter, so only dynamic (per-token, computed on the fly)
schemes load; a static one (stored input scales), an FP8 KV cache, sparsity, transforms and
other formats are refused, named. Export writes the dense weights.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from sfrrl_jax.checkpoints.hf.families import spec_for_model_type
from sfrrl_jax.checkpoints.hf.safetensors_io import CheckpointError

WEIGHT_CODES = ("F8_E4M3",)
SCALE_CODES = ("F32", "BF16", "F8_E8M0")


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint scales its FP8 weights: the scale tensor's name suffix, and the tile one
    scale covers, [rows, cols] of the weight's last two dims, None for the whole dim."""

    scale_suffix: str
    tile: tuple[int | None, int | None]

    def tile_of(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return (self.tile[0] or shape[-2], self.tile[1] or shape[-1])

    def grid(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale's shape for a weight of `shape` [..., out, in]."""
        if len(shape) < 2:
            raise ValueError(f"a scaled FP8 weight has at least 2 dims, got shape {shape}")
        rows, cols = self.tile_of(shape)
        return tuple(shape[:-2]) + (-(-shape[-2] // rows), -(-shape[-1] // cols))


def _positive_ints(value, n: int) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == n
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value))


def _refuse(where: str, key: str, value, supported) -> CheckpointError:
    return CheckpointError(f"{where}: quantization_config.{key}={value!r} is not supported (supported: {supported})")


def _block_scaled(quant: Mapping, where: str) -> Fp8Scheme:
    for key, allowed in (("activation_scheme", ("dynamic",)), ("fmt", ("e4m3", "float8_e4m3fn"))):   # MiniMax's
        if quant.get(key, allowed[0]) not in allowed:
            raise _refuse(where, key, quant[key], list(allowed))
    block = quant.get("weight_block_size")
    if not _positive_ints(block, 2):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size={block!r} must be two positive "
                              "integers [rows, columns] (per-tensor FP8 scales are not supported)")
    return Fp8Scheme("_scale_inv", (int(block[0]), int(block[1])))


def _compressed_tensors(quant: Mapping, where: str) -> Fp8Scheme:
    if quant.get("format") not in ("float-quantized", "naive-quantized"):
        raise _refuse(where, "format", quant.get("format"), ["float-quantized"])
    if quant.get("quantization_status", "compressed") != "compressed":
        raise _refuse(where, "quantization_status", quant["quantization_status"], ["compressed"])
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quant.get(key):
            raise _refuse(where, key, quant[key], "none: only the weights may be quantised")
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise CheckpointError(f"{where}: quantization_config.config_groups={groups!r} must name at least one group")
    schemes = set()
    for name, group in groups.items():
        at = f"config_groups.{name}"
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise _refuse(where, f"{at}.weights", weights, "FP8 weights")
        for key, want in (("type", "float"), ("num_bits", 8), ("symmetric", True), ("dynamic", False)):
            if weights.get(key, want) != want:
                raise _refuse(where, f"{at}.weights.{key}", weights.get(key), [want])
        for key in ("input_activations", "output_activations"):
            acts = group.get(key)
            if acts and not (key == "input_activations" and isinstance(acts, Mapping) and acts.get("dynamic") is True):
                raise _refuse(where, f"{at}.{key}", acts, "none, or dynamic input activations")
        strategy = weights.get("strategy")
        if strategy == "tensor":
            tile = (None, None)
        elif strategy == "channel":
            tile = (1, None)
        elif strategy == "group" and _positive_ints([weights.get("group_size")], 1):
            tile = (1, int(weights["group_size"]))
        elif strategy == "block" and _positive_ints(weights.get("block_structure"), 2):
            tile = tuple(int(b) for b in weights["block_structure"])
        else:
            raise _refuse(where, f"{at}.weights.strategy", strategy,
                          "tensor, channel, group with a group_size, block with a block_structure [rows, cols]")
        schemes.add(tile)
    if len(schemes) > 1:
        raise CheckpointError(f"{where}: quantization_config.config_groups scale weights in {len(schemes)} ways "
                              f"({sorted(map(str, schemes))}); one weight scheme is supported")
    return Fp8Scheme("_scale", schemes.pop())


def fp8_scheme(hf: Mapping[str, Any], where: str) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint's config (module docstring); None when its weights are not
    FP8 (no quantization_config, or GPT-OSS's "mxfp4", which the tensor map reads).

    Raises `CheckpointError` naming the key of a quantisation we cannot load exactly."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        raise CheckpointError(f"{where}: quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    spec = spec_for_model_type(hf.get("model_type"))
    if method == "mxfp4" and spec is not None and spec.mxfp4_experts:   # GPT-OSS's: tensor_map reads them
        return None
    if method == "fp8":
        return _block_scaled(quant, where)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    raise CheckpointError(f"{where}: quantization_config.quant_method={method!r} is not supported: load a "
                          "checkpoint with bf16/fp32 weights, FP8 ones ('fp8', 'compressed-tensors') or GPT-OSS's "
                          "'mxfp4'")


def dequantize_fp8(weight: np.ndarray, scale: np.ndarray, tile: tuple[int, int]) -> np.ndarray:
    """Dequantises a scaled FP8 weight: each tile of the weight times its scale, in float32.

    Edge tiles are cut short where the tile does not divide the weight's last two dims.

    Args:
      weight: `[..., out, in]` float8_e4m3fn, the quantised weight.
      scale: `[..., ceil(out / tile[0]), ceil(in / tile[1])]`, one scale per tile (any float dtype; it is
        cast to float32). A scale multiplies.
      tile: `(rows, cols)`, the block of the weight's last two dims one scale covers.
    Returns:
      `[..., out, in]` float32, the values the weight stands for.
    Raises:
      ValueError: when `weight` has fewer than 2 dims, or `scale` is not of the shape above.
    """
    want = Fp8Scheme("", tile).grid(weight.shape)
    if scale.shape != want:
        raise ValueError(f"FP8 weight {weight.shape} with tile {list(tile)} needs scales of shape {want}, "
                         f"got {scale.shape}")
    out_dim, in_dim = weight.shape[-2:]
    rows, cols = want[-2:]
    values = weight.astype(np.float32)
    if out_dim == rows * tile[0] and in_dim == cols * tile[1]:   # whole tiles: scale a view in place
        values.reshape(weight.shape[:-2] + (rows, tile[0], cols, tile[1]))[...] *= \
            scale.astype(np.float32)[..., :, None, :, None]
        return values
    # edge tiles cut short: the scales spread over every element
    factor = np.repeat(scale.astype(np.float32), tile[0], axis=-2)[..., :out_dim, :]
    values *= np.repeat(factor, tile[1], axis=-1)[..., :in_dim]
    return values


class Fp8WeightFiles:
    """A checkpoint's tensors (`files`: `.directory`, `.tensors`, `.read`) with every FP8 weight and
    its scale presented as one float32 tensor of the weight's shape.

    Every pairing is checked when built: an FP8 weight without its scale, a scale without its
    weight, a scale of the wrong shape or dtype raise `CheckpointError` naming the tensor."""

    def __init__(self, files, scheme: Fp8Scheme):
        self.directory, self.scheme, self._files = files.directory, scheme, files
        self.tensors: dict = {}
        self._quantized: set[str] = set()
        found, suffix = files.tensors, scheme.scale_suffix
        where = f"{files.directory} (FP8 weights, scales {'*' + suffix})"
        for name, info in found.items():
            if name.endswith(suffix) and info.dtype not in WEIGHT_CODES:
                if name[:-len(suffix)] not in found:
                    raise CheckpointError(f"{where}: scale {name!r} has no weight {name[:-len(suffix)]!r}")
                continue
            scale = found.get(name + suffix)
            if scale is None:
                if info.dtype in WEIGHT_CODES:
                    raise CheckpointError(f"{where}: FP8 tensor {name!r} has no scale {name + suffix!r}")
                self.tensors[name] = info
                continue
            if info.dtype not in WEIGHT_CODES:
                raise CheckpointError(f"{where}: tensor {name!r} has a scale but dtype {info.dtype}, "
                                      f"expected {WEIGHT_CODES[0]}")
            if scale.dtype not in SCALE_CODES:
                raise CheckpointError(f"{where}: scale {scale.name!r}: dtype {scale.dtype}, expected one of "
                                      f"{list(SCALE_CODES)}")
            if len(info.shape) < 2:
                raise CheckpointError(f"{where}: FP8 tensor {name!r} has shape {info.shape}: scales need a weight "
                                      "of 2 dims or more")
            grid = scheme.grid(info.shape)
            # one scale for the whole tensor is stored as [1] (or []) rather than [1, 1]
            if scale.shape != grid and not (grid == (1, 1) and scale.shape in ((), (1,))):
                raise CheckpointError(f"{where}: scale {scale.name!r} has shape {scale.shape}; weight {name!r} "
                                      f"{info.shape} needs {grid}")
            # what the weight stands for: float32 of its shape (the byte range is the FP8 one)
            self.tensors[name] = dataclasses.replace(info, dtype="F32")
            self._quantized.add(name)

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor, dequantised if stored as FP8; `rows` a range of its leading dim."""
        if name not in self._quantized:
            return self._files.read(name, rows)
        shape, scale_name = self._files.tensors[name].shape, name + self.scheme.scale_suffix
        tile = self.scheme.tile_of(shape)
        if rows is None or len(shape) > 2:   # leading dims above [out, in] index weight and scale alike
            weight = self._files.read(name, rows)
            return dequantize_fp8(weight, self._files.read(scale_name, rows).reshape(self.scheme.grid(weight.shape)),
                                  tile)
        # rows of a 2-D weight: dequantise the whole tiles that hold them, then cut
        start, stop, _ = rows.indices(shape[0])
        first, last = start // tile[0], -(-stop // tile[0])
        weight = self._files.read(name, slice(first * tile[0], min(last * tile[0], shape[0])))
        scale = self._files.read(scale_name).reshape(self.scheme.grid(shape))[first:last]
        return dequantize_fp8(weight, scale, tile)[start - first * tile[0]:stop - first * tile[0]]
