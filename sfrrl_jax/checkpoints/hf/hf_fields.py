"""Typed reads of HF `config.json` fields, shared by the family readers: every value is checked
for its type and range, and a bad one is an `HFConfigError` naming the key (`int()` would quietly
make a 2-layer model of `num_hidden_layers: 2.5`). Also RoPE parameters both ways (transformers
5's `rope_parameters`, or 4.x's `rope_theta` + `rope_scaling`) and HF's layer kinds."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from sfrrl_jax.config import MODEL_DTYPES, ModelConfig

HF_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
TO_HF_LAYER_TYPES = {ours: theirs for theirs, ours in HF_LAYER_TYPES.items()}
_LLAMA3_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"}
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow",
              "original_max_position_embeddings", "truncate", "attention_factor", "mscale", "mscale_all_dim"}
_LINEAR_KEYS = {"rope_type", "type", "rope_theta", "factor"}
LONGROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "attention_factor", "long_factor", "short_factor",
                 "original_max_position_embeddings", "partial_rotary_factor"}


class HFConfigError(ValueError):
    """The HF config names a family or a variant our model does not implement."""


def read_hf_config(path: str | os.PathLike) -> dict:
    """The parsed `config.json` of an HF model directory.

    Args:
      path: the model directory.
    Returns:
      The JSON object, as a dict.
    Raises:
      HFConfigError: when the directory has no `config.json`, or it is not valid JSON.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFConfigError(f"{Path(path)}: no config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{file}: not valid JSON ({e})") from None


def value_of(hf: Mapping[str, Any], key: str, where: str, default=...):
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise HFConfigError(f"{where}: config.json lacks required key {key!r}")
    return default


