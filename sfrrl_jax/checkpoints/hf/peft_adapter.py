"""PEFT LoRA adapter directories <-> `LoraAdapter`: `load_adapter`, `save_adapter`.

A PEFT (0.22) LoRA directory holds `adapter_config.json` and `adapter_model.safetensors` with one
pair per adapted HF module, `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r], acting as `W_hf += s * B @ A` (s = lora_alpha / r, or / sqrt(r) with `use_rslora`; r and
alpha per module through `rank_pattern` / `alpha_pattern`). Ours act as `W_ours + s * a @ b` with
`W_ours [*batch, *in, *out]` (x @ W), so a is A^T and b is B^T, their in / out sides laid out as
the base weight's are in `tensor_map`: flat HF columns are our input dims in C order, flat HF rows
our output dims in C order, except that latent attention's RoPE rows are permuted as the base's
(`tensor_map._latent_attention`), Phi-3's fused `qkv_proj` / `gate_up_proj` hold several of our
weights in turn on their rows, and the experts are one HF module per expert (GPT-OSS: see below).

Experts come in two layouts, both read: one module per expert (transformers-v4 names,
`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`; peft 0.22 converts them
when it loads them into a transformers-5 model), and peft 0.22's own `target_parameters` layout on
the fused 3-D parameters: `mlp.experts.base_layer.lora_*` for `gate_up_proj` and `mlp.experts.lora_*`
for `down_proj` when both are targeted (else `mlp.experts.lora_*` for the one), A `[r*E, in]` expert
major (`A.reshape(E, r, in)[e]`), B `[out, r*E]` rank major (`B[:, e::E]`), gate rows before up rows.
GPT-OSS has only that layout (its experts were never per-expert modules; peft 0.22 has no conversion
for it): the same keys, slicing and `W_e += s * B_e @ A_e` on its parameters stored [E, in, out]
(`is_transposed`), i.e. `param[e] += s * (B_e @ A_e)^T`, B's rows being the parameter's output
columns: gate_up_proj's even ones the gate's, odd ones the up's (interleaved, as `tensor_map`'s).

One HF pair feeding several of our weights (a fused module) is copied to each, its B split by
rows; when its rank is k times the others' and each part's B rows use only their own block of
columns (the block form `save_adapter` writes and peft's own per-expert conversion makes), each
part takes its block. Pairs of lower rank are zero-padded to the adapter's one rank (exact: the
padding adds nothing and gets no gradient); every pair must have one scale. Saving writes the
per-expert layout by default (or `expert_layout="fused"`; GPT-OSS: always fused, its B's gate and up
columns interleaved back), fused Phi-3 modules in block form with
`rank_pattern` / `alpha_pattern` keeping each part's scale.

Latent attention's RoPE row order is the base checkpoint's (`rope_interleave` in its config.json,
which the adapter directory does not carry): both functions take `rope_interleaved` (default True,
DeepSeek's layout and what `save_hf` writes); a base read with `rope_interleave: false` needs False.
Refused, by the config field or tensor name: anything but plain LoRA pairs on the base's linear
weights (DoRA, modules_to_save, layers_to_transform / layers_pattern / exclude_modules, biases,
fan_in_fan_out, base-rewriting inits such as PiSSA or LoftQ, embedding / LM-head LoRA, ...), a
tensor that maps to no weight or has the wrong shape, and modules of different scales.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from sfrrl_jax.checkpoints.hf.families import spec_of
from sfrrl_jax.checkpoints.hf.peft_modules import Pair, Piece, model_pieces, pattern_value, rope_is_interleaved
from sfrrl_jax.checkpoints.hf.safetensors_io import (CheckpointError, SafetensorsFile, ShardedWriter, dtype_code,
                                                     read_tensor)
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.models.lora import (EXPERT_TARGETS, LoraAdapter, LoraConfig, adapted_leaves, adapter_shardings,
                                   check_adapter)

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "load_adapter", "save_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
_EXPERT_LEAVES = {"w_gate": "gate_up_proj", "w_up": "gate_up_proj", "w_down": "down_proj"}  # ours -> fused HF param

# adapter_config.json fields whose non-default values change what the adapter computes or where it
# applies, and that are not built here: refused by name (value -> is it the default).
_REFUSED = {
    "use_dora": lambda v: not v, "lora_bias": lambda v: not v, "fan_in_fan_out": lambda v: not v,
    "bias": lambda v: v in (None, "none"), "modules_to_save": lambda v: not v,
    "layers_to_transform": lambda v: v is None, "layers_pattern": lambda v: not v,
    "exclude_modules": lambda v: not v, "megatron_config": lambda v: v is None,
    "trainable_token_indices": lambda v: not v, "layer_replication": lambda v: not v,
    "use_qalora": lambda v: not v, "alora_invocation_tokens": lambda v: not v, "use_bdlora": lambda v: not v,
    "ensure_weight_tying": lambda v: not v, "loftq_config": lambda v: not v, "corda_config": lambda v: v is None,
    "astra_config": lambda v: v is None, "lora_ga_config": lambda v: v is None, "velora_config": lambda v: v is None,
    "monteclora_config": lambda v: v is None, "arrow_config": lambda v: v is None, "kasa_config": lambda v: v is None,
}
# init_lora_weights values that only draw the initial A and B; the others (pissa, olora, corda,
# loftq, ...) also rewrite the base weights, so the adapter is only right on that modified base.
_INIT_ONLY = (True, False, "gaussian", "eva", "orthogonal", "nora", "mica")
_NOT_BUILT = {"embed_tokens": "LoRA on the embedding is not built", "lm_head": "LoRA on the LM head is not built",
              "kv_b_proj": "latent attention's kv_b_proj is absorbed in the engine and cannot be adapted"}


def _read_config(directory: Path) -> dict:
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    try:
        conf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if conf.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type {conf.get('peft_type')!r}; only 'LORA' adapters are read")
    for field, is_default in _REFUSED.items():
        if not is_default(conf.get(field)):
            raise CheckpointError(f"{path}: {field}={conf[field]!r} is not supported (only plain LoRA pairs "
                                  f"on the base's linear weights are read)")
    init = conf.get("init_lora_weights", True)
    if init not in _INIT_ONLY:
        raise CheckpointError(f"{path}: init_lora_weights={init!r} rewrites the base weights at init (or is "
                              f"unknown); such an adapter only fits that modified base. Read: {list(_INIT_ONLY)}")
    if not conf.get("target_modules") and not conf.get("target_parameters"):
        raise CheckpointError(f"{path}: no target_modules or target_parameters (PEFT would fall back on its "
                              "per-model default targets)")
    listed = conf.get("target_modules") if isinstance(conf.get("target_modules"), list) else []
    for target in listed:
        for name, why in _NOT_BUILT.items():
            if target == name or target.endswith("." + name):
                raise CheckpointError(f"{path}: target_modules names {target!r}: {why}")
    for field in ("r", "lora_alpha"):
        if not isinstance(conf.get(field), (int, float)) or isinstance(conf.get(field), bool) or conf[field] <= 0:
            raise CheckpointError(f"{path}: {field} must be a positive number, got {conf.get(field)!r}")
    return conf


def _read_modules(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    """{module name (no prefix): {"A": [r, in], "B": [out, r]}} from the safetensors file (fp32)."""
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise CheckpointError(f"{directory}: only adapter_model.bin (a pickle) is present; save the adapter as "
                                  f"{ADAPTER_WEIGHTS} (safetensors, PEFT's default)")
        raise CheckpointError(f"{directory}: no {ADAPTER_WEIGHTS}")
    file = SafetensorsFile(path)
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, info in file.tensors.items():
        if "lora_embedding_" in key or any(f".{n}." in key for n in ("embed_tokens", "lm_head")):
            raise CheckpointError(f"{path}: tensor {key!r}: LoRA on the embedding / LM head is not built")
        if "lora_magnitude_vector" in key:
            raise CheckpointError(f"{path}: tensor {key!r} is DoRA's magnitude (use_dora), which is not built")
        if not key.startswith(_PREFIX) or not key.endswith((_A, _B)):
            raise CheckpointError(f"{path}: tensor {key!r} is not a LoRA pair's "
                                  f"'{_PREFIX}<module>{_A}' / '{_B}'; it maps to nothing")
        name, side = key[len(_PREFIX):-len(_A)], "A" if key.endswith(_A) else "B"
        modules.setdefault(name, {})[side] = read_tensor(info).astype(np.float32)
    for name, pair in modules.items():
        if set(pair) != {"A", "B"}:
            missing = _A if "A" not in pair else _B
            raise CheckpointError(f"{path}: {_PREFIX}{name}{missing} is missing (its other half is there)")
    if not modules:
        raise CheckpointError(f"{path}: holds no LoRA tensors")
    return modules


def _check_shape(where: Path, key: str, array: np.ndarray, want: tuple, why: str | None) -> None:
    if tuple(array.shape) != tuple(want):
        raise CheckpointError(f"{where}: tensor {_PREFIX}{key} has shape {tuple(array.shape)}, expected "
                              f"{tuple(want)} (rank from {why or 'r'})")


def _module_scale(conf: dict, name: str) -> tuple[float, int, str]:
    """(scale, rank, where they came from) of the PEFT module (or parameter) `name`."""
    r, why_r = pattern_value(conf.get("rank_pattern"), name, conf["r"], "rank_pattern")
    alpha, why_a = pattern_value(conf.get("alpha_pattern"), name, conf["lora_alpha"], "alpha_pattern")
    why = f"r={r}" + (f" from {why_r}" if why_r else "") + f", lora_alpha={alpha}" + (f" from {why_a}" if why_a else "")
    return alpha / (math.sqrt(r) if conf.get("use_rslora") else r), r, why


def _fused_expert_pairs(cfg: ModelConfig, conf: dict, name: str, pair: dict, experts: dict, where: Path) -> dict:
    """{per-expert base module: (pair, row offset)} from one fused `target_parameters` pair on
    `model.layers.{L}.mlp.experts` (gate_up_proj or down_proj, which follows from target_parameters)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts(\.base_layer)?", name)
    layer = int(m.group(1))
    stem = f"model.layers.{layer}.mlp.experts."
    targeted = conf.get("target_parameters") or []
    hit = [p for p in ("gate_up_proj", "down_proj")
           if any(stem + p == t or (stem + p).endswith("." + t) for t in targeted)]
    # peft nests one wrapper per targeted parameter in registration order: gate_up_proj's inside
    # (`experts.base_layer`), down_proj's outside (`experts`); a lone one is `experts`
    param = (hit[0] if m.group(2) else hit[-1]) if len(hit) == 2 or (hit and not m.group(2)) else None
    if param is None or (layer, param) not in experts:
        raise CheckpointError(f"{where}: tensor {_PREFIX}{name}{_A}: which expert parameter it adapts follows from "
                              f"target_parameters ({targeted!r}), which name {hit or 'no experts parameter'} here")
    parts = experts[(layer, param)]
    gate = parts.get("w_gate") or parts["w_down"]
    n_exp, (rows, in_hf) = cfg.n_experts, gate[0].hf_shape
    out_hf = rows * (2 if param == "gate_up_proj" else 1)
    s, r, why = _module_scale(conf, stem + param)
    _check_shape(where, name + _A, pair["A"], (r * n_exp, in_hf), why)
    _check_shape(where, name + _B, pair["B"], (out_hf, r * n_exp), why)
    a, b = pair["A"].reshape(n_exp, r, in_hf), pair["B"].reshape(out_hf, r, n_exp)   # expert / rank major
    out = {}
    for e in range(n_exp):
        one = Pair(f"{name}[expert {e}]", a[e], b[:, :, e], s, why)
        if param == "gate_up_proj":   # one pair over [gate; up] (GPT-OSS: interleaved): A shared
            for g in (parts["w_gate"][e], parts["w_up"][e]):
                out[g.module] = (one, g.fused_at)
        else:
            out[parts["w_down"][e].module] = (one, 0)
    return out


