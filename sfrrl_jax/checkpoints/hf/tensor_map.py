"""Which HF tensors make up which of our params, per family, and the layout changes between them.

Our params (see `sfrrl_jax.models.transformer.param_shapes`) stack layers on a leading dim and
keep heads and experts as their own dims: q_proj [D, H, hd], o_proj [H, hd, D], w_gate/w_up
[E, D, F], w_down [E, F, D], router [D, E]. HF stores `nn.Linear` weights as [out, in] with
heads flattened, and experts either one tensor per expert (Qwen3-MoE, Mixtral, as
`save_pretrained` writes them) or fused [E, in, out] with gate and up interleaved on the last dim
(GPT-OSS: gate = [..., ::2], up = [..., 1::2]), optionally MXFP4-quantised. Phi-3 fuses q, k, v
into one `qkv_proj` and gate, up into one `gate_up_proj` (their rows in turn). Which names and
layouts a family uses is its spec's (`FamilySpec.tensor_names`); this module builds them.

A `TensorGroup` is the unit of conversion: a few HF tensors <-> one or more of our per-layer
leaves. Its `load` reads only the experts it is asked for (the rows of an expert-sharded shard);
its `dump` is the exact inverse of the dense `load`, so import -> export -> import is
bit-identical.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from sfrrl_jax.checkpoints.hf.families import spec_of
from sfrrl_jax.checkpoints.hf.mxfp4 import dequantize_mxfp4, mxfp4_shapes
from sfrrl_jax.config import ModelConfig

Leaf = tuple[str, ...]           # path inside params (layer leaves without the stack key)
Reader = Callable[[str, "slice | None"], np.ndarray]  # (hf name, dim-0 rows) -> array


@dataclass(frozen=True)
class TensorGroup:
    """HF tensors `hf` (name -> HF shape) <-> our leaves `leaves` (per layer, or global)."""

    leaves: tuple[Leaf, ...]
    hf: Mapping[str, tuple[int, ...]]
    load: Callable[[Reader, slice], dict]          # (reader, expert rows) -> {leaf: array}
    dump: Callable[[Mapping[Leaf, np.ndarray]], dict] | None  # {leaf: array} -> {name: array}
    expert_rows: bool = False  # the leaves' dim 0 is experts; `load` honours the rows slice
    hf_dtypes: Mapping[str, str] = field(default_factory=dict)  # required file dtypes (MXFP4: U8)


def _single(name, leaf, hf_shape, to_ours=lambda a: a, to_hf=lambda a: a, expert_rows=False):
    return TensorGroup(
        (leaf,), {name: tuple(hf_shape)},
        load=lambda read, rows: {leaf: to_ours(read(name, rows if expert_rows else None))},
        dump=lambda v: {name: to_hf(v[leaf])}, expert_rows=expert_rows)


def _per_expert(fmt, leaf, n_experts, hf_shape):
    """Experts saved one by one as [out, in] linears; our leaf is [E, in, out]."""
    names = [fmt.format(e=e) for e in range(n_experts)]

    def load(read, rows):
        return {leaf: np.stack([read(names[e], None).T for e in range(n_experts)[rows]])}

    return TensorGroup((leaf,), {n: tuple(hf_shape) for n in names}, load,
                       dump=lambda v: {n: np.ascontiguousarray(v[leaf][e].T) for e, n in enumerate(names)},
                       expert_rows=True)


def _interleaved(name, gate_leaf, up_leaf, hf_shape, dense: Callable | None = None, hf_extra=None,
                 hf_dtypes=None):
    """One HF tensor [..., 2F] holding gate (even) and up (odd) columns."""
    dense = dense or (lambda read, rows: read(name, rows))

    def load(read, rows):
        both = dense(read, rows)
        return {gate_leaf: np.ascontiguousarray(both[..., 0::2]),
                up_leaf: np.ascontiguousarray(both[..., 1::2])}

    def dump(v):
        gate, up = v[gate_leaf], v[up_leaf]
        both = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],), gate.dtype)
        both[..., 0::2], both[..., 1::2] = gate, up
        return {name: both}

    hf = hf_extra if hf_extra is not None else {name: tuple(hf_shape)}
    return TensorGroup((gate_leaf, up_leaf), hf, load, None if hf_extra else dump, True, hf_dtypes or {})


def _mxfp4_dense(proj, shape_out, in_dim):
    """Reader of an MXFP4 pair as the dense [E, in, out] tensor; also its HF names and shapes."""
    blocks, scales = f"{proj}_blocks", f"{proj}_scales"
    b_shape, s_shape = mxfp4_shapes(shape_out, in_dim, proj)

    def dense(read, rows):
        w = dequantize_mxfp4(read(blocks, rows), read(scales, rows))  # [E, out, in]
        return np.ascontiguousarray(np.swapaxes(w, -1, -2))

    return dense, {blocks: b_shape, scales: s_shape}, {blocks: "U8", scales: "U8"}


def _latent_attention(cfg: ModelConfig, p: str, rope_interleaved: bool) -> list[TensorGroup]:
    """DeepSeek-V3's MLA (`models.mla`). Each head's query rows are [nope, rope], kv_a_proj's
    [kv_rank latent, rope], kv_b_proj's per head [nope key, value]. With `rope_interleaved` (the
    checkpoint's `rope_interleave`, DeepSeek's default) RoPE pairs adjacent dims; ours rotates
    halves, so the rope rows are taken evens first, then odds: the rotation of the permuted rows
    is the permuted rotation, and q and k permuted alike give the same scores. Export writes
    the interleaved layout (what DeepSeek's checkpoints and other engines use)."""
    d, h, r, q_rank = cfg.d_model, cfg.n_heads, cfg.mla_kv_rank, cfg.mla_q_rank
    nope, rope, v = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
    a = p + "self_attn."
    order = np.r_[0:rope:2, 1:rope:2] if rope_interleaved else np.arange(rope)   # ours[j] = HF[order[j]]
    back = np.argsort(order)

    def rope_rows(w, idx):   # w [..., rows, in] whose last `rope` rows are RoPE's
        return np.concatenate([w[..., :-rope, :], w[..., -rope:, :][..., idx, :]], axis=-2)

    def query(in_dim):   # HF [h * (nope + rope), in] <-> ours [in, h, nope + rope]
        return (lambda w: np.ascontiguousarray(rope_rows(w.reshape(h, nope + rope, in_dim), order).transpose(2, 0, 1)),
                lambda w: np.ascontiguousarray(rope_rows(w.transpose(1, 2, 0), back).reshape(-1, in_dim)))

    kv_b, k_leaf, v_leaf = a + "kv_b_proj.weight", ("attn", "k_b_proj"), ("attn", "v_b_proj")

    def kv_b_load(read, rows):   # HF [h * (nope + v), r]: per head its key rows, then its value rows
        w = read(kv_b, None).reshape(h, nope + v, r)
        return {k_leaf: np.ascontiguousarray(w[:, :nope].transpose(2, 0, 1)),
                v_leaf: np.ascontiguousarray(w[:, nope:].transpose(2, 0, 1))}

    def kv_b_dump(leaves):
        both = np.concatenate([leaves[k_leaf].transpose(1, 2, 0), leaves[v_leaf].transpose(1, 2, 0)], axis=1)
        return {kv_b: np.ascontiguousarray(both.reshape(h * (nope + v), r))}

    if q_rank:
        groups = [_single(a + "q_a_proj.weight", ("attn", "q_a_proj"), (q_rank, d), _transpose, _transpose),
                  _single(a + "q_a_layernorm.weight", ("attn", "q_a_norm", "scale"), (q_rank,)),
                  _single(a + "q_b_proj.weight", ("attn", "q_b_proj"), (h * (nope + rope), q_rank), *query(q_rank))]
    else:
        groups = [_single(a + "q_proj.weight", ("attn", "q_proj"), (h * (nope + rope), d), *query(d))]
    return groups + [
        _single(a + "kv_a_proj_with_mqa.weight", ("attn", "kv_a_proj"), (r + rope, d),
                lambda w: np.ascontiguousarray(rope_rows(w, order).T),
                lambda w: np.ascontiguousarray(rope_rows(w.T, back))),
        _single(a + "kv_a_layernorm.weight", ("attn", "kv_a_norm", "scale"), (r,)),
        TensorGroup((k_leaf, v_leaf), {kv_b: (h * (nope + v), r)}, kv_b_load, kv_b_dump),
        _single(a + "o_proj.weight", ("attn", "o_proj"), (d, h * v),
                lambda w: np.ascontiguousarray(w.reshape(d, h, v).transpose(1, 2, 0)),
                lambda w: np.ascontiguousarray(w.transpose(2, 0, 1).reshape(d, h * v))),
    ]


def _attention(cfg: ModelConfig, p: str, rope_interleaved: bool = True) -> list[TensorGroup]:
    if cfg.mla_kv_rank:
        return _latent_attention(cfg, p, rope_interleaved)
    d, h, k, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    a = p + "self_attn."

    def proj_in(n):  # HF [n*hd, D] <-> ours [D, n, hd]
        return (lambda w: np.ascontiguousarray(w.reshape(n, hd, d).transpose(2, 0, 1)),
                lambda w: np.ascontiguousarray(w.transpose(1, 2, 0).reshape(n * hd, d)))

    if spec_of(cfg.family).tensor_names.fused_projections:   # q, k and v rows of one [(h + 2k) * hd, D] linear
        groups = [_stacked_rows(a + "qkv_proj.weight", [(("attn", "q_proj"), h * hd, proj_in(h)),
                                                        (("attn", "k_proj"), k * hd, proj_in(k)),
                                                        (("attn", "v_proj"), k * hd, proj_in(k))], d)]
    else:
        groups = [_single(a + "q_proj.weight", ("attn", "q_proj"), (h * hd, d), *proj_in(h)),
                  _single(a + "k_proj.weight", ("attn", "k_proj"), (k * hd, d), *proj_in(k)),
                  _single(a + "v_proj.weight", ("attn", "v_proj"), (k * hd, d), *proj_in(k))]
    groups += [
        _single(a + "o_proj.weight", ("attn", "o_proj"), (d, h * hd),
                lambda w: np.ascontiguousarray(w.reshape(d, h, hd).transpose(1, 2, 0)),
                lambda w: np.ascontiguousarray(w.transpose(2, 0, 1).reshape(d, h * hd))),
    ]
    if cfg.attention_bias:
        for proj, n in (("q", h), ("k", k), ("v", k)):
            groups.append(_single(a + f"{proj}_proj.bias", ("attn", f"{proj}_bias"), (n * hd,),
                                  lambda b, n=n: b.reshape(n, hd), lambda b: b.reshape(-1)))
    if cfg.out_bias:
        groups.append(_single(a + "o_proj.bias", ("attn", "o_bias"), (d,)))
    if cfg.qk_norm and cfg.qk_norm_over_heads:   # OLMo: HF [n * hd] <-> ours [n, hd]
        groups += [_single(a + f"{proj}_norm.weight", ("attn", f"{proj}_norm", "scale"), (n * hd,),
                           lambda w, n=n: w.reshape(n, hd), lambda w: w.reshape(-1))
                   for proj, n in (("q", h), ("k", k))]
    elif cfg.qk_norm:
        groups += [_single(a + "q_norm.weight", ("attn", "q_norm", "scale"), (hd,)),
                   _single(a + "k_norm.weight", ("attn", "k_norm", "scale"), (hd,))]
    if cfg.attn_sinks:
        groups.append(_single(a + "sinks", ("attn", "sinks"), (h,)))
    return groups


def _transpose(w):
    return np.ascontiguousarray(w.T)


def _stacked_rows(name: str, parts, in_dim: int) -> TensorGroup:
    """One HF [out, in] linear whose output rows are several of our leaves in turn (Phi-3's
    qkv_proj, gate_up_proj): parts = [(leaf, rows, (to_ours, to_hf))]."""
    cuts = np.cumsum([rows for _, rows, _ in parts])[:-1]

    def load(read, rows):
        pieces = np.split(read(name, None), cuts)
        return {leaf: to_ours(piece) for (leaf, _, (to_ours, _)), piece in zip(parts, pieces)}

    def dump(v):
        return {name: np.concatenate([to_hf(v[leaf]) for leaf, _, (_, to_hf) in parts])}

    return TensorGroup(tuple(leaf for leaf, _, _ in parts), {name: (sum(r for _, r, _ in parts), in_dim)}, load, dump)


def _dense_mlp(cfg: ModelConfig, p: str) -> list[TensorGroup]:
    """Llama/Mistral/Qwen2/Qwen3/Gemma 3 `mlp.{gate,up,down}_proj` ([out, in] linears) <-> ours
    [in, out]; Phi-3's gate and up are the two halves of one `mlp.gate_up_proj`."""
    d, f, m = cfg.d_model, cfg.d_ff, p + "mlp."
    if spec_of(cfg.family).tensor_names.fused_projections:
        return [_stacked_rows(m + "gate_up_proj.weight", [(("mlp", "w_gate"), f, (_transpose, _transpose)),
                                                           (("mlp", "w_up"), f, (_transpose, _transpose))], d),
                _single(m + "down_proj.weight", ("mlp", "w_down"), (d, f), _transpose, _transpose)]
    return [_single(m + "gate_proj.weight", ("mlp", "w_gate"), (f, d), _transpose, _transpose),
            _single(m + "up_proj.weight", ("mlp", "w_up"), (f, d), _transpose, _transpose),
            _single(m + "down_proj.weight", ("mlp", "w_down"), (d, f), _transpose, _transpose)]


def _experts(cfg: ModelConfig, p: str, quantized: bool, dense: bool) -> list[TensorGroup]:
    d, e, f = cfg.d_model, cfg.n_experts, cfg.d_ff_expert
    if dense:  # a dense family's layer, or a Qwen3-MoE `mlp_only_layers` one (same HF names)
        if quantized:
            raise ValueError(f"MXFP4 weights are only defined for gpt_oss's experts, not a dense {cfg.family} MLP")
        return _dense_mlp(cfg, p)
    tensor_names = spec_of(cfg.family).tensor_names
    if not tensor_names.fused_experts:   # one [out, in] linear per expert
        if quantized:
            raise ValueError(f"MXFP4 expert weights are only defined for gpt_oss, not {cfg.family}")
        base, names = p + tensor_names.moe_prefix, tensor_names.expert_projections
        fmt = base + "experts.{e}.%s.weight"
        groups = [
            _single(base + "gate.weight", ("moe", "router"), (e, d), _transpose, _transpose),
            _per_expert(fmt % names[0], ("moe", "w_gate"), e, (f, d)),
            _per_expert(fmt % names[1], ("moe", "w_up"), e, (f, d)),
            _per_expert(fmt % names[2], ("moe", "w_down"), e, (d, f)),
        ]
        if cfg.router == "sigmoid_topk":   # the selection bias: GLM's and DeepSeek's beside the router's weight
            groups.append(_single(base + tensor_names.score_bias, ("moe", "score_bias"), (e,)))
        if cfg.d_ff_shared:   # the shared expert ([out, in] linears): Qwen2-MoE's; GLM's, DeepSeek's `shared_experts`
            s = cfg.d_ff_shared
            m = base + tensor_names.shared_expert
            groups += [_single(m + "gate_proj.weight", ("shared_expert", "w_gate"), (s, d), _transpose, _transpose),
                       _single(m + "up_proj.weight", ("shared_expert", "w_up"), (s, d), _transpose, _transpose),
                       _single(m + "down_proj.weight", ("shared_expert", "w_down"), (d, s), _transpose, _transpose)]
        if cfg.shared_expert_gate:   # Qwen2-MoE's gate [1, embed] on it
            groups.append(_single(base + "shared_expert_gate.weight", ("shared_gate",), (1, d), _transpose,
                                  _transpose))
        return groups
    # GPT-OSS's fused experts
    m = p + tensor_names.moe_prefix
    x = m + "experts."
    groups = [
        _single(m + "router.weight", ("moe", "router"), (e, d), _transpose, _transpose),
        _single(m + "router.bias", ("moe", "router_bias"), (e,)),
        _interleaved(x + "gate_up_proj_bias", ("moe", "b_gate"), ("moe", "b_up"), (e, 2 * f)),
        _single(x + "down_proj_bias", ("moe", "b_down"), (e, d), expert_rows=True),
    ]
    if not quantized:
        groups += [_interleaved(x + "gate_up_proj", ("moe", "w_gate"), ("moe", "w_up"), (e, d, 2 * f)),
                   _single(x + "down_proj", ("moe", "w_down"), (e, f, d), expert_rows=True)]
        return groups
    dense, hf, dtypes = _mxfp4_dense(x + "gate_up_proj", (e, 2 * f), d)
    groups.append(_interleaved(x + "gate_up_proj", ("moe", "w_gate"), ("moe", "w_up"), None, dense, hf, dtypes))
    dense_down, hf_down, dtypes_down = _mxfp4_dense(x + "down_proj", (e, d), f)
    groups.append(TensorGroup((("moe", "w_down"),), hf_down,
                              lambda read, rows: {("moe", "w_down"): dense_down(read, rows)}, None,
                              True, dtypes_down))
    return groups


def layer_groups(cfg: ModelConfig, layer: int, quantized: bool = False,
                 rope_interleaved: bool = True) -> list[TensorGroup]:
    """The groups of layer `layer` (HF names `model.layers.{layer}.*`); their leaves live in the
    stack `models.transformer.layer_slot(cfg, layer)` names. rope_interleaved: latent attention's
    RoPE rows pair adjacent dims in the checkpoint (`_latent_attention`)."""
    p = f"model.layers.{layer}."
    if not cfg.pre_norms:
        # OLMo 2/3's post-norms: its post_attention_layernorm norms the attention's output
        norms = [_single(p + "post_attention_layernorm.weight", ("post_attn_norm", "scale"), (cfg.d_model,)),
                 _single(p + "post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), (cfg.d_model,))]
    elif cfg.sandwich_norms:
        # Gemma's four: its post_attention_layernorm norms the attention's output (ours
        # post_attn_norm); the MLP's input norm is pre_feedforward_layernorm
        norms = [_single(p + "input_layernorm.weight", ("attn_norm", "scale"), (cfg.d_model,)),
                 _single(p + "post_attention_layernorm.weight", ("post_attn_norm", "scale"), (cfg.d_model,)),
                 _single(p + "pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), (cfg.d_model,)),
                 _single(p + "post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), (cfg.d_model,))]
    else:
        norms = [_single(p + "input_layernorm.weight", ("attn_norm", "scale"), (cfg.d_model,)),
                 _single(p + "post_attention_layernorm.weight", ("mlp_norm", "scale"), (cfg.d_model,))]
    return [*norms, *_attention(cfg, p, rope_interleaved), *_experts(cfg, p, quantized, cfg.layer_is_dense(layer))]


def global_groups(cfg: ModelConfig) -> list[TensorGroup]:
    """Embedding, final norm and (untied) LM head."""
    groups = [_single("model.embed_tokens.weight", ("embed", "embedding"), (cfg.vocab_size, cfg.d_model)),
              _single("model.norm.weight", ("final_norm", "scale"), (cfg.d_model,))]
    if not cfg.tie_embeddings:
        groups.append(_single("lm_head.weight", ("lm_head",), (cfg.vocab_size, cfg.d_model),
                              _transpose, _transpose))
    return groups


def is_mxfp4(names) -> bool:
    """Whether a checkpoint's tensor names carry MXFP4 expert weights."""
    return any(n.endswith("_blocks") for n in names)


# Present in some checkpoints, derived data rather than weights: ignored on load.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
