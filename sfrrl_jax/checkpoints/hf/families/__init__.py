"""The registry of model families: one `FamilySpec` per family, each defined in a module of this
package (one per family, or per group that shares all its code).

Adding a family is one module here (its config.json reader and writer, the fields its HF class
fixes, its tensor-name differences: `family_spec.FamilySpec`) and one line in `FAMILIES` below;
plus its name in `sfrrl_jax.config.Family` (the ModelConfig check, a layer below this one; a test
holds the two equal). The lists other code reads (`hf_config.SUPPORTED_FAMILIES`,
`DENSE_FAMILIES`, ...) are derived from `FAMILIES`.

No `__all__`: the registry is the checkpoint code's, not part of the API reference.
"""
from __future__ import annotations

from sfrrl_jax.checkpoints.hf.families import (deepseek, gemma3, glm4, gpt_oss, granite, llama, minimax_m2, mixtral,
                                               olmo, olmoe, phi3, qwen, seed_oss, smollm3)
from sfrrl_jax.checkpoints.hf.family_spec import FamilySpec

#: model_type -> its spec, one line per family; the order is the one error messages list them in
FAMILIES: dict[str, FamilySpec] = {spec.model_type: spec for spec in (
    qwen.QWEN3_MOE,
    qwen.QWEN2_MOE,
    gpt_oss.GPT_OSS,
    mixtral.MIXTRAL,
    llama.LLAMA,
    llama.MISTRAL,
    qwen.QWEN2,
    qwen.QWEN3,
    gemma3.GEMMA3_TEXT,
    phi3.PHI3,
    granite.GRANITE,
    olmo.OLMO2,
    olmo.OLMO3,
    smollm3.SMOLLM3,
    olmoe.OLMOE,
    glm4.GLM4_MOE,
    deepseek.DEEPSEEK_V2,
    deepseek.DEEPSEEK_V3,
    glm4.GLM4_MOE_LITE,
    minimax_m2.MINIMAX_M2,
    seed_oss.SEED_OSS,
)}


def spec_of(family: str) -> FamilySpec:
    """The spec of a `ModelConfig.family`.

    Args:
      family: the family's name (its config.json model_type).
    Returns:
      Its `FamilySpec`.
    Raises:
      KeyError: when no spec is registered under that name.
    """
    try:
        return FAMILIES[family]
    except KeyError:
        raise KeyError(f"no FamilySpec registered for family {family!r} (registered: {list(FAMILIES)})") from None


def spec_for_model_type(model_type: object) -> FamilySpec | None:
    """The family a config.json's model_type is read as: its own, or the one it is an alias of.

    Args:
      model_type: config.json's `model_type` (any JSON value).
    Returns:
      The `FamilySpec`, or None when no family reads that model_type (a wrapper's included: see
      `wrapped_by`).
    """
    if not isinstance(model_type, str):
        return None
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    return next((s for s in FAMILIES.values() if model_type in s.aliases), None)


def wrapped_by(model_type: object) -> FamilySpec | None:
    """The family whose config a model_type wraps (a multimodal model's language model).

    Args:
      model_type: config.json's `model_type` (any JSON value).
    Returns:
      The wrapped family's `FamilySpec` (its `wrapper` names the model_type), or None.
    """
    if not isinstance(model_type, str):
        return None
    return next((s for s in FAMILIES.values() if s.wrapper is not None and s.wrapper.model_type == model_type), None)


def supported_model_types() -> list[str]:
    """The model_types `config_from_hf` reads, as its error message lists them.

    Returns:
      Every family's model_type, in registry order, then their aliases (wrappers not listed).
    """
    return list(FAMILIES) + [alias for spec in FAMILIES.values() for alias in spec.aliases]


def default_tool_format(family: str) -> str | None:
    """The tool-call format a family's checkpoints write when their chat template's markup says none.

    Args:
      family: a `ModelConfig.family`.
    Returns:
      The format's name (`agents.formats`), or None when the family has none (or is not registered).
    """
    spec = FAMILIES.get(family)
    return None if spec is None else spec.tool_format
