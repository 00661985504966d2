"""`FamilySpec`: what the HF checkpoint code knows of one model family, in one value.

The generic code (`hf_config`: config.json both ways and the export checks; `tensor_map`: the
tensor names; `loader`; `fp8_weights`) asks the family's spec and never names a family. A spec is
data (the HF class name, the kind of attention and MLP, defaults, tensor-name differences, the
default tool-call format) plus three functions: its config.json reader and writer, and the
ModelConfig fields its HF class fixes. The specs live one module per family (or per group that
shares all its code) in `families/`, gathered in one registry, `families.FAMILIES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from sfrrl_jax.config import ModelConfig

__all__ = ["FamilySpec", "TensorNames", "Wrapper"]

#: (config.json, the fields every family reads alike, where) -> the family's ModelConfig
ConfigReader = Callable[[Mapping[str, Any], dict, str], ModelConfig]
#: (cfg, the config.json fields every family writes alike) -> None: edits the dict in place into
#: what the family's HF config class reads
ConfigWriter = Callable[[ModelConfig, dict], None]

_ATTENTION = ("standard", "latent")
_DENSE_LAYERS = ("none", "any", "first_k")
_SHARED_EXPERT = ("none", "gated", "ungated")
_SLIDING = ("any", "none", "all")


@dataclass(frozen=True)
class TensorNames:
    """The HF tensor names and layouts that differ between families (`tensor_map` builds the rest
    alike for all). The defaults are Llama's and Qwen-MoE's.

    Attributes:
      fused_projections: q, k, v are the rows of one `self_attn.qkv_proj` and a dense MLP's gate,
        up those of one `mlp.gate_up_proj` (Phi-3).
      moe_prefix: where a MoE layer's router and experts live under `model.layers.{i}.`
        (Mixtral's and MiniMax-M2's `block_sparse_moe.`).
      expert_projections: each expert's (gate, up, down) linear names (Mixtral's `w1, w3, w2`).
      score_bias: the sigmoid router's selection bias under `moe_prefix` (MiniMax-M2's is beside the
        router's weight, not inside it).
      shared_expert: the shared expert's prefix under `moe_prefix` (Qwen2-MoE's is singular).
      fused_experts: the experts are fused [E, in, out] tensors with gate and up interleaved, with
        biases, optionally MXFP4 (GPT-OSS), instead of one linear per expert.
    """

    fused_projections: bool = False
    moe_prefix: str = "mlp."
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    score_bias: str = "gate.e_score_correction_bias"
    shared_expert: str = "shared_experts."
    fused_experts: bool = False


@dataclass(frozen=True)
class Wrapper:
    """A model_type whose config.json wraps a family's: a multimodal model whose language model is
    that family's (Gemma 3's 'gemma3' around 'gemma3_text'). The loader reads its language model's
    tensors and leaves the rest unread.

    Attributes:
      model_type: the wrapping config's model_type.
      unwrap: (config.json, where) -> the language model's config.json.
      part: what the unwrapped config is called in error messages ('text_config').
    """

    model_type: str
    unwrap: Callable[[Mapping[str, Any], str], dict]
    part: str


@dataclass(frozen=True)
class FamilySpec:
    """One model family: what `config_from_hf`, `config_to_hf`, `check_exportable`, `tensor_map`,
    the loader and the launcher's tool-format default need to know of it.

    Attributes:
      model_type: config.json's `model_type`; also `ModelConfig.family` and the registry's key.
      architecture: the HF class (config.json's `architectures`), e.g. 'LlamaForCausalLM'.
      read_config: (config.json, common, where) -> ModelConfig, where `common` holds the fields every
        family reads alike (`config_from_hf`).
      write_config: (cfg, hf) -> None: edits `hf`, the fields every family writes alike, into the
        family's config.json (`config_to_hf`).
      fixed: cfg -> the ModelConfig fields the HF class fixes beyond the ones every class fixes (its
        value may depend on cfg: an output bias that follows the q/k/v ones). `check_exportable`
        refuses a cfg whose fields differ.
      moe: experts in every layer but `dense_layers` (else a dense MLP in every layer); the dense
        families' `num_experts_per_tok` defaults to 1.
      attention: 'standard' (q/k/v heads) or 'latent' (DeepSeek's multi-head latent attention,
        exported only with `mla_kv_rank` set and a query scale only YaRN's).
      aliases: other model_types read as this family (Kimi K2's 'kimi_k2' as 'deepseek_v3').
      wrapper: a multimodal model_type whose language model is this family, or None.
      free: fields every other class fixes that this class reads from its config.json.
      check_export: the family's own export checks (cfg -> None, raising `HFConfigError`), run
        before the shared ones; None: none.
      dense_layers: which layers of a MoE model may be dense: 'none', 'any' (named per layer), or
        'first_k' (the first k: `first_k_dense_replace`).
      shared_expert: 'none'; 'gated' (in every MoE layer, behind a sigmoid gate: Qwen2-MoE); or
        'ungated' (n_shared_experts x the expert width: DeepSeek's, GLM's).
      sliding: the HF class's sliding window: 'any' (not checked on export), 'none' (it has none),
        or 'all' (one window on every layer: mixed layer kinds are refused).
      nope_layers: the class can leave RoPE out of some layers (SmolLM3).
      default_head_dim: `head_dim` when config.json has none (None: hidden_size / heads).
      default_tie_embeddings: `tie_word_embeddings` when config.json has none.
      default_attention_bias: `attention_bias` when config.json has none.
      mtp_layers: the checkpoint may hold multi-token-prediction layers past `num_hidden_layers`,
        which the loader leaves unread.
      rope_always_interleaved: latent attention's RoPE rows pair adjacent dims whatever
        `rope_interleave` says (DeepSeek-V2: transformers rotates them as complex pairs).
      mxfp4_experts: the checkpoint may carry MXFP4 experts (`quantization_config` 'mxfp4').
      tensor_names: the tensor names and layouts that differ from Llama's (`TensorNames`).
      tool_format: the tool-call format (`agents.formats` name) the launcher falls back on when the
        chat template's markup names none; None: the template decides.
    """

    model_type: str
    architecture: str
    read_config: ConfigReader
    write_config: ConfigWriter
    fixed: Callable[[ModelConfig], dict]
    moe: bool
    attention: Literal["standard", "latent"] = "standard"
    aliases: tuple[str, ...] = ()
    wrapper: Wrapper | None = None
    free: tuple[str, ...] = ()
    check_export: Callable[[ModelConfig], None] | None = None
    dense_layers: Literal["none", "any", "first_k"] = "none"
    shared_expert: Literal["none", "gated", "ungated"] = "none"
    sliding: Literal["any", "none", "all"] = "any"
    nope_layers: bool = False
    default_head_dim: int | None = None
    default_tie_embeddings: bool = False
    default_attention_bias: bool = False
    mtp_layers: bool = False
    rope_always_interleaved: bool = False
    mxfp4_experts: bool = False
    tensor_names: TensorNames = TensorNames()
    tool_format: str | None = None

    def __post_init__(self) -> None:
        # a typo in a spec would otherwise read as the default branch of every check that asks it
        for name, allowed in (("attention", _ATTENTION), ("dense_layers", _DENSE_LAYERS),
                              ("shared_expert", _SHARED_EXPERT), ("sliding", _SLIDING)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"FamilySpec({self.model_type!r}).{name}={getattr(self, name)!r}; "
                                 f"valid: {list(allowed)}")
        if not self.moe and (self.dense_layers != "none" or self.shared_expert != "none"):
            raise ValueError(f"FamilySpec({self.model_type!r}) is dense: dense_layers and shared_expert are a "
                             "MoE model's")
