"""A small, strict safetensors reader and a streaming, sharding writer.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 N, then N bytes
of JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the data buffer; offsets are relative to the buffer start, tensors are C-contiguous
little-endian.

We read with plain `pread`s rather than mmap, so a tensor's pages are not kept resident after the
caller drops it (peak host memory = the tensors alive at once), and we can read a leading-dim
range of a tensor (e.g. a few experts) without touching the rest. Every malformed input raises
`CheckpointError` naming the file and, where there is one, the tensor.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit

DTYPES: Mapping[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODE_OF = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory or file is malformed, incomplete or does not fit the model."""


def dtype_code(dtype) -> str:
    """The safetensors dtype string ('BF16', 'F32', ...) of a numpy/jax dtype."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise CheckpointError(f"dtype {dt} has no safetensors encoding; supported: {sorted(DTYPES)}")
    return _CODE_OF[dt]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int
    file: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One `.safetensors` file: its validated header, and reads of whole tensors or dim-0 ranges."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict = {}
        self._parse_header()

    def _corrupt(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt safetensors file: {what}")

    def _parse_header(self) -> None:
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise self._corrupt(f"file has {size} bytes, fewer than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise self._corrupt(f"header length {n} exceeds the file size ({size} bytes) or the "
                                    f"{_MAX_HEADER_BYTES}-byte limit")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._corrupt(f"header is not valid UTF-8 JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._corrupt(f"header is a JSON {type(header).__name__}, expected an object")
        data_start, data_size = 8 + n, size - 8 - n
        self.metadata = header.pop("__metadata__", None) or {}
        for name, entry in header.items():
            self.tensors[name] = self._entry(name, entry, data_start, data_size)

    def _entry(self, name: str, entry, data_start: int, data_size: int) -> TensorInfo:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise self._corrupt(f"tensor {name!r}: entry {entry!r} lacks dtype/shape/data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise self._corrupt(f"tensor {name!r}: unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise self._corrupt(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise self._corrupt(f"tensor {name!r}: bad data_offsets {offsets!r}")
        begin, end = offsets
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if not 0 <= begin <= end <= data_size or end - begin != want:
            raise self._corrupt(
                f"tensor {name!r}: data_offsets {offsets} do not fit shape {tuple(shape)} {dtype} "
                f"({want} bytes) within the {data_size}-byte data buffer")
        return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end, self.path)


def read_tensor(info: TensorInfo, rows: slice | None = None) -> np.ndarray:
    """The tensor (or only rows `rows` of its leading dim, read from disk alone) as a numpy array."""
    dtype = DTYPES[info.dtype]
    shape, begin = list(info.shape), info.begin
    if rows is not None and shape:
        start, stop, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError(f"read_tensor: rows must be a contiguous range, got {rows}")
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        begin += start * row_bytes
        shape[0] = max(stop - start, 0)
    out = np.empty(shape, dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(info.file, "rb") as f:
        f.seek(begin)
        got = f.readinto(view)
    if got != out.nbytes:
        raise CheckpointError(f"{info.file}: tensor {info.name!r}: file truncated "
                              f"(read {got} of {out.nbytes} bytes)")
    return out


class CheckpointFiles:
    """All tensors of an HF checkpoint directory (index json + shards, or a single file)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        self.tensors: dict[str, TensorInfo] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            self._from_index(index)
        else:
            files = ([self.directory / SINGLE_FILE] if (self.directory / SINGLE_FILE).is_file()
                     else sorted(self.directory.glob("*.safetensors")))
            if not files:
                raise CheckpointError(f"{self.directory}: no {INDEX_FILE} and no *.safetensors files")
            for file in files:
                self._add(SafetensorsFile(file))

    def _add(self, file: SafetensorsFile) -> None:
        for name, info in file.tensors.items():
            if name in self.tensors:
                raise CheckpointError(f"{self.directory}: tensor {name!r} appears in both "
                                      f"{self.tensors[name].file.name} and {info.file.name}")
            self.tensors[name] = info

    def _from_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid index (needs a 'weight_map' object): {e}") from None
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname, names in sorted(by_file.items()):
            path = self.directory / fname
            if not path.is_file():
                raise CheckpointError(f"{index}: weight_map names file {fname!r} (for {names[0]!r}), "
                                      "which does not exist")
            file = SafetensorsFile(path)
            absent = [n for n in names if n not in file.tensors]
            if absent:
                raise CheckpointError(f"{index}: tensor {absent[0]!r} is mapped to {fname}, whose "
                                      f"header does not contain it ({len(absent)} such tensors)")
            self._add(file)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        return read_tensor(self.tensors[name], rows)


# -- writing -------------------------------------------------------------------------------------

def _header_bytes(specs: Sequence[tuple[str, tuple[int, ...], str]], metadata: Mapping[str, str]) -> bytes:
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, shape, code in specs:
        size = math.prod(shape) * DTYPES[code].itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((-len(raw)) % 8)  # keep the data buffer 8-byte aligned, as the reference does
    return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
    """Writes tensors, in a planned order, into shard files no larger than `max_shard_bytes`.

    The full list of (name, shape, dtype code) is known up front, so every header is written
    before its data and each tensor is streamed to disk as it arrives: host memory holds one
    tensor at a time. With more than one shard the files are named
    `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` maps names to files
    (the transformers convention); a single shard is `model.safetensors`.
    """

    def __init__(self, directory: str | os.PathLike, specs: Iterable[tuple[str, tuple[int, ...], str]],
                 max_shard_bytes: int, metadata: Mapping[str, str] | None = None):
        self.directory = Path(directory)
        self.specs = [(n, tuple(int(d) for d in s), c) for n, s, c in specs]
        self.metadata = {"format": "pt", **(metadata or {})}
        shards: list[list] = [[]]
        size = 0
        for spec in self.specs:
            nbytes = math.prod(spec[1]) * DTYPES[spec[2]].itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += nbytes
        n = len(shards)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shards = list(zip(names, shards))
        self._order = [(fname, spec) for fname, specs_ in self.shards for spec in specs_]
        self._next = 0
        self._file = None
        self._file_name = None
        self.total_bytes = sum(math.prod(s) * DTYPES[c].itemsize for _, s, c in self.specs)

    def write(self, name: str, array: np.ndarray) -> None:
        """Writes the next planned tensor; `name`, shape and dtype must match the plan."""
        if self._next >= len(self._order):
            raise CheckpointError(f"ShardedWriter: unplanned tensor {name!r} (all planned tensors written)")
        fname, (want, shape, code) = self._order[self._next]
        array = np.ascontiguousarray(array)
        if name != want or tuple(array.shape) != shape or dtype_code(array.dtype) != code:
            raise CheckpointError(f"ShardedWriter: got {name!r} {array.shape} {array.dtype}, planned "
                                  f"{want!r} {shape} {code}")
        if fname != self._file_name:
            self._close()
            self._file = open(self.directory / fname, "wb")
            self._file_name = fname
            self._file.write(_header_bytes(dict(self.shards)[fname], self.metadata))
        self._file.write(memoryview(array.reshape(-1).view(np.uint8)))
        self._next += 1

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> list[str]:
        """Closes the last file, writes the index if sharded; returns the file names written."""
        self._close()
        if self._next != len(self._order):
            raise CheckpointError(f"ShardedWriter: {len(self._order) - self._next} planned tensors were "
                                  f"not written (next: {self._order[self._next][1][0]!r})")
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {n: fname for fname, specs in self.shards for n, _, _ in specs}}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return [fname for fname, _ in self.shards]
