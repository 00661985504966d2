"""Model configuration: one frozen dataclass and the presets of the families we support.

The presets carry the published shapes of the real checkpoints (their HF `config.json`s), so a
memory plan or a mesh choice made on a preset holds for the real model.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

# (all of them importable from here as before they moved to checks.py; check_seed unused here)
from sfrrl_jax.checks import (check_bool, check_bool_fields, check_int, check_int_fields, check_number,  # noqa: F401
                              check_number_fields, check_seed, check_str)

MODEL_DTYPES = ("float32", "bfloat16", "float16")   # floating types the model computes in
# The model families: the names of the checkpoint code's registry (`checkpoints/hf/families`, a layer
# above this one, so ModelConfig checks the field against this copy; tests/checkpoints/
# test_family_specs.py holds the two equal).
Family = Literal["qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "llama", "mistral", "qwen2", "qwen3", "gemma3_text",
                 "phi3", "granite", "olmo2", "olmo3", "smollm3", "olmoe", "glm4_moe",
                 "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minimax_m2", "seed_oss"]
RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_topk"]
ExpertAct = Literal["swiglu", "gptoss_swiglu"]
MlpAct = Literal["silu", "gelu_tanh"]   # the gate's activation of a dense (GLU) MLP
LayerType = Literal["full", "sliding"]
Dispatch = Literal["padded", "ragged", "llep"]
Remat = Literal["none", "full", "dots", "dots_no_batch", "attention_out", "dots_attention_out"]
RopeType = Literal["default", "yarn", "llama3", "linear", "longrope"]
AttentionImpl = Literal["blockwise", "pallas", "naive"]
# How a paged KV cache's decode attends (`engine.paged.use_paged_kernel`).
PagedAttention = Literal["auto", "gather", "pallas"]
GroupedMatmul = Literal["auto", "ragged_dot", "tiled", "ragged_dot_tiled_wgrad"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and variants of a decoder-only transformer, MoE or dense.

    Every layer is attention + MoE, or attention + a dense SwiGLU MLP of width `d_ff` when
    `n_experts == 0` (the dense families: llama, qwen2, qwen3). A MoE model may name some layers
    dense (`dense_layers`, HF Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`): those get
    the SwiGLU MLP of width `d_ff` instead of the experts; a MoE layer may add a shared expert
    (`d_ff_shared`, Qwen2-MoE). Per-layer attention kind comes from
    `layer_types` ('sliding' layers attend to the last `sliding_window` positions; 'full' to all).
    """

    name: str = "custom"
    family: Family = "qwen3_moe"
    vocab_size: int = 512
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff_expert: int = 64
    n_experts: int = 8                 # 0: a dense MLP of width d_ff in every layer
    d_ff: int = 0                      # the dense MLP's width (n_experts == 0, or dense_layers)
    # Indices of the layers of a MoE model (n_experts > 0) that run a dense MLP of width d_ff
    # instead of the experts; stored sorted. () = every layer MoE (the default, as before).
    dense_layers: tuple[int, ...] = ()
    # A shared expert (Qwen2-MoE): a SwiGLU MLP of width d_ff_shared that every token of a MoE
    # layer runs, added to the routed experts' output; with shared_expert_gate, scaled per token
    # by sigmoid(x @ w) first. 0: none.
    d_ff_shared: int = 0
    shared_expert_gate: bool = False
    top_k: int = 2
    # Routing: 'softmax_topk' = softmax over all experts then top-k (Qwen3-MoE), optionally
    # renormalised; 'topk_softmax' = top-k logits then softmax over those k (Mixtral, GPT-OSS);
    # 'sigmoid_topk' (GLM-4.5, DeepSeek-V3) = sigmoid scores, the top k of scores + a per-expert
    # selection bias (param 'score_bias', HF's e_score_correction_bias: it moves the choice only,
    # so it gets no gradient) among the router_topk_groups best of router_groups expert groups (a
    # group's worth: its two best), weighted by their scores, optionally renormalised.
    # 'softmax_topk' with router_groups > 1 is DeepSeek-V2's 'group_limited_greedy': the top k among
    # the router_topk_groups groups whose best probability is highest.
    router: RouterKind = "softmax_topk"
    norm_topk_prob: bool = True
    # The chosen experts' weights are multiplied by router_scale (DeepSeek's routed_scaling_factor;
    # 'softmax_topk' and 'sigmoid_topk'). router_fp32 stores the router's weight in fp32 whatever
    # param_dtype, as transformers keeps GLM-4.5's and DeepSeek's (`_keep_in_fp32_modules`).
    router_scale: float = 1.0
    router_fp32: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: ExpertAct = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    qk_norm: bool = False
    # qk_norm_over_heads: the q and k norms take their statistic over all heads of the projection
    # at once, with a scale per [heads, head_dim] entry (OLMo 2/3), rather than per head (Qwen3).
    qk_norm_over_heads: bool = False
    attention_bias: bool = False       # q/k/v biases (and the output's, unless attention_out_bias says)
    attention_out_bias: bool | None = None  # None: as attention_bias (GPT-OSS both; Qwen2 q/k/v only)
    attn_sinks: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3, Moonlight, GLM-4.7-Flash; `models.mla`), on when
    # mla_kv_rank > 0: keys and values come from a per-token latent of mla_kv_rank dims (normed)
    # and one RoPE key of mla_rope_dim dims shared by every head; a head's query is mla_nope_dim
    # unrotated and mla_rope_dim rotated dims (through a normed latent of mla_q_rank dims where
    # that is > 0), its value mla_v_dim dims. The KV cache holds the latent and the RoPE key as
    # one KV head, so n_kv_heads must be 1 and head_dim mla_kv_rank + mla_rope_dim.
    mla_kv_rank: int = 0
    mla_q_rank: int = 0
    mla_nope_dim: int = 0
    mla_rope_dim: int = 0
    mla_v_dim: int = 0
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] | None = None  # None: all 'full'
    rope_theta: float = 10000.0
    # Layers that apply no RoPE at all (SmolLM3's NoPE layers, every fourth); () = none. Sorted.
    nope_layers: tuple[int, ...] = ()
    # Rope scaling: 'yarn' (GPT-OSS: factor, beta_fast/slow, original_max_len, truncate) or
    # 'llama3' (Llama 3.1+: factor, low/high_freq_factor, original_max_len); 'default' ignores them.
    rope_type: RopeType = "default"
    rope_factor: float = 1.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_original_max_len: int = 4096
    rope_truncate: bool = True
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    # The share of head_dim that RoPE rotates (Phi-4-mini: 0.75; the rest passes unrotated).
    rope_partial_factor: float = 1.0
    # 'longrope' (Phi-3.5 / Phi-4-mini): frequencies divided per dim by the short factors, or by the
    # long ones where a call holds a position at or past rope_original_max_len (HF's and vLLM's
    # rule), cos/sin scaled by rope_attention_factor; one factor per rotated pair of dims. So a
    # sequence that grows past that length during decoding has cache keys rotated by the short
    # factors and later ones by the long: its train-time logprobs (one call, long factors) are
    # not the rollout's, as in every engine that follows HF.
    rope_long_factor: tuple[float, ...] = ()
    rope_short_factor: tuple[float, ...] = ()
    # The cos/sin scale of 'longrope' and 'yarn'. None: the type's own (longrope 1.0; yarn
    # 0.1 * ln(rope_factor) + 1); a checkpoint may set it (OLMo 3's YaRN).
    rope_attention_factor: float | None = None
    rms_eps: float = 1e-6
    # Gemma's variants of the block (all off for the other families):
    # RMSNorm scales by (norm_offset + weight), in fp32 before the cast (Gemma: 1.0, its weights
    # are offsets from one); sandwich_norms adds a norm on the attention's and the MLP's outputs
    # before each residual add; mlp_act is the dense MLP's gate activation; embed_scale
    # multiplies the embeddings (Gemma: sqrt(d_model), rounded to the param dtype as HF does);
    # query_scale replaces 1/sqrt(head_dim) as the attention's scale (Gemma: query_pre_attn_scalar
    # ** -0.5); rope_local_theta, when set, is the RoPE base of the sliding layers, which
    # rotate without rope_type's scaling (Gemma 3's local layers).
    # pre_norms=False drops the norms on the sublayers' inputs; with sandwich_norms, that leaves
    # OLMo 2/3's post-norm block (x + norm(attn(x)); x + norm(mlp(x))). norm_scale_fp32: every
    # RMSNorm multiplies by its scale in fp32 before the cast back to the input dtype, as HF's
    # OLMo 2/3 and Gemma norms do (Gemma's norm_offset implies it), not after it (Llama's).
    # Granite's multipliers: each sublayer's output is scaled by residual_scale before the
    # residual add, and the logits are divided by logits_divisor (its embedding_multiplier and
    # attention_multiplier are embed_scale and query_scale).
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    pre_norms: bool = True
    norm_scale_fp32: bool = False
    mlp_act: MlpAct = "silu"
    embed_scale: float = 1.0
    query_scale: float | None = None
    rope_local_theta: float | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: Remat = "none"
    moe_dispatch: Dispatch = "padded"
    # 'llep' (models/llep.py) spills tokens of overloaded experts only when the busiest device's
    # native load is >= llep_threshold x the mean (the paper's lambda; its code's default 1.3).
    llep_threshold: float = 1.3
    # Tokens per device the MoE dispatch handles at a time (0: all at once). Dropless dispatch
    # sizes its buffers for the worst case (every assignment on one expert shard: S x the
    # assignments, per device), so at expert=16 and 64k local tokens one exchange buffer is
    # 48 GB; in chunks of c tokens it is S x c x top_k rows, and the backward recomputes each
    # chunk's dispatch instead of keeping it. Same function, more (smaller) exchanges.
    moe_chunk_tokens: int = 0
    router_aux_coef: float = 0.0
    router_z_coef: float = 0.0
    # The experts' grouped matmul (models/grouped_matmul.py): 'ragged_dot' (jax.lax.ragged_dot;
    # XLA expands it to a dense dot over every local expert where it has no grouped GEMM: all of
    # XLA:CPU, GPU weight gradients), 'tiled' (a loop over 128-row tiles of one expert each: memory
    # ~ rows, work ~ the rows present), 'ragged_dot_tiled_wgrad', or 'auto' (ragged_dot while the
    # dense expansion is small, else tiled on CPU, a tiled weight gradient on GPU; the limits and
    # their measurements are in models/grouped_matmul.py).
    grouped_matmul: GroupedMatmul = "auto"
    # Training/prefill attention: 'blockwise' (flash-style online softmax over
    # attention_block_q x attention_block_k tiles, memory linear in seq, models/attention.py),
    # 'pallas' (the same function as Pallas/Triton GPU kernels, models/attention_pallas.py: ~3x
    # blockwise's speed on an H200; interpreted, so slow, on other backends; its tiles are the
    # block sizes rounded down to a power of two in [16, 128]) or 'naive' (the full [seq, seq]
    # score tensor; the reference).
    attention_impl: AttentionImpl = "blockwise"
    attention_block_q: int = 512
    attention_block_k: int = 512
    # The params' layer layout (`models.transformer`), MaxText's name: True stacks every layer's
    # weights on a leading dim and scans them (compile time independent of depth); False keeps one
    # array per layer's weight (each stack a list of per-layer dicts) and runs the layers unrolled,
    # in the engine (whose dense KV cache is then one array per layer too) and the train step:
    # XLA:CPU copies a stacked layer's weights out before each matmul, so on CPU per-layer params
    # decode ~1.35x faster (SmolLM2-135M, issue #44). The same function either way.
    scan_layers: bool = True

    def __post_init__(self):
        check_str("ModelConfig.name", self.name)
        check_int_fields(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                "d_ff_expert", "top_k", "max_seq_len", "rope_original_max_len",
                                "attention_block_q", "attention_block_k"), 1)
        check_int_fields(self, ("n_experts", "d_ff", "moe_chunk_tokens", "d_ff_shared", "mla_kv_rank", "mla_q_rank",
                                "mla_nope_dim", "mla_rope_dim", "mla_v_dim"), 0)
        if self.d_ff_shared and not self.n_experts:
            raise ValueError(f"ModelConfig.d_ff_shared={self.d_ff_shared} needs n_experts > 0 (a shared expert "
                             "sits beside routed ones; a dense model's MLP width is d_ff)")
        if self.shared_expert_gate and not self.d_ff_shared:
            raise ValueError("ModelConfig.shared_expert_gate needs d_ff_shared >= 1 (a shared expert to gate)")
        if self.n_experts == 0 and self.d_ff < 1:
            raise ValueError("ModelConfig.n_experts=0 (a dense MLP) needs d_ff >= 1, the MLP's width")
        self._check_dense_layers()
        self._layer_indices("nope_layers")
        if self.attention_out_bias is not None:
            check_bool("ModelConfig.attention_out_bias", self.attention_out_bias)
        check_int("ModelConfig.sliding_window", self.sliding_window, 0, optional=True)  # 0: no window
        check_bool_fields(self, ("norm_topk_prob", "router_bias", "expert_bias", "qk_norm", "attention_bias",
                                 "attn_sinks", "rope_truncate", "tie_embeddings", "sandwich_norms",
                                 "qk_norm_over_heads", "pre_norms", "norm_scale_fp32", "router_fp32",
                                 "scan_layers"))
        if not (self.pre_norms or self.sandwich_norms):
            raise ValueError("ModelConfig.pre_norms=False needs sandwich_norms=True (a block with no norm at all)")
        if self.qk_norm_over_heads and not self.qk_norm:
            raise ValueError("ModelConfig.qk_norm_over_heads=True needs qk_norm=True (the norms it places)")
        check_number_fields(self, ("norm_offset",), 0)
        check_number_fields(self, ("embed_scale", "residual_scale", "logits_divisor"), 0, lo_open=True)
        check_number_fields(self, ("query_scale", "rope_local_theta"), 0, lo_open=True, optional=True)
        self._check_latent_attention()
        self._check_rope_dims()
        check_number_fields(self, ("rope_theta", "rope_factor", "rms_eps", "swiglu_limit", "swiglu_alpha",
                                   "rope_low_freq_factor", "rope_high_freq_factor"), 0, lo_open=True)
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"ModelConfig.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                             f"rope_low_freq_factor={self.rope_low_freq_factor} (llama3 rope scaling)")
        check_number_fields(self, ("rope_beta_fast", "rope_beta_slow", "init_std", "router_aux_coef",
                                   "router_z_coef"), 0)
        check_number("ModelConfig.llep_threshold", self.llep_threshold, 1)  # a max/mean ratio is >= 1
        for k in ("param_dtype", "compute_dtype"):
            check_str(f"ModelConfig.{k}", getattr(self, k))
            if getattr(self, k) not in MODEL_DTYPES:
                raise ValueError(f"ModelConfig.{k}={getattr(self, k)!r} must be one of {MODEL_DTYPES}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"ModelConfig.top_k={self.top_k} > n_experts={self.n_experts}")
        self._check_router_groups()
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"ModelConfig.layer_types has {len(self.layer_types)} entries, n_layers={self.n_layers}"
                )
            bad = set(self.layer_types) - {"full", "sliding"}
            if bad:
                raise ValueError(f"ModelConfig.layer_types: unknown kinds {sorted(bad)}; use 'full'/'sliding'")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise ValueError("ModelConfig.layer_types has 'sliding' layers but sliding_window is unset")
        for k, allowed in (("router", RouterKind), ("expert_act", ExpertAct), ("mlp_act", MlpAct),
                           ("moe_dispatch", Dispatch),
                           ("remat", Remat), ("family", Family), ("rope_type", RopeType),
                           ("grouped_matmul", GroupedMatmul),
                           ("attention_impl", AttentionImpl)):
            if getattr(self, k) not in allowed.__args__:
                raise ValueError(f"ModelConfig.{k}={getattr(self, k)!r}; valid: {list(allowed.__args__)}")

    def _check_rope_dims(self) -> None:
        check_number("ModelConfig.rope_partial_factor", self.rope_partial_factor, 0, 1, lo_open=True)
        check_number("ModelConfig.rope_attention_factor", self.rope_attention_factor, 0, lo_open=True,
                     optional=True)
        rotated = self.rotary_dim
        if self.mla_kv_rank and (rotated < 2 or rotated % 2):
            raise ValueError(f"ModelConfig.mla_rope_dim={rotated}: RoPE rotates an even number >= 2 of dims")
        if rotated < 2 or rotated % 2:
            raise ValueError(f"ModelConfig.rope_partial_factor={self.rope_partial_factor} rotates {rotated} of "
                             f"head_dim={self.head_dim} dims; RoPE rotates an even number >= 2")
        for k in ("rope_long_factor", "rope_short_factor"):
            value = getattr(self, k)
            if not isinstance(value, (tuple, list)):
                raise ValueError(f"ModelConfig.{k} must be a list of numbers, got {value!r}")
            for i, f in enumerate(value):
                check_number(f"ModelConfig.{k}[{i}]", f, 0, lo_open=True)
            object.__setattr__(self, k, tuple(float(f) for f in value))   # gin and JSON hand over lists
            if self.rope_type == "longrope" and len(value) != rotated // 2:
                raise ValueError(f"ModelConfig.{k} has {len(value)} factors; longrope needs one per rotated pair "
                                 f"of dims: {rotated // 2} (head_dim={self.head_dim} x rope_partial_factor="
                                 f"{self.rope_partial_factor} / 2)")

    def _check_latent_attention(self) -> None:
        mla = ("mla_q_rank", "mla_nope_dim", "mla_rope_dim", "mla_v_dim")
        if not self.mla_kv_rank:
            set_ = {k: getattr(self, k) for k in mla if getattr(self, k)}
            if set_:
                raise ValueError(f"ModelConfig{set_} are latent attention's: they need mla_kv_rank >= 1")
            return
        need = ("mla_nope_dim", "mla_rope_dim", "mla_v_dim")
        for k in need:
            if getattr(self, k) < 1:
                raise ValueError(f"ModelConfig.{k}={getattr(self, k)}: latent attention (mla_kv_rank="
                                 f"{self.mla_kv_rank}) needs {list(need)} >= 1")
        cache_dim = self.mla_kv_rank + self.mla_rope_dim
        if self.n_kv_heads != 1 or self.head_dim != cache_dim:
            raise ValueError(f"ModelConfig: latent attention caches one KV head of mla_kv_rank + mla_rope_dim = "
                             f"{cache_dim} dims; set n_kv_heads=1 (got {self.n_kv_heads}) and head_dim={cache_dim} "
                             f"(got {self.head_dim})")
        unsupported = {k: getattr(self, k) for k in ("qk_norm", "attention_bias", "attn_sinks")
                       if getattr(self, k)}
        if self.rope_partial_factor != 1.0:
            unsupported["rope_partial_factor"] = self.rope_partial_factor
        if self.rope_type == "longrope":
            unsupported["rope_type"] = self.rope_type
        if unsupported:
            raise ValueError(f"ModelConfig{unsupported}: not supported with latent attention (mla_kv_rank="
                             f"{self.mla_kv_rank}): its RoPE dims are mla_rope_dim, it has no q/k norms, "
                             "biases or sinks")

    def _layer_indices(self, field: str) -> tuple[int, ...]:
        """The field's layer indices, checked (in range, distinct) and sorted as plain ints (gin and
        JSON hand over lists, so equal configs compare equal); stored back."""
        where, value = f"ModelConfig.{field}", getattr(self, field)
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{where} must be a tuple of layer indices, got {value!r}")
        layers = tuple(value)
        for k, i in enumerate(layers):
            check_int(f"{where}[{k}]", i, 0, self.n_layers - 1)
        if len(set(layers)) != len(layers):
            raise ValueError(f"{where}={layers} repeats a layer index")
        object.__setattr__(self, field, tuple(sorted(int(i) for i in layers)))
        return layers

    def _check_dense_layers(self) -> None:
        where = "ModelConfig.dense_layers"
        layers = self._layer_indices("dense_layers")
        if layers and not self.n_experts:
            raise ValueError(f"{where}={layers} needs n_experts > 0 (a dense model's layers are all dense)")
        if layers and self.d_ff < 1:
            raise ValueError(f"{where}={layers} needs d_ff >= 1, the dense layers' MLP width")
        if len(layers) == self.n_layers:
            # Every layer dense: that is the dense model (n_experts=0), whose params have no
            # empty MoE stack; say so rather than build one.
            raise ValueError(f"{where}={layers} names every layer; a model without MoE layers is "
                             "n_experts=0 with d_ff")

    def _check_router_groups(self) -> None:
        check_number("ModelConfig.router_scale", self.router_scale, 0, lo_open=True)
        check_int_fields(self, ("router_groups", "router_topk_groups"), 1)
        if self.router_topk_groups > self.router_groups:
            raise ValueError(f"ModelConfig.router_topk_groups={self.router_topk_groups} > router_groups="
                             f"{self.router_groups}")
        if self.router_groups > 1 and self.router == "topk_softmax":
            raise ValueError("ModelConfig.router_groups is softmax_topk's and sigmoid_topk's (router='topk_softmax')")
        if self.router_scale != 1.0 and self.router == "topk_softmax":
            raise ValueError("ModelConfig.router_scale is softmax_topk's and sigmoid_topk's (router='topk_softmax')")
        if self.n_experts and self.router_groups > 1:
            if self.n_experts % self.router_groups:
                raise ValueError(f"ModelConfig.router_groups={self.router_groups} must divide n_experts="
                                 f"{self.n_experts}")
            per_group = self.n_experts // self.router_groups
            least = 2 if self.router == "sigmoid_topk" else 1   # sigmoid_topk's group's worth is its two best
            if per_group < least or self.top_k > self.router_topk_groups * per_group:
                raise ValueError(f"ModelConfig: top_k={self.top_k} experts from router_topk_groups="
                                 f"{self.router_topk_groups} groups of {per_group} (a sigmoid_topk group needs >= 2: "
                                 "its worth is its two best)")

    # -- derived -----------------------------------------------------------------------------
    @property
    def layer_ropes(self) -> tuple[bool, ...]:
        """Per-layer: whether the layer applies RoPE (False for `nope_layers`)."""
        return tuple(i not in self.nope_layers for i in range(self.n_layers))

    @property
    def rotary_dim(self) -> int:
        """The dims of a head RoPE rotates: mla_rope_dim with latent attention, else the leading
        head_dim x rope_partial_factor."""
        return self.mla_rope_dim if self.mla_kv_rank else int(self.head_dim * self.rope_partial_factor)

    @property
    def value_cache_dim(self) -> int:
        """The width of the engine's value cache: head_dim, or 0 with latent attention, whose
        values are its cached keys ([latent, RoPE key]: one array holds both)."""
        return 0 if self.mla_kv_rank else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def layer_is_dense(self, layer: int) -> bool:
        """Whether layer `layer` runs the dense MLP (every layer of a dense model; the
        `dense_layers` of a MoE one)."""
        return not self.is_moe or layer in self.dense_layers

    @property
    def out_bias(self) -> bool:
        """Whether the attention output projection has a bias."""
        return self.attention_bias if self.attention_out_bias is None else self.attention_out_bias

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per-layer attention window (0 = unlimited)."""
        types = self.layer_types or ("full",) * self.n_layers
        return tuple(self.sliding_window if t == "sliding" else 0 for t in types)

    def replace(self, **overrides) -> "ModelConfig":
        return _replace_checked(self, overrides)

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset, optionally with fields overridden (unknown names list the valid ones)."""
        if name not in PRESETS:
            raise KeyError(f"unknown ModelConfig preset {name!r}; valid presets: {sorted(PRESETS)}")
        return _replace_checked(PRESETS[name], overrides)

    def param_count(self) -> int:
        """Total parameters (all experts), for sizing."""
        d, h, k, hd, e, f = (self.d_model, self.n_heads, self.n_kv_heads, self.head_dim,
                             self.n_experts, self.d_ff_expert)
        attn = d * hd * (h + 2 * k) + h * hd * d
        if self.mla_kv_rank:   # the latents' projections and norms, per-head up-projections, output
            r, qk = self.mla_kv_rank, self.mla_nope_dim + self.mla_rope_dim
            q = self.mla_q_rank * (d + 1 + h * qk) if self.mla_q_rank else d * h * qk
            attn = q + d * (r + self.mla_rope_dim) + r + r * h * (self.mla_nope_dim + self.mla_v_dim) + \
                h * self.mla_v_dim * d
        if self.attention_bias:
            attn += hd * (h + 2 * k)
        attn += d * self.out_bias + h * self.attn_sinks
        if self.qk_norm:
            attn += (h + k) * hd if self.qk_norm_over_heads else 2 * hd
        moe = d * e + e * 3 * d * f + (e if self.router_bias else 0) + (e if self.router == "sigmoid_topk" else 0)
        if self.expert_bias:
            moe += e * (2 * f + d)
        moe += 3 * d * self.d_ff_shared + d * self.shared_expert_gate
        mlp = 3 * d * self.d_ff
        n_dense = sum(self.layer_is_dense(i) for i in range(self.n_layers))
        norms = (2 * self.pre_norms + 2 * self.sandwich_norms) * d
        layers = self.n_layers * (attn + norms) + n_dense * mlp + (self.n_layers - n_dense) * moe
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + layers + d + head


