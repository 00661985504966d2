"""`save_hf`: (ModelConfig, params) -> an HF directory transformers loads with `from_pretrained`.

Writes `config.json` and the weights in the layout `save_pretrained` uses for the family
(Qwen3-MoE / Mixtral: one tensor per expert; GPT-OSS: fused, interleaved gate_up), in the params'
own dtype, split into shards of at most `max_shard_bytes` with `model.safetensors.index.json`.
GPT-OSS experts are written dense (not re-quantised to MXFP4).

Streaming: one layer of one leaf at a time is brought to the host (gathered across processes
when the array spans several), converted, and appended to the open shard file. Every process
must call `save_hf` (the gathers are collective); only process 0 writes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from sfrrl_jax.checkpoints.hf.hf_config import config_to_hf
from sfrrl_jax.checkpoints.hf.loader import flatten_tree
from sfrrl_jax.checkpoints.hf.safetensors_io import CheckpointError, ShardedWriter, dtype_code
from sfrrl_jax.checkpoints.hf.tensor_map import global_groups, layer_groups
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.models.transformer import STACK_KEYS, is_per_layer, layer_slot, layer_stacks, stacked_param_shapes

DEFAULT_MAX_SHARD_BYTES = 4 * 1024 ** 3


# One layer of a stacked leaf, as an array with the leaf's per-layer sharding (l is traced, so
# one compile serves every layer).
_layer_of = jax.jit(lambda x, l: jax.lax.dynamic_index_in_dim(x, l, 0, keepdims=False))


def _to_host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _flat_params(cfg: ModelConfig, params: dict) -> dict:
    """{path: leaf} of the stacked layout; a per-layer stack's leaf is the list of its rows."""
    if not is_per_layer(params):
        return dict(flatten_tree(params))
    out = dict(flatten_tree({k: v for k, v in params.items() if k not in STACK_KEYS}))
    for key, _ in layer_stacks(cfg):
        for layer_params in params.get(key, []):
            for p, leaf in flatten_tree(layer_params):
                out.setdefault((key,) + p, []).append(leaf)
    return out


def _shape_of(leaf) -> tuple[int, ...]:
    if isinstance(leaf, list):   # a per-layer stack's rows: [layers, ...] when they agree
        shapes = {tuple(row.shape) for row in leaf}
        return (len(leaf),) + shapes.pop() if len(shapes) == 1 else ("rows of different shapes",)
    return tuple(leaf.shape)


def _check_params(cfg: ModelConfig, params: dict) -> dict:
    want = dict(flatten_tree(stacked_param_shapes(cfg)))
    got = _flat_params(cfg, params)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(f"save_hf: params do not match ModelConfig(family={cfg.family!r}): missing "
                              f"{['/'.join(p) for p in missing]}, unexpected {['/'.join(p) for p in extra]}")
    for p, sds in want.items():
        if _shape_of(got[p]) != tuple(sds.shape):
            raise CheckpointError(f"save_hf: param {'/'.join(p)} has shape {_shape_of(got[p])}, "
                                  f"cfg expects {tuple(sds.shape)} (stacked [layers, ...])")
    return got


def _dtype_of(leaf):
    return leaf[0].dtype if isinstance(leaf, list) else leaf.dtype


def save_hf(cfg: ModelConfig, params: dict, path: str | os.PathLike,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Writes `params` as an HF checkpoint directory at `path` (created if needed); returns it.

    Every process must call it (the gathers are collective); only process 0 writes.

    Args:
      cfg: the model config; `config_to_hf(cfg)` is written as `config.json`.
      params: the params (a nested dict of `jax.Array`), laid out as
        `sfrrl_jax.models.transformer.param_shapes(cfg)`, stacked or per layer; written in their own dtype.
      path: the output directory.
      max_shard_bytes: the most bytes one safetensors shard file holds (default 4 GiB).
    Returns:
      `path`, as a `Path`.
    Raises:
      HFConfigError: when `cfg` uses a variant the HF class of its family cannot express.
      CheckpointError: when `params` do not match `cfg` (a missing or unexpected leaf, a wrong shape), or the
        leaves feeding one HF tensor differ in dtype.
    """
    hf_config = config_to_hf(cfg)
    flat = _check_params(cfg, params)
    layers = [layer_groups(cfg, layer) for layer in range(cfg.n_layers)]
    glob = global_groups(cfg)

    def leaf_path(leaf, slot):  # slot: (stack key, row) of a layer (`layer_slot`), None: global
        return leaf if slot is None else (slot[0],) + leaf

    def code_of(group, slot):
        codes = {dtype_code(_dtype_of(flat[leaf_path(leaf, slot)])) for leaf in group.leaves}
        if len(codes) != 1:
            raise CheckpointError(f"save_hf: leaves {group.leaves} feeding {list(group.hf)} differ in dtype {codes}")
        return codes.pop()

    order = [(g, None) for g in glob[:1]] + \
            [(g, layer_slot(cfg, layer)) for layer, gs in enumerate(layers) for g in gs] + \
            [(g, None) for g in glob[1:]]
    specs = [(name, shape, code_of(g, slot)) for g, slot in order for name, shape in g.hf.items()]
    writer_here = jax.process_index() == 0
    path = Path(path)
    if writer_here:
        path.mkdir(parents=True, exist_ok=True)
        writer = ShardedWriter(path, specs, max_shard_bytes)
    for group, slot in order:
        values = {}
        for leaf in group.leaves:
            if slot is None:
                values[leaf] = _to_host(flat[leaf])
            else:
                stacked = flat[leaf_path(leaf, slot)]
                row = stacked[slot[1]] if isinstance(stacked, list) else _layer_of(stacked, np.int32(slot[1]))
                values[leaf] = _to_host(row)
        tensors = group.dump(values)
        if writer_here:
            for name in group.hf:
                writer.write(name, tensors[name])
        del values, tensors
    if writer_here:
        writer.finish()
        (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return path