def int_of(hf: Mapping[str, Any], key: str, where: str, default=..., lo: int = 1) -> int:
    """`hf[key]` as an int >= lo (an integral float like 2.0 too), or an error naming the key:
    int(2.5) would quietly make a 2-layer model of a 2.5-layer config."""
    value = value_of(hf, key, where, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HFConfigError(f"{where}: {key}={value!r} must be an integer")
    if value < lo:
        raise HFConfigError(f"{where}: {key}={value} must be >= {lo}")
    return value


def float_of(hf: Mapping[str, Any], key: str, where: str, default=...) -> float:
    value = value_of(hf, key, where, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFConfigError(f"{where}: {key}={value!r} must be a number")
    return float(value)


def bool_of(hf: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = value_of(hf, key, where, default)
    if not isinstance(value, bool):
        raise HFConfigError(f"{where}: {key}={value!r} must be true or false")
    return value


#: The param / compute dtypes a config.json may name (`dtype`, or 4.x's `torch_dtype`).
DTYPES = MODEL_DTYPES


def rope_of(hf: Mapping[str, Any], where: str, default_theta: float) -> dict:
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(field) or {}
    if not isinstance(params, Mapping):
        raise HFConfigError(f"{where}: {field}={params!r} must be an object")
    params = dict(params)
    at = f"{where} {field}"
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float_of({"rope_theta": params.get("rope_theta", hf.get("rope_theta"))}, "rope_theta", where, default_theta)
    max_len = int_of(hf, "max_position_embeddings", where)
    if kind == "default":
        return {"rope_theta": theta, "rope_type": "default"}
    if kind == "linear":   # positions divided by `factor` (Gemma 3's global layers, 4B and up)
        unknown = sorted(set(params) - _LINEAR_KEYS)
        if unknown:
            raise HFConfigError(f"{where}: linear rope parameter(s) {unknown} are not supported; "
                                f"supported: {sorted(_LINEAR_KEYS)}")
        if params.get("factor") is None:
            raise HFConfigError(f"{where}: linear rope needs 'factor'")
        return {"rope_theta": theta, "rope_type": "linear", "rope_factor": float_of(params, "factor", at)}
    if kind == "llama3":
        unknown = sorted(set(params) - _LLAMA3_KEYS)
        if unknown:
            raise HFConfigError(f"{where}: llama3 rope parameter(s) {unknown} are not supported; "
                                f"supported: {sorted(_LLAMA3_KEYS)}")
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if params.get(k) is None]
        if missing:
            raise HFConfigError(f"{where}: llama3 rope needs {missing}")
        return {"rope_theta": theta, "rope_type": "llama3", "rope_factor": float_of(params, "factor", at),
                "rope_low_freq_factor": float_of(params, "low_freq_factor", at),
                "rope_high_freq_factor": float_of(params, "high_freq_factor", at),
                "rope_original_max_len": int_of(params, "original_max_position_embeddings", at, max_len)}
    if kind != "yarn":
        raise HFConfigError(f"{where}: rope type {kind!r} is not supported (supported: 'default', 'linear', "
                            "'yarn', 'llama3')")
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:  # attention_factor, mscale, partial_rotary_factor, ... change the maths
        raise HFConfigError(f"{where}: yarn rope parameter(s) {unknown} are not supported; "
                            f"supported: {sorted(_YARN_KEYS)}")
    if params.get("factor") is None:
        raise HFConfigError(f"{where}: yarn rope needs 'factor'")
    factor = float_of(params, "factor", at)
    return {
        "rope_theta": theta, "rope_type": "yarn", "rope_factor": factor,
        "rope_attention_factor": _yarn_attention_factor(params, factor, at),
        "rope_beta_fast": float_of(params, "beta_fast", at, 32.0),
        "rope_beta_slow": float_of(params, "beta_slow", at, 1.0),
        "rope_original_max_len": int_of(params, "original_max_position_embeddings", at, max_len),
        "rope_truncate": bool_of(params, "truncate", at, True),
    }


def _yarn_attention_factor(params: Mapping[str, Any], factor: float, at: str) -> float | None:
    """YaRN's cos/sin scale as transformers reads it: `attention_factor` when given; else, with
    both `mscale` and `mscale_all_dim` (DeepSeek's), the ratio of their log-factor scales; else
    None (ours then uses 0.1 * ln(factor) + 1, the same default)."""
    if params.get("attention_factor") is not None:
        return float_of(params, "attention_factor", at)
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and all_dim):
        return None
    mscale, all_dim = float_of(params, "mscale", at), float_of(params, "mscale_all_dim", at)

    def scale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return scale(mscale) / scale(all_dim)


def require(hf, key, allowed, where):
    value = hf.get(key, allowed[0])
    if value not in allowed:
        raise HFConfigError(f"{where}: {key}={value!r} is not supported (supported: {list(allowed)})")


def layer_types_of(hf_types, n_layers: int, where: str) -> tuple[str, ...]:
    """HF `layer_types` -> ours ('sliding' / 'full'), one per layer; other kinds are refused."""
    bad = sorted(set(hf_types) - set(HF_LAYER_TYPES))
    if bad:
        raise HFConfigError(f"{where}: layer_types contains {bad}; supported: {sorted(HF_LAYER_TYPES)}")
    if len(hf_types) != n_layers:
        raise HFConfigError(f"{where}: layer_types has {len(hf_types)} entries for {n_layers} layers")
    return tuple(HF_LAYER_TYPES[t] for t in hf_types)


def rope_to_hf(cfg: ModelConfig) -> dict:
    if cfg.rope_type == "default":
        return {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_type == "linear":
        return {"rope_theta": cfg.rope_theta, "rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_type == "longrope":   # ours reads a missing attention factor as 1.0, HF would not
        attention = 1.0 if cfg.rope_attention_factor is None else cfg.rope_attention_factor
        return {"rope_theta": cfg.rope_theta, "rope_type": "longrope", "long_factor": list(cfg.rope_long_factor),
                "short_factor": list(cfg.rope_short_factor), "attention_factor": attention,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    if cfg.rope_type == "llama3":
        return {"rope_theta": cfg.rope_theta, "rope_type": "llama3", "factor": cfg.rope_factor,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    yarn = {"rope_theta": cfg.rope_theta, "rope_type": "yarn", "factor": cfg.rope_factor,
            "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
            "original_max_position_embeddings": cfg.rope_original_max_len, "truncate": cfg.rope_truncate}
    if cfg.rope_attention_factor is not None:
        yarn["attention_factor"] = cfg.rope_attention_factor
    return yarn