def _pairs(cfg: ModelConfig, conf: dict, modules: dict, pieces: dict, where: Path) -> dict[str, tuple[Pair, int]]:
    """{base module name: (pair, row offset of the module in the pair)} for every module in the file."""
    every = [p for ps in pieces.values() for p in ps]
    # GPT-OSS's experts are no HF modules: only the fused pairs below reach them
    fused = spec_of(cfg.family).tensor_names.fused_experts
    known = {p.module: p for p in every if not (fused and p.expert is not None)}
    # transformers 5 names Mixtral's (and MiniMax-M2's) `block_sparse_moe` `mlp`: peft 0.22 writes that
    prefix = spec_of(cfg.family).tensor_names.moe_prefix
    alias = {} if prefix == "mlp." else {
        re.sub(rf"^(model\.layers\.\d+\.){re.escape(prefix)}", r"\1mlp.", m): m for m in known}
    experts: dict = {}   # (layer, "gate_up_proj" | "down_proj") -> {our leaf: {expert: piece}}
    for p in every:
        if p.expert is not None:
            key = (int(p.module.split(".")[2]), _EXPERT_LEAVES[p.path[-1]])
            experts.setdefault(key, {}).setdefault(p.path[-1], {})[p.expert] = p
    out: dict[str, tuple[Pair, int]] = {}
    for name, pair in modules.items():
        base = name if name in known else alias.get(name)
        if base is not None:
            # peft wraps the router's weight as a parameter (transformers 5's router is no Linear),
            # so its patterns see the parameter's name
            s, r, why = _module_scale(conf, name + ".weight" if known[base].target == "router" else name)
            out_hf, in_hf = known[base].hf_shape
            _check_shape(where, name + _A, pair["A"], (r, in_hf), why)
            _check_shape(where, name + _B, pair["B"], (out_hf, r), why)
            out[base] = (Pair(name, pair["A"], pair["B"], s, why), 0)
        elif re.fullmatch(r"model\.layers\.\d+\.mlp\.experts(\.base_layer)?", name) and experts:
            out.update(_fused_expert_pairs(cfg, conf, name, pair, experts, where))
        else:
            bad = next((why for n, why in _NOT_BUILT.items() if name.endswith("." + n)), None)
            raise CheckpointError(f"{where}: tensor {_PREFIX}{name}{_A} maps to no weight of this {cfg.family} "
                                  f"model" + (f": {bad}" if bad else ""))
    return out


