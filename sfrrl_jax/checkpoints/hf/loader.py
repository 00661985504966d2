"""`load_hf`: an HF checkpoint directory -> (ModelConfig, sharded params), streamed.

Nothing close to the whole model is ever on the host. For each layer and each tensor group, each
distinct shard that *this process's* devices hold is read from disk (expert-sharded leaves read
only their own experts' bytes), converted to our layout, cast, and copied to exactly the devices
that hold it (one batched transfer per leaf and layer); the host copy is then dropped. The
per-layer piece is written into the stacked leaf on device in place (a donated
dynamic-update-slice), so device memory peaks at the model plus one layer's piece of one leaf,
and host memory at about one HF tensor.

Multi-host: every process reads only the shards of its addressable devices and the global arrays
are assembled with `jax.make_array_from_single_device_arrays`; no process needs the full model.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sfrrl_jax.checkpoints.hf.families import spec_of, wrapped_by
from sfrrl_jax.checkpoints.hf.fp8_weights import Fp8WeightFiles, fp8_scheme
from sfrrl_jax.checkpoints.hf.hf_config import config_from_hf, read_hf_config
from sfrrl_jax.checkpoints.hf.hf_fields import bool_of
from sfrrl_jax.checkpoints.hf.safetensors_io import CheckpointError, CheckpointFiles, read_tensor
from sfrrl_jax.checkpoints.hf.tensor_map import (IGNORED_SUFFIXES, TensorGroup, global_groups,
                                                 is_mxfp4, layer_groups)
from sfrrl_jax.checks import check_bool
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.models.api import check_mesh_fits, param_shardings
from sfrrl_jax.models.transformer import STACK_KEYS, layer_slot, param_shapes, unflatten_paths, unstack_layers

_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}


def flatten_tree(tree, prefix=()):
    """Yields (path tuple, leaf) of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flatten_tree(value, prefix + (key,))
        else:
            yield prefix + (key,), value


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def validate_tensors(files: CheckpointFiles, groups: list[TensorGroup], cfg: ModelConfig) -> None:
    """Every expected HF tensor present with its shape and a usable dtype; nothing unexpected.

    Raises `CheckpointError` naming the first offending tensor (and how many more there are).
    """
    expected: dict[str, tuple] = {}
    dtypes: dict[str, str] = {}
    for g in groups:
        expected.update(g.hf)
        dtypes.update(g.hf_dtypes)
    found = files.tensors
    ignorable = {n for n in found if n.endswith(IGNORED_SUFFIXES)}
    if spec_of(cfg.family).mtp_layers:   # multi-token-prediction layers, after the model's: not read
        ignorable |= {n for n in found if (m := _LAYER.match(n)) and int(m.group(1)) >= cfg.n_layers}
    if cfg.tie_embeddings and "lm_head.weight" in found:
        ignorable.add("lm_head.weight")  # tied: the head is the embedding, a stored copy is redundant
    where = f"{files.directory} ({cfg.family})"

    def fail(kind, items, describe):
        more = f" (and {len(items) - 1} more {kind} tensors)" if len(items) > 1 else ""
        raise CheckpointError(f"{where}: {describe(items[0])}{more}")

    missing = sorted(n for n in expected if n not in found)
    if missing:
        fail("missing", missing, lambda n: f"missing tensor {n!r} (expected shape {expected[n]})")
    extra = sorted(n for n in found if n not in expected and n not in ignorable)
    if extra:
        fail("unexpected", extra, lambda n: f"unexpected tensor {n!r} with shape {found[n].shape} in "
                                            f"{found[n].file.name}; the {cfg.family} model has no such weight")
    wrong = sorted(n for n in expected if found[n].shape != tuple(expected[n]))
    if wrong:
        fail("mis-shaped", wrong, lambda n: f"tensor {n!r} in {found[n].file.name}: expected shape "
                                            f"{tuple(expected[n])}, found {found[n].shape}")
    bad = sorted(n for n in expected if found[n].dtype != dtypes.get(n, found[n].dtype)
                 or (n not in dtypes and found[n].dtype not in _FLOAT_CODES))
    if bad:
        fail("wrongly typed", bad, lambda n: f"tensor {n!r}: dtype {found[n].dtype}, expected "
                                             f"{dtypes.get(n, 'a float type ' + str(sorted(_FLOAT_CODES)))}")


def _shard_groups(sharding, shape):
    """{index key: (index tuple of slices, [devices])} for this process's devices."""
    out: dict = {}
    for dev, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
        norm = tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape))
        key = tuple((s.start, s.stop) for s in norm)
        out.setdefault(key, (norm, []))[1].append(dev)
    return out


