"""Which PEFT module holds which of our adapted weights, per family: the map `peft_adapter` reads and
writes through.

A `Piece` is one of our adapted weights in one layer (and one expert) with the HF module whose rows
hold it, taken from the base loader's own tensor map (`tensor_map.layer_groups`), so every layout
change of a weight (head reshapes, Phi-3's fused rows, latent attention's RoPE row order, GPT-OSS's
interleaved gate / up) applies to its LoRA pair the same way. A `Pair` is one PEFT pair (A, B, its
scale) as read from a file or written to one.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from sfrrl_jax.checkpoints.hf.families import spec_of
from sfrrl_jax.checkpoints.hf.tensor_map import layer_groups
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.models.lora import TARGETS, LoraConfig, adapted_leaves, adapted_leaves_hit
from sfrrl_jax.models.transformer import layer_slot

EXPERT_PROJECTIONS = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}   # ours -> an expert's v4 module


@dataclasses.dataclass(frozen=True)
class Piece:
    """One of our adapted weights (one layer, one expert) and the HF module whose rows hold it."""

    target: str
    path: tuple[str, ...]       # the adapter leaf, e.g. ("layers", "attn", "q_proj")
    row: int                    # the layer's row in that stack
    expert: int | None          # the expert index of an experts' leaf
    module: str                 # the base HF module, e.g. "model.layers.0.self_attn.qkv_proj"
    hf_shape: tuple[int, int]   # the base module's weight [out, in]
    offset: int                 # its first row in the module (Phi-3's fused modules)
    rows: np.ndarray            # [prod(out_shape)]: HF rows (from offset) of our flat output dims
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    fused_at: int = 0           # an expert leaf's first row in the fused gate_up_proj pair (up: Qwen's F, GPT-OSS's 1)


@dataclasses.dataclass
class Pair:
    """One PEFT LoRA pair acting as W_hf += scale * b @ a (a per-expert slice of a fused one)."""

    key: str            # the module name in the file, for messages
    a: np.ndarray       # [rank, in]
    b: np.ndarray       # [out, rank]
    scale: float
    why: str            # where the rank and alpha came from, for messages


def rope_rows(cfg: ModelConfig, rel: tuple[str, ...], out_shape, interleaved: bool) -> np.ndarray:
    """HF row of each of our flat output dims: C order, with latent attention's RoPE rows taken as
    `tensor_map` takes the base's (evens then odds when the checkpoint interleaves them)."""
    rows = np.arange(math.prod(out_shape))
    if not cfg.mla_kv_rank or rel not in (("attn", "q_proj"), ("attn", "q_b_proj"), ("attn", "kv_a_proj")):
        return rows
    rope = cfg.mla_rope_dim
    order = np.r_[0:rope:2, 1:rope:2] if interleaved else np.arange(rope)
    per = out_shape[-1]                        # a head's [nope, rope] rows, or kv_a's [latent, rope]
    rows = rows.reshape(-1, per)
    rows[:, per - rope:] = rows[:, per - rope:][:, order]
    return rows.reshape(-1)


def model_pieces(cfg: ModelConfig, interleaved: bool) -> dict[str, list[Piece]]:
    """Every adaptable weight of a model of `cfg`, per target (`TARGETS` order), with its HF module
    (names from `tensor_map`). GPT-OSS's experts, one fused [E, in, out] parameter (gate and up
    interleaved on its columns), get per-expert module names of their own (`...experts.{e}.gate_proj`,
    which only the fused layout writes or reads), rows stepping by 2 from 0 (gate) or 1 (up)."""
    available = tuple(t for t in TARGETS if adapted_leaves_hit(cfg, t))
    leaves = {leaf.path: leaf for leaf in adapted_leaves(cfg, LoraConfig(targets=available))} if available else {}
    rows_of: dict = {}
    out: dict[str, list[Piece]] = {t: [] for t in available}
    for layer in range(cfg.n_layers):
        stack, row = layer_slot(cfg, layer)
        for group in layer_groups(cfg, layer):
            offset = 0   # a fused module's rows hold its leaves in turn
            for rel in group.leaves:
                leaf = leaves.get((stack,) + rel)
                if leaf is None:
                    continue
                cut = 1 + leaf.n_batch + leaf.n_in
                in_shape, out_shape = leaf.base_shape[1 + leaf.n_batch:cut], leaf.base_shape[cut:]
                if rel not in rows_of:
                    rows_of[rel] = rope_rows(cfg, rel, out_shape, interleaved)
                names = list(group.hf)
                n_out, n_in = math.prod(out_shape), math.prod(in_shape)
                if leaf.n_batch and len(group.hf[names[0]]) == 3:   # GPT-OSS: one [E, in, out] parameter
                    k, j = len(group.leaves), group.leaves.index(rel)   # gate_up: even columns gate, odd up
                    stem = names[0].rsplit(".", 1)[0]
                    out[leaf.target] += [Piece(leaf.target, leaf.path, row, e, f"{stem}.{e}.{EXPERT_PROJECTIONS[rel[-1]]}",
                                                (n_out, n_in), 0, k * np.arange(n_out), in_shape, out_shape, j)
                                         for e in range(cfg.n_experts)]
                else:
                    out[leaf.target] += [Piece(leaf.target, leaf.path, row, e if leaf.n_batch else None,
                                                name.removesuffix(".weight"), tuple(group.hf[name]), offset,
                                                rows_of[rel], in_shape, out_shape,
                                                n_out if leaf.n_batch and rel[-1] == "w_up" else 0)
                                         for e, name in enumerate(names)]
                offset += n_out
    return out


def rope_is_interleaved(cfg: ModelConfig, rope_interleaved: bool | None) -> bool:
    return spec_of(cfg.family).rope_always_interleaved or (True if rope_interleaved is None else rope_interleaved)


def pattern_value(patterns: dict, name: str, default, field: str):
    """(value, why) for module `name`: the first key of `patterns` matching its end (as PEFT
    matches `rank_pattern` / `alpha_pattern`), else `default`."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value, f"{field} {key!r}"
    return default, None


# -- loading -------------------------------------------------------------------------------------