def _slices(pieces: list[Piece], pairs: dict) -> dict:
    """{(module, leaf path): (a [rank, in], b [out_flat, rank], pair)} per piece: the consumers of a
    pair (Phi-3's q, k, v of one qkv_proj; an expert's gate and up) take it whole (a shared A), or
    each its own block of rank / k columns when every part's B rows are zero outside its block
    (the block form), in row order."""
    consumers: dict[int, list] = {}
    for p in pieces:
        pair, extra = pairs[p.module]
        consumers.setdefault(id(pair), []).append((extra + p.offset, p))
    out = {}
    for group in consumers.values():
        group.sort(key=lambda x: x[0])
        pair = pairs[group[0][1].module][0]
        rank, k = pair.a.shape[0], len(group)
        cols = [pair.b[start + p.rows] for start, p in group]      # each part's B rows [out_flat, rank]
        block = rank // k if k > 1 and rank % k == 0 else None
        if block is not None:
            outside = [np.delete(c, np.s_[j * block:(j + 1) * block], axis=1) for j, c in enumerate(cols)]
            block = block if not any(np.any(o) for o in outside) else None
        for j, ((_, p), c) in enumerate(zip(group, cols)):
            take = np.s_[:] if block is None else np.s_[j * block:(j + 1) * block]
            out[(p.module, p.path)] = (pair.a[take], c[:, take], pair)
    return out