@functools.lru_cache(maxsize=None)
def _layer_setter(sharding: NamedSharding):
    """(stacked [L, ...], piece [...], l) -> stacked with [l] = piece, in place (donated); local
    to each device. `l` is traced, so one compile serves every layer."""
    return jax.jit(lambda x, piece, l: jax.lax.dynamic_update_index_in_dim(x, piece, l, 0),
                   donate_argnums=0, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _zeros(shape, dtype, sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


class _LeafBuilder:
    """Collects the pieces of one param leaf and assembles the sharded global array."""

    def __init__(self, path, shape, dtype, sharding: NamedSharding, layered: bool):
        self.path, self.shape, self.dtype, self.sharding, self.layered = path, tuple(shape), dtype, sharding, layered
        self.shards = _shard_groups(sharding, self.shape)
        if layered:
            spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
            if spec[0] is not None:
                raise ValueError(f"param {'/'.join(path)}: the stacked `layers` dim is sharded "
                                 f"({sharding.spec}); load_hf requires it replicated")
            self.layer_sharding = NamedSharding(sharding.mesh, P(*spec[1:]))
            self.value = _zeros(self.shape, self.dtype, sharding)()
        else:
            self.value = None
        self.pieces: list[tuple[np.ndarray, list]] = []  # host piece, devices that hold it

    def wanted(self, expert_rows: bool):
        """[(rows slice or None, per-layer index, devices)] -- one entry per distinct shard."""
        sub = slice(1, None) if self.layered else slice(None)
        out = []
        for index, devices in self.shards.values():
            local = index[sub]
            out.append((local[0] if expert_rows else None, local, devices))
        return out

    def put(self, array: np.ndarray, local_index, devices, rows_done: bool, name: str) -> None:
        index = (slice(None),) + tuple(local_index[1:]) if rows_done else tuple(local_index)
        expect = tuple(s.stop - s.start for s in local_index)
        piece = np.ascontiguousarray(array[index]).astype(self.dtype, copy=False)
        if piece.shape != expect:  # a mapping bug, never a user error: say exactly where
            raise AssertionError(f"{name} -> {'/'.join(self.path)}: piece shape {piece.shape} != shard "
                                 f"shape {expect}")
        self.pieces.append((piece, devices))

    def _to_devices(self, shape, sharding) -> jax.Array:
        # One batched transfer of every (piece, device) pair, then the global array over them.
        pairs = [(piece, dev) for piece, devices in self.pieces for dev in devices]
        arrays = jax.device_put([p for p, _ in pairs], [d for _, d in pairs])
        self.pieces = []
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    def flush(self, layer: int | None) -> None:
        """Moves the collected pieces to their devices: into row `layer` of the stacked leaf, or
        (global leaves) as the finished array."""
        if self.layered:
            piece = self._to_devices(self.shape[1:], self.layer_sharding)
            self.value = _layer_setter(self.sharding)(self.value, piece, np.int32(layer))
        else:
            self.value = self._to_devices(self.shape, self.sharding)


def _run_group(group: TensorGroup, builders: dict, read, slot: tuple[str, int] | None) -> None:
    """Reads `group` once per distinct expert range its leaves' shards need, and places them.
    slot: (stack key, row) of a layer's group (`transformer.layer_slot`); None for a global one."""
    prefix, layer = ((), None) if slot is None else ((slot[0],), slot[1])
    by_rows: dict = {}
    for leaf in group.leaves:
        b = builders[prefix + leaf]
        for rows, local, devices in b.wanted(group.expert_rows):
            key = None if rows is None else (rows.start, rows.stop)
            by_rows.setdefault(key, []).append((b, local, devices))
    for key, users in by_rows.items():
        arrays = group.load(read, None if key is None else slice(*key))
        for b, local, devices in users:
            b.put(arrays[b.path[len(prefix):]], local, devices, rows_done=key is not None,
                  name=next(iter(group.hf)))
        del arrays
    for leaf in group.leaves:  # to the devices now: the host holds one group's tensors at a time
        builders[prefix + leaf].flush(layer)


class _LanguageModelFiles:
    """A multimodal checkpoint's language model tensors under a text model's names: transformers
    saves Gemma3ForConditionalGeneration's as `language_model.model.*` (`model.language_model.*`
    in some conversions); the vision tower and projector are left unread."""

    def __init__(self, files: CheckpointFiles):
        self.directory = files.directory
        for prefix, head in (("language_model.model.", "language_model.lm_head.weight"),
                             ("model.language_model.", "lm_head.weight")):
            if any(n.startswith(prefix) for n in files.tensors):
                break
        else:
            raise CheckpointError(f"{files.directory}: a multimodal checkpoint without language model tensors "
                                  "(language_model.model.* or model.language_model.*)")
        self.tensors = {"model." + n[len(prefix):]: info for n, info in files.tensors.items() if n.startswith(prefix)}
        if head in files.tensors:
            self.tensors["lm_head.weight"] = files.tensors[head]

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        return read_tensor(self.tensors[name], rows)


def load_hf(path: str | os.PathLike, mesh: Mesh, dtype: jax.typing.DTypeLike | None = None,
            scan_layers: bool = True) -> tuple[ModelConfig, dict]:
    """Reads an HF directory (`config.json` + safetensors shards) into sharded params on `mesh`.

    FP8 weights (`quant_method` "fp8", DeepSeek's block scales, or "compressed-tensors") are
    dequantised on load (`fp8_weights`), as are GPT-OSS's MXFP4 experts.
    Families: qwen3_moe, qwen2_moe, gpt_oss (dense or MXFP4 experts), mixtral,
    olmoe, glm4_moe, minimax_m2, the latent-attention deepseek_v2, deepseek_v3 and glm4_moe_lite, and the
    dense llama, mistral, qwen2, qwen3, gemma3_text (also the language model of a multimodal
    gemma3), phi3, granite, seed_oss, olmo2, olmo3 and smollm3 (`hf_config.SUPPORTED_FAMILIES`).

    Args:
      path: the HF model directory.
      mesh: the device mesh the params are sharded over; each process reads only its devices' shards.
      dtype: param (and compute) dtype; default (None) the config's `dtype`/`torch_dtype`, else float32.
      scan_layers: the params' layer layout (`ModelConfig.scan_layers`): True stacks each layer's
        weights on a leading dim; False gives one array per layer's weight (faster decode on CPU). The
        per-layer layout is split from the stacked one after loading (a transient second copy).
    Returns:
      `(cfg, params)`: the `ModelConfig`, and the params (a nested dict of `jax.Array`) laid out as
      `sfrrl_jax.models.transformer.param_shapes(cfg)` and sharded as
      `sfrrl_jax.models.api.param_shardings(cfg, mesh)`.
    Raises:
      HFConfigError: for unsupported configs.
      CheckpointError: for missing, unexpected, mis-shaped tensors or corrupt files.
      ValueError: when `cfg.n_experts` is not divisible by the mesh's expert axis size.
    """
    check_bool("load_hf scan_layers", scan_layers)
    path = Path(path)
    hf = read_hf_config(path)
    cfg = config_from_hf(hf, dtype=None if dtype is None else jnp.dtype(dtype).name,
                         where=str(path / "config.json"))
    check_mesh_fits(cfg, mesh)
    files = CheckpointFiles(path)
    if wrapped_by(hf.get("model_type")) is not None:   # a multimodal model (Gemma 3's): its language model
        files = _LanguageModelFiles(files)
    scheme = fp8_scheme(hf, str(path / "config.json"))
    if scheme is not None:   # FP8 weights read as the float32 values they stand for
        files = Fp8WeightFiles(files, scheme)
    quantized = is_mxfp4(files.tensors)
    # DeepSeek's RoPE rows pair adjacent dims unless config.json says otherwise (tensor_map)
    # (DeepSeek-V2's always do: transformers rotates them as complex pairs)
    interleaved = (spec_of(cfg.family).rope_always_interleaved
                   or bool_of(hf, "rope_interleave", str(path / "config.json"), True))
    per_layer = [layer_groups(cfg, layer, quantized, interleaved) for layer in range(cfg.n_layers)]
    glob = global_groups(cfg)
    validate_tensors(files, [g for gs in per_layer for g in gs] + glob, cfg)

    shapes = dict(flatten_tree(param_shapes(cfg)))
    shardings = dict(flatten_tree(param_shardings(cfg, mesh)))
    slots = [layer_slot(cfg, layer) for layer in range(cfg.n_layers)]
    covered = {(slot[0],) + leaf for slot, gs in zip(slots, per_layer) for g in gs for leaf in g.leaves} | {
        leaf for g in glob for leaf in g.leaves}
    if covered != set(shapes):
        raise AssertionError(f"tensor map for {cfg.family} covers {sorted(covered ^ set(shapes))} wrongly")
    # each leaf in its param's dtype: cfg.param_dtype, but fp32 where the model keeps one so
    # (sigmoid routing's selection bias)
    builders = {p: _LeafBuilder(p, shapes[p].shape, jnp.dtype(shapes[p].dtype), shardings[p], p[0] in STACK_KEYS)
                for p in shapes}
    read = files.read

    for slot, groups in zip(slots, per_layer):
        for group in groups:
            _run_group(group, builders, read, slot)
        # Bound the work in flight to one layer, so freed pieces do not pile up behind async dispatch.
        jax.block_until_ready([b.value for b in builders.values() if b.layered])
    for group in glob:
        _run_group(group, builders, read, None)
    params = unflatten_paths({p: b.value for p, b in builders.items()})
    if scan_layers:
        return cfg, params
    cfg = cfg.replace(scan_layers=False)
    return cfg, _unstacker(cfg, mesh)(params)


@functools.lru_cache(maxsize=8)
def _unstacker(cfg: ModelConfig, mesh: Mesh):
    """Stacked params -> cfg's per-layer layout, sharded as `param_shardings(cfg, mesh)` (the
    stacked input cannot be donated: no output has its shape)."""
    return jax.jit(functools.partial(unstack_layers, cfg), out_shardings=param_shardings(cfg, mesh))