def _replace_checked(cfg: ModelConfig, overrides: dict) -> ModelConfig:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown ModelConfig field(s) {unknown}; valid fields: {sorted(fields)}")
    return dataclasses.replace(cfg, **overrides)


def _alternating(n: int, first: LayerType = "sliding") -> Sequence[LayerType]:
    other = "full" if first == "sliding" else "sliding"
    return tuple(first if i % 2 == 0 else other for i in range(n))


_GPT_OSS_COMMON = dict(
    family="gpt_oss", vocab_size=201088, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64,
    d_ff_expert=2880, top_k=4, router="topk_softmax", norm_topk_prob=True, router_bias=True,
    expert_bias=True, expert_act="gptoss_swiglu", swiglu_limit=7.0, attention_bias=True,
    attn_sinks=True, sliding_window=128, rope_theta=150000.0, rope_type="yarn", rope_factor=32.0,
    rope_beta_fast=32.0, rope_beta_slow=1.0, rope_original_max_len=4096, rope_truncate=False,
    rms_eps=1e-5, max_seq_len=131072, tie_embeddings=False, param_dtype="bfloat16",
    compute_dtype="bfloat16", router_aux_coef=0.9,
)

PRESETS: dict[str, ModelConfig] = {
    # Small enough for CPU tests and the quickstart; exercises GQA, qk-norm and 8 experts.
    "tiny-moe": ModelConfig(
        name="tiny-moe", family="qwen3_moe", vocab_size=512, d_model=64, n_layers=2, n_heads=4,
        n_kv_heads=2, head_dim=16, d_ff_expert=64, n_experts=8, top_k=2, qk_norm=True,
        rope_theta=10000.0, max_seq_len=1024,
    ),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-moe-30b-a3b": ModelConfig(
        name="qwen3-moe-30b-a3b", family="qwen3_moe", vocab_size=151936, d_model=2048,
        n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, d_ff_expert=768, n_experts=128,
        top_k=8, router="softmax_topk", norm_topk_prob=True, qk_norm=True, rope_theta=1e6,
        rms_eps=1e-6, max_seq_len=40960, tie_embeddings=False, param_dtype="bfloat16",
        compute_dtype="bfloat16", router_aux_coef=0.001,
    ),
    # openai/gpt-oss-20b config.json
    "gpt-oss-20b": ModelConfig(
        name="gpt-oss-20b", n_layers=24, n_experts=32, layer_types=_alternating(24), **_GPT_OSS_COMMON
    ),
    # openai/gpt-oss-120b config.json
    "gpt-oss-120b": ModelConfig(
        name="gpt-oss-120b", n_layers=36, n_experts=128, layer_types=_alternating(36), **_GPT_OSS_COMMON
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", family="mixtral", vocab_size=32000, d_model=4096, n_layers=32,
        n_heads=32, n_kv_heads=8, head_dim=128, d_ff_expert=14336, n_experts=8, top_k=2,
        router="topk_softmax", rope_theta=1e6, rms_eps=1e-5, max_seq_len=32768,
        tie_embeddings=False, param_dtype="bfloat16", compute_dtype="bfloat16",
        router_aux_coef=0.02,
    ),
}