def load_adapter(peft_dir: str | os.PathLike, cfg: ModelConfig, mesh: Mesh, dtype: str | None = None, *,
                 rope_interleaved: bool | None = None) -> LoraAdapter:
    """Reads a PEFT LoRA directory into a `LoraAdapter` for a model of `cfg`, sharded on `mesh`.

    Every process reads the whole (small) file; the arrays are placed with
    `jax.make_array_from_callback` in `adapter_shardings(cfg, config, mesh)`.

    Args:
      peft_dir: the directory `PeftModel.save_pretrained` wrote (`adapter_config.json`,
        `adapter_model.safetensors`).
      cfg: the base model's config (the adapter's keys are HF module names of its family).
      mesh: the mesh the params live on.
      dtype: the adapter's storage dtype; default float32 (what is trained).
      rope_interleaved: latent attention only: the base checkpoint's `rope_interleave` (config.json),
        as `load_hf` read it; default True (DeepSeek's layout, and what `save_hf` writes).
    Returns:
      A `LoraAdapter` whose `LoraConfig` has the file's rank (pairs of lower rank zero-padded to the
      highest), scale, lora_dropout, use_rslora, and as targets (`models.lora.TARGETS` names, in
      that order) every weight a pair of the file adapts. A fused HF module (Phi-3's qkv_proj,
      the experts' gate_up_proj) adapts each of our weights it holds.
    Raises:
      CheckpointError (a ValueError): naming the config field of an unsupported PEFT feature (DoRA,
        modules_to_save, layers_to_transform, bias, lora_bias, a base-rewriting init_lora_weights,
        ...), a tensor that maps to no weight, a tensor of the wrong shape (with the expected one),
        a missing tensor of a target the file adapts elsewhere, or modules of different scales.
    """
    directory = Path(peft_dir)
    conf = _read_config(directory)
    modules = _read_modules(directory)
    pieces = model_pieces(cfg, rope_is_interleaved(cfg, rope_interleaved))
    pairs = _pairs(cfg, conf, modules, pieces, directory)
    present = [t for t, ps in pieces.items() if any(p.module in pairs for p in ps)]
    for target in present:
        for p in pieces[target]:
            if p.module not in pairs:
                raise CheckpointError(f"{directory}: the adapter adapts {target} but has no {_PREFIX}{p.module}{_A} "
                                      "(one LoraConfig adapts a target in every layer)")
    used = [p for t in present for p in pieces[t]]
    slices = _slices(used, pairs)
    scales = {pair.key: (pair.scale, pair.why) for _, _, pair in slices.values()}
    first = next(iter(scales.items()))
    for key, (s, why) in scales.items():
        if not math.isclose(s, first[1][0], rel_tol=1e-9):
            raise CheckpointError(f"{directory}: module {key} has LoRA scale {s} ({why}) but {first[0]} has "
                                  f"{first[1][0]} ({first[1][1]}); one LoraConfig holds one scale")
    rank = max(a.shape[0] for a, _, _ in slices.values())
    scale, rslora = first[1][0], bool(conf.get("use_rslora", False))
    alpha = float(conf["lora_alpha"])
    if not math.isclose(alpha / (math.sqrt(rank) if rslora else rank), scale, rel_tol=1e-9):
        alpha = scale * (math.sqrt(rank) if rslora else rank)
    lora_cfg = LoraConfig(rank=rank, alpha=alpha, dropout=float(conf.get("lora_dropout") or 0.0),
                          targets=tuple(present), use_rslora=rslora, dtype=dtype or "float32")
    host: dict = {}
    for leaf in adapted_leaves(cfg, lora_cfg):
        cut = 1 + leaf.n_batch + leaf.n_in
        host[leaf.path] = (np.zeros(leaf.base_shape[:cut] + (rank,), np.float32),
                           np.zeros(leaf.base_shape[:1 + leaf.n_batch] + (rank,) + leaf.base_shape[cut:], np.float32))
    for p in used:
        a, b, _ = slices[(p.module, p.path)]
        at = (p.row,) if p.expert is None else (p.row, p.expert)
        r = a.shape[0]   # < rank: the rest stays zero (padding)
        host[p.path][0][at][..., :r] = a.T.reshape(p.in_shape + (r,))
        host[p.path][1][at][:r] = b.T.reshape((r,) + p.out_shape)
    shardings = adapter_shardings(cfg, lora_cfg, mesh)
    np_dtype = np.dtype(jnp.dtype(lora_cfg.dtype))
    weights: dict = {}
    for path, (a, b) in host.items():
        node, sharding = weights, shardings
        for key in path:
            node, sharding = node.setdefault(key, {}), sharding[key]
        for side, x in (("a", a.astype(np_dtype)), ("b", b.astype(np_dtype))):
            node[side] = jax.make_array_from_callback(x.shape, sharding[side], lambda index, x=x: x[index])
    return LoraAdapter(weights, lora_cfg)


# -- saving --------------------------------------------------------------------------------------

def _to_host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _relative(module: str) -> str:
    """A module's name below its layer (`model.layers.3.self_attn.q_proj` -> `self_attn.q_proj`)."""
    return re.sub(r"^model\.layers\.\d+\.", "", module)


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _hf_groups(lc: LoraConfig, pieces: dict, fused: bool) -> dict:
    """Our pieces grouped by the HF pair they are written to: {(module, None): {None: parts}} for a
    module (Phi-3's fused ones hold several parts), {(experts container, param): {expert: parts}}
    for the fused expert layout; parts = [(row offset in the pair, piece)]."""
    groups: dict = {}
    for t in lc.targets:
        for p in pieces[t]:
            if fused and p.expert is not None:
                layer, param = p.module.split(".")[2], _EXPERT_LEAVES[p.path[-1]]
                extra = p.fused_at   # up's rows follow gate's (GPT-OSS: interleave with them)
                key = (f"model.layers.{layer}.mlp.experts", param)     # transformers 5's name, Mixtral's too
                groups.setdefault(key, {}).setdefault(p.expert, []).append((extra, p))
            else:
                groups.setdefault((p.module, None), {}).setdefault(None, []).append((0, p))
    return groups


def _block_pair(weights: dict, parts: list, rank: int, out_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(A [k*rank, in], B [out_rows, k*rank], k) of one HF pair from its k parts: the parts' a
    stacked, their b block diagonal (each part's rows use its own block), parts in row order, so
    W_hf[part rows] += s * B_j A_j exactly for each; k = 1 is the plain pair."""
    parts = sorted(parts, key=lambda x: x[0] + x[1].offset)
    a_all = np.zeros((len(parts) * rank, parts[0][1].hf_shape[1]), np.float32)
    b_all = np.zeros((out_rows, len(parts) * rank), np.float32)
    for j, (extra, p) in enumerate(parts):
        a, b = weights[p.path]
        at = (p.row,) if p.expert is None else (p.row, p.expert)
        a_all[j * rank:(j + 1) * rank] = a[at].reshape(-1, rank).T
        b_all[extra + p.offset + p.rows, j * rank:(j + 1) * rank] = b[at].reshape(rank, -1).T
    return a_all, b_all, len(parts)


def _hf_tensors(cfg: ModelConfig, lc: LoraConfig, groups: dict, weights: dict) -> tuple[dict, dict]:
    """({module key: (A, B)}, {rank_pattern key: (rank, alpha)}) for the groups."""
    tensors, patterns = {}, {}
    for (module, param), by_expert in groups.items():
        if param is None:
            a, b, k = _block_pair(weights, by_expert[None], lc.rank, by_expert[None][0][1].hf_shape[0])
            tensors[module] = (a, b)
            suffix = _relative(module)
        else:
            out_rows = by_expert[0][0][1].hf_shape[0] * (2 if param == "gate_up_proj" else 1)
            per = [_block_pair(weights, by_expert[e], lc.rank, out_rows) for e in range(cfg.n_experts)]
            k = per[0][2]
            a = np.concatenate([x[0] for x in per])                                 # expert major
            b = np.stack([x[1] for x in per], axis=-1).reshape(out_rows, -1)         # rank major
            # peft nests one wrapper per targeted parameter: gate_up_proj's inside down_proj's
            nested = ".base_layer" if param == "gate_up_proj" and (module, "down_proj") in groups else ""
            tensors[module + nested] = (a, b)
            suffix = "experts." + param
        if k > 1:   # block form: rank k*R, alpha scaled so that each part keeps the adapter's scale
            patterns[re.escape(suffix)] = (k * lc.rank, _number(lc.alpha * (math.sqrt(k) if lc.use_rslora else k)))
    return tensors, patterns


def _peft_config(lc: LoraConfig, groups: dict, patterns: dict) -> dict:
    """adapter_config.json: PEFT's fields, targets named as peft 0.22 on transformers 5 matches them."""
    modules, params = set(), set()
    for (module, param), by_expert in groups.items():
        piece = next(iter(by_expert.values()))[0][1]
        if param is not None:
            params.add("experts." + param)
        elif piece.target == "router":   # transformers 5's router is no Linear: its weight is a parameter
            params.add(module.split(".")[-1] + ".weight")
        elif piece.expert is not None:   # experts.{proj} (no index, no moe prefix): what peft converts
            modules.add("experts." + module.split(".")[-1])
        else:   # below the layer, so a MoE model's dense MLP is not mistaken for its experts
            modules.add(_relative(module))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.rank, "lora_alpha": _number(lc.alpha),
        "lora_dropout": lc.dropout, "use_rslora": lc.use_rslora, "bias": "none", "use_dora": False,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "base_model_name_or_path": None,
        "target_modules": sorted(modules) or None, "target_parameters": sorted(params) or None,
        "rank_pattern": {k: v[0] for k, v in sorted(patterns.items())},
        "alpha_pattern": {k: v[1] for k, v in sorted(patterns.items())},
    }


def _write(out_dir: Path, tensors: dict, config: dict, dtype) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    specs, arrays = [], []
    for module in sorted(tensors):
        for side, x in zip((_A, _B), tensors[module]):
            x = np.ascontiguousarray(x.astype(dtype))
            specs.append((_PREFIX + module + side, x.shape, dtype_code(x.dtype)))
            arrays.append(x)
    # the writer names a single shard model.safetensors: write it aside (never over a base model
    # saved in the same directory), then move it into place
    staging = out_dir / ".adapter_staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    writer = ShardedWriter(staging, specs, max_shard_bytes=1 << 62)
    for (name, _, _), x in zip(specs, arrays):
        writer.write(name, x)
    (written,) = writer.finish()
    os.replace(staging / written, out_dir / ADAPTER_WEIGHTS)
    staging.rmdir()
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_adapter(adapter: LoraAdapter, cfg: ModelConfig, lora_cfg: LoraConfig | str | os.PathLike | None = None,
                 out_dir: str | os.PathLike | None = None, *, expert_layout: str | None = None,
                 rope_interleaved: bool | None = None) -> Path:
    """Writes `adapter` as a PEFT LoRA directory that `peft.PeftModel.from_pretrained` loads onto the
    transformers model of the same base (e.g. the one `save_hf` writes).

    Every process must call it (sharded arrays are gathered); only process 0 writes. Also callable as
    `save_adapter(adapter, cfg, out_dir)`. Phi-3's fused qkv_proj / gate_up_proj (and, fused, an
    expert's gate_up_proj) are written in block form: rank k*r, our k pairs' A stacked and B block
    diagonal, with `rank_pattern` / `alpha_pattern` keeping the scale alpha / r.

    Args:
      adapter: the `LoraAdapter`.
      cfg: the base model's config.
      lora_cfg: `adapter.config` (checked equal), or None; a path here is taken as `out_dir`.
      out_dir: the directory to write (created if needed).
      expert_layout: "per_expert" (one module per expert under transformers-v4 names,
        `mlp.experts.{e}.gate_proj` / Mixtral's `block_sparse_moe.experts.{e}.w1`, which peft 0.22
        converts on load; it cannot express gate without up, nor rsLoRA on both, which its
        conversion rescales, nor GPT-OSS's experts), "fused" (peft 0.22's own `target_parameters`
        layout), or None (the default): per-expert where it can express the adapter, else fused.
      rope_interleaved: latent attention only: the HF base's `rope_interleave`; default True (what
        `save_hf` writes).
    Returns:
      `out_dir` as a Path, holding `adapter_config.json` (task_type CAUSAL_LM, r, lora_alpha,
      lora_dropout, use_rslora, target_modules / target_parameters, rank_pattern / alpha_pattern)
      and `adapter_model.safetensors` in the adapter's dtype.
    Raises:
      ValueError: `lora_cfg` differs from `adapter.config`, no `out_dir`, an unknown layout, what
        the chosen layout cannot express, or an adapter that does not fit `cfg`.
    """
    if isinstance(lora_cfg, (str, os.PathLike)):
        if out_dir is not None:
            raise ValueError("save_adapter: out_dir given twice (the third argument is a path)")
        lora_cfg, out_dir = None, lora_cfg
    if out_dir is None:
        raise ValueError("save_adapter: no out_dir")
    if lora_cfg is not None and lora_cfg != adapter.config:
        raise ValueError(f"save_adapter: lora_cfg {lora_cfg} differs from the adapter's own {adapter.config}")
    if expert_layout not in (None, "per_expert", "fused"):
        raise ValueError(f"save_adapter: expert_layout must be 'per_expert', 'fused' or None, got {expert_layout!r}")
    check_adapter(cfg, adapter)
    lc = adapter.config
    gate_up = {t for t in lc.targets if t in ("experts.gate_proj", "experts.up_proj")}
    fused_only = spec_of(cfg.family).tensor_names.fused_experts
    if expert_layout is None:   # per-expert unless it cannot say this adapter (see the checks below)
        expert_layout = ("fused" if fused_only or len(gate_up) == 1 or (lc.use_rslora and len(gate_up) == 2)
                         else "per_expert")
    if expert_layout == "per_expert" and fused_only and any(t in EXPERT_TARGETS for t in lc.targets):
        raise ValueError(f"save_adapter: {cfg.family}'s experts are fused parameters in transformers (never one module "
                         f"per expert), and peft 0.22 has no per-expert conversion for them; use expert_layout='fused'")
    pieces = model_pieces(cfg, rope_is_interleaved(cfg, rope_interleaved))
    if expert_layout == "per_expert" and len(gate_up) == 1:
        raise ValueError(f"save_adapter: peft fuses the experts' gate and up and refuses a per-expert adapter of "
                         f"{gate_up.pop()} alone; use expert_layout='fused'")
    if expert_layout == "per_expert" and lc.use_rslora and len(gate_up) == 2:
        raise ValueError("save_adapter: peft 0.22 loads a per-expert gate/up adapter as rank 2r with alpha 2*alpha, "
                         "which changes an rsLoRA scale; use expert_layout='fused'")
    weights = {}
    for leaf in adapted_leaves(cfg, lc):
        node = adapter.weights
        for key in leaf.path:
            node = node[key]
        weights[leaf.path] = (_to_host(node["a"]), _to_host(node["b"]))
    groups = _hf_groups(lc, pieces, fused=expert_layout == "fused")
    tensors, patterns = _hf_tensors(cfg, lc, groups, weights)
    out_dir = Path(out_dir)
    if jax.process_index() == 0:
        _write(out_dir, tensors, _peft_config(lc, groups, patterns), next(iter(weights.values()))[0].dtype)
    return out_dir
