"""Dropless Mixture-of-Experts with expert parallelism over the mesh's `expert` axis.

Flow for tokens x [tokens, embed] (the batch flattened):
  1. route (global, plain XLA): router logits -> top-k expert ids and weights, aux metrics.
  2. dispatch (inside `shard_map`): each device holds a token shard; its (token, expert)
     assignments are sorted by expert and sent to the device owning that expert.
  3. local experts: received rows sorted by local expert, one `grouped_matmul` per matrix
     (`jax.lax.ragged_dot`, or a loop over row tiles where XLA would expand it to a dense dot).
  4. the results travel back the same way and are combined with the routing weights.

Two exchange paths compute the same function, chosen by `cfg.moe_dispatch`:
  'padded' -- `all_to_all` of fixed [shards, capacity, embed] buffers (runs everywhere, CPU too);
  'ragged' -- `ragged_all_to_all` of only the rows that move (GPU/TPU). On CPU, where XLA has
              no ragged_all_to_all, an all-gather emulation with the same semantics stands in,
              so the offset logic is tested on CPU.
  'llep'   -- least-loaded EP (models/llep.py): overloaded experts' excess tokens and weights are
              spilled to the least-loaded devices; the same exchange, fewer rows per device.
Capacity is the worst case (every assignment to one shard), so no token is ever dropped.

Few tokens on one expert shard (a decode step on CPU): `all_experts_ffn` runs every expert on
every token and combines with the routing weights (zero for the experts a token did not choose)
instead of sorting, grouping and scattering rows: the same function summed in another order.
Chosen by `cfg.grouped_matmul='auto'` on CPU while the all-experts product is within the limit
under which XLA:CPU's ragged_dot itself is a dense product over every expert (for each of the
k x more assignment rows): one tiny-moe MoE layer 1.3-2.1x faster at 1-64 tokens
(`experiments/bench/moe_small_batch.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import EXPERT_AXIS, TENSOR_AXIS, TOKEN_AXES, concrete_mesh_in_trace, logical_to_spec
from sfrrl_jax.models import llep
from sfrrl_jax.models.grouped_matmul import AUTO_DENSE_LIMIT, choose_impl, grouped_matmul
from sfrrl_jax.models.layers import cdtype, param, project
from sfrrl_jax.models.lora_weight import LoraWeight, adapted_axes, low_rank_delta



class MoE(nnx.Module):
    """Router + experts. Expert weights: gate/up [experts, embed, mlp], down [experts, mlp, embed]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, e, f = cfg.d_model, cfg.n_experts, cfg.d_ff_expert
        self.cfg = cfg
        self.router = param(rngs, "normal", (d, e), ("embed", "experts_router"), cfg,
                            jnp.float32 if cfg.router_fp32 else None)
        if cfg.router_bias:
            self.router_bias = param(rngs, "zeros", (e,), ("experts_router",), cfg)
        if cfg.router == "sigmoid_topk":
            # the selection bias: no gradient reaches it; fp32 whatever param_dtype, as HF keeps
            # it (its experts' sigmoid scores differ by less than bf16 resolves)
            self.score_bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=("experts_router",))
        self.w_gate = param(rngs, "normal", (e, d, f), ("experts", "embed", "mlp"), cfg)
        self.w_up = param(rngs, "normal", (e, d, f), ("experts", "embed", "mlp"), cfg)
        self.w_down = param(rngs, "normal", (e, f, d), ("experts", "mlp", "embed"), cfg)
        if cfg.expert_bias:
            self.b_gate = param(rngs, "zeros", (e, f), ("experts", "mlp"), cfg)
            self.b_up = param(rngs, "zeros", (e, f), ("experts", "mlp"), cfg)
            self.b_down = param(rngs, "zeros", (e, d), ("experts", "embed"), cfg)

    def expert_weights(self) -> dict:
        names = ["w_gate", "w_up", "w_down"] + (["b_gate", "b_up", "b_down"] if self.cfg.expert_bias else [])
        return {n: getattr(self, n)[...] for n in names}

    def __call__(self, x: jax.Array, token_mask: jax.Array | None = None, replay=None, with_ids: bool = False):
        """x [batch, seq, embed] -> (y [batch, seq, embed], metrics dict of scalars).

        replay: None, or (expert ids [batch, seq, k] int, mask [batch, seq] bool): routing replay
        (R3) where the mask is true (`route`). with_ids: metrics also hold 'expert_ids' [batch,
        seq, k] int32, the experts used (not a scalar: callers asking for it pop it).
        """
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        mask = None if token_mask is None else token_mask.reshape(b * s)
        bias = self.router_bias[...] if self.cfg.router_bias else None
        replay_ids = replay_mask = None
        if replay is not None:
            replay_ids, replay_mask = replay[0].reshape(b * s, -1), replay[1].reshape(b * s)
        score_bias = self.score_bias[...] if self.cfg.router == "sigmoid_topk" else None
        ids, weights, metrics = route(self.cfg, flat, self.router[...], bias, mask, replay_ids, replay_mask,
                                      score_bias)
        y = moe_experts(self.cfg, flat, ids, weights, self.expert_weights())
        if with_ids:
            metrics = {**metrics, "expert_ids": ids.reshape(b, s, -1)}
        return y.reshape(b, s, d), metrics


def top_k_by_argmax(x, k: int):
    """`jax.lax.top_k` over the last axis as k rounds of argmax: the same values, ids and order
    (ties: the lowest id first). Each round is per row, so an input split over its row (token)
    axis stays split; XLA's SPMD partitioner all-gathers `lax.top_k`'s operand instead, which for
    router scores is [all tokens, experts] on every device (0.5 GB at 1M tokens x 128 experts).
    k is small (2-8), so the rounds cost less than the gather they save."""
    values, ids = [], []
    remaining = x
    for _ in range(k):
        i = jnp.argmax(remaining, axis=-1)
        values.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        ids.append(i)
        remaining = jnp.where(jax.nn.one_hot(i, x.shape[-1], dtype=bool), -jnp.inf, remaining)
    return jnp.stack(values, axis=-1), jnp.stack(ids, axis=-1).astype(jnp.int32)


def route(cfg: ModelConfig, x, router_w, router_b=None, token_mask=None, replay_ids=None, replay_mask=None,
          score_bias=None):
    """Top-k routing. x [tokens, embed] -> ids [tokens, k] int32, weights [tokens, k] fp32, metrics.

    cfg.router picks the rule (`ModelConfig.router`); score_bias [experts]: sigmoid_topk's
    selection bias (zeros when None).

    metrics: 'router_aux_loss' (HF's load-balance loss: n_experts * sum_e frac_e * mean_prob_e,
    frac summed over the k choices) and 'router_z_loss' (mean logsumexp(logits)^2), both over the
    tokens where `token_mask` is true.

    Routing replay (R3, arXiv 2510.11370): `replay_ids` [tokens, k] (any int dtype) are experts
    chosen elsewhere (the engine); where `replay_mask` [tokens] is true (default: everywhere) they
    replace this forward's top-k, and their weights are recomputed from this forward's router
    logits exactly as for its own choice (the router still gets gradients). metrics then also
    hold 'routing_agreement': the share of replayed (token, choice) pairs this forward would have
    chosen too, over masked tokens.
    """
    logits = project(x.astype(jnp.float32), router_w.astype(jnp.float32))   # an adapted router too
    if router_b is not None:
        logits = logits + router_b.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if cfg.router == "sigmoid_topk" or cfg.router_groups > 1:   # chosen by (biased, grouped) scores
        scores = jax.nn.sigmoid(logits) if cfg.router == "sigmoid_topk" else probs   # else DeepSeek-V2's groups
        _, ids = top_k_by_argmax(_grouped_choice(cfg, scores, score_bias), cfg.top_k)
        top_scores = jnp.take_along_axis(scores, ids, axis=-1)
    else:
        scores = probs if cfg.router == "softmax_topk" else logits
        top_scores, ids = top_k_by_argmax(scores, cfg.top_k)
    extra = {}
    if replay_ids is not None:
        replay_ids = replay_ids.astype(jnp.int32)
        use = jnp.ones(x.shape[0], bool) if replay_mask is None else replay_mask.astype(bool)
        m_agree = use if token_mask is None else use & token_mask.astype(bool)
        same = jnp.any(replay_ids[:, :, None] == ids[:, None, :], axis=-1)       # [tokens, k]
        extra["routing_agreement"] = (jnp.sum(same * m_agree[:, None]) /
                                      jnp.maximum(jnp.sum(m_agree) * cfg.top_k, 1))
        ids = jnp.where(use[:, None], replay_ids, ids)
        top_scores = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.router == "softmax_topk":
        weights = top_scores
        if cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if cfg.router_scale != 1.0:   # DeepSeek-V2's routed_scaling_factor
            weights = weights * cfg.router_scale
    elif cfg.router == "sigmoid_topk":
        weights = top_scores
        if cfg.norm_topk_prob:   # HF's epsilon: sigmoid scores may all be ~0
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        weights = weights * cfg.router_scale
    else:
        weights = jax.nn.softmax(top_scores, axis=-1)
    m = jnp.ones(x.shape[0], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(m), 1.0)
    chosen = jnp.sum(jax.nn.one_hot(ids, cfg.n_experts, dtype=jnp.float32), axis=1)  # [tokens, E]
    frac = jnp.sum(chosen * m[:, None], axis=0) / count
    mean_prob = jnp.sum(probs * m[:, None], axis=0) / count
    metrics = {
        "router_aux_loss": cfg.n_experts * jnp.sum(frac * mean_prob),
        "router_z_loss": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * m) / count,
        "expert_load_max": jnp.max(frac) / cfg.top_k,
        **extra,
    }
    return ids.astype(jnp.int32), weights, metrics


def _grouped_choice(cfg: ModelConfig, scores, score_bias):
    """Selection scores [tokens, experts]: scores + score_bias, -inf outside the router_topk_groups
    groups (of router_groups) worth the most: sigmoid_topk's worth is a group's two best such
    scores summed (DeepSeek-V3), softmax_topk's its best probability (DeepSeek-V2)."""
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    if cfg.router_groups == 1:
        return choice
    t, e = choice.shape
    grouped = choice.reshape(t, cfg.router_groups, e // cfg.router_groups)
    if cfg.router == "sigmoid_topk":
        best_two, _ = top_k_by_argmax(grouped, 2)
        worth = jnp.sum(best_two, axis=-1)
    else:
        worth = jnp.max(grouped, axis=-1)
    _, groups = top_k_by_argmax(worth, cfg.router_topk_groups)   # [tokens, topk_groups]
    kept = jnp.any(jax.nn.one_hot(groups, cfg.router_groups, dtype=bool), axis=1)        # [tokens, groups]
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, e)


# -- local expert compute ----------------------------------------------------------------------

def expert_ffn(cfg: ModelConfig, rows, local_ids, n_local: int, w: dict):
    """SwiGLU experts over rows grouped by expert.

    rows [m, embed]; local_ids [m] in [0, n_local], where n_local marks a padding row (computed as
    zero). w: expert weights sliced to the local experts (and local mlp shard).
    Returns [m, embed] (partial sums over the mlp shard when `mlp` is split over `tensor`).
    """
    dt = cdtype(cfg)
    order = jnp.argsort(local_ids, stable=True)
    sorted_ids = local_ids[order]
    xs = rows.at[order].get(unique_indices=True).astype(dt)
    group_sizes = jnp.bincount(sorted_ids, length=n_local + 1)[:n_local].astype(jnp.int32)
    m, (_, d_in, d_mlp) = xs.shape[0], w["w_gate"].shape
    impl = choose_impl(cfg.grouped_matmul, m, n_local, d_in, d_mlp)  # same sizes for down: [m, mlp] x [mlp, embed]
    gate = _grouped(xs, w["w_gate"].astype(dt), group_sizes, impl)
    up = _grouped(xs, w["w_up"].astype(dt), group_sizes, impl)
    gather_ids = jnp.minimum(sorted_ids, n_local - 1)
    if cfg.expert_bias:
        gate = gate + w["b_gate"].astype(dt)[gather_ids]
        up = up + w["b_up"].astype(dt)[gather_ids]
    out = _grouped(_swiglu(cfg, gate, up), w["w_down"].astype(dt), group_sizes, impl)
    if cfg.expert_bias:
        # Down bias is added once per row: only on the first mlp shard when mlp is split.
        bias = w["b_down"].astype(dt)[gather_ids]
        if _mlp_is_split(w, cfg):
            bias = jnp.where(jax.lax.axis_index(TENSOR_AXIS) == 0, bias, 0)
        out = out + bias
    out = jnp.where((sorted_ids < n_local)[:, None], out, 0)
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True)


def _grouped(rows, w, group_sizes, impl):
    """rows [m, in] (sorted by expert) times each row's expert's w [experts, in, out] -> [m, out];
    an adapted w (`LoraWeight`: a [experts, in, r], b [experts, r, out]) adds each expert's own
    low-rank path through two more grouped products of width r."""
    if not isinstance(w, LoraWeight):
        return grouped_matmul(rows, w, group_sizes, impl)
    y = grouped_matmul(rows, w.base, group_sizes, impl)
    return y + low_rank_delta(rows, w, lambda v, m, _: grouped_matmul(v, m, group_sizes, impl)).astype(y.dtype)


def _every_expert(x, w, first: bool):
    """Every expert of w on every row: x [n, in] -> [experts, n, out] (`first`: gate/up) or x
    [experts, n, in] -> [experts, n, out] (down); an adapted w adds each expert's low-rank path."""
    spec = "nd,edf->enf" if first else "end,edf->enf"
    if not isinstance(w, LoraWeight):
        return jnp.einsum(spec, x, w)
    y = jnp.einsum(spec, x, w.base)
    low = jnp.einsum(spec, x, w.a)
    return y + jnp.einsum("enr,erf->enf", low * jnp.asarray(w.scale, low.dtype), w.b).astype(y.dtype)


def _swiglu(cfg: ModelConfig, gate, up):
    """The experts' gated activation of gate, up [..., mlp]."""
    if cfg.expert_act == "gptoss_swiglu":
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))
    return jax.nn.silu(gate) * up


def all_experts_ffn(cfg: ModelConfig, x, ids, weights, w):
    """Every expert of `w` on every token, combined by the routing weights: x [n, embed], ids
    and weights [n, k] (ids index w's experts) -> [n, embed] in x's dtype, summed over the mlp
    shards. The experts a token did not choose are masked out and add nothing, so this is
    `expert_ffn` + the combine of `_dispatch_compute_combine` with the sums in another order.
    Work n x experts rows against the sparse path's n x k, but no sort, gather or scatter, and
    three batched dots: the faster path for a few tokens (see the module docstring)."""
    dt = cdtype(cfg)
    xs = x.astype(dt)
    gate = _every_expert(xs, w["w_gate"].astype(dt), first=True)
    up = _every_expert(xs, w["w_up"].astype(dt), first=True)
    if cfg.expert_bias:
        gate = gate + w["b_gate"].astype(dt)[:, None]
        up = up + w["b_up"].astype(dt)[:, None]
    out = _every_expert(_swiglu(cfg, gate, up), w["w_down"].astype(dt), first=False)   # [experts, n, embed]
    if cfg.expert_bias:
        bias = w["b_down"].astype(dt)[:, None]
        if _mlp_is_split(w, cfg):   # added once per token: on the first mlp shard only
            bias = jnp.where(jax.lax.axis_index(TENSOR_AXIS) == 0, bias, 0)
        out = out + bias
    n, e = x.shape[0], w["w_gate"].shape[0]
    rows = jnp.arange(n)[:, None]
    dense_weights = jnp.zeros((n, e), jnp.float32).at[rows, ids].add(weights.astype(jnp.float32))  # [n, experts]
    # an expert a token did not choose is masked out, not multiplied by 0: an inf or nan of its
    # output (an overflow the sparse path never computes) cannot reach the token
    chosen = jnp.zeros((e, n), bool).at[ids.T, rows.T].set(True)
    out = jnp.where(chosen[:, :, None], out.astype(jnp.float32), 0.0)
    y = jnp.einsum("end,ne->nd", out, dense_weights)
    return _sum_mlp_shards(y, w, cfg).astype(x.dtype)


def _all_experts_is_cheaper(cfg: ModelConfig, n: int, w: dict) -> bool:
    """`all_experts_ffn` for n tokens on one expert shard: with grouped_matmul 'auto' on CPU, while
    its product [experts, n, max(embed, mlp)] is within `AUTO_DENSE_LIMIT['cpu']` (there XLA:CPU
    runs ragged_dot as a dense product over every expert for each of the n x k assignment rows;
    measured on one tiny-moe layer: 1.3-2.1x faster at 1-64 tokens, even at 128, 0.75x at 256)."""
    e, d, f = w["w_gate"].shape
    return (cfg.grouped_matmul == "auto" and jax.default_backend() == "cpu"
            and e * n * max(d, f) <= AUTO_DENSE_LIMIT["cpu"])


def _current_axes() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(mesh.axis_names)


# -- exchange ----------------------------------------------------------------------------------

def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, axis_name):
    """`jax.lax.ragged_all_to_all` semantics built from all_gather (for backends without it)."""
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis_name)
    all_rows = jax.lax.all_gather(operand, axis_name)            # [S, rows_in, ...]
    in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [S] sender s's offset for me
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    idx = jnp.arange(output.shape[0])
    inside = (idx[None, :] >= out_off[:, None]) & (idx[None, :] < (out_off + sizes)[:, None])
    src = jnp.argmax(inside, axis=0)
    hit = jnp.any(inside, axis=0)
    row = jnp.clip(in_off[src] + idx - out_off[src], 0, operand.shape[0] - 1)
    gathered = all_rows[src, row]
    return jnp.where(hit.reshape((-1,) + (1,) * (output.ndim - 1)), gathered, output)


def _ragged_exchange(x, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    fn = jax.lax.ragged_all_to_all if jax.default_backend() in ("gpu", "tpu", "cuda", "rocm") \
        else _ragged_all_to_all_emulated
    return fn(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=EXPERT_AXIS)


def _dispatch_compute_combine(cfg: ModelConfig, n_shards: int, x, ids, weights, w):
    """Per-device body. x [n, embed] local tokens; ids/weights [n, k]; w local expert weights."""
    if n_shards > 1 and cfg.moe_dispatch == "llep":
        # least-loaded EP (models/llep.py) with this module's expert compute and exchange
        def ffn(rows, group_ids, groups, w_):
            return _sum_mlp_shards(expert_ffn(cfg, rows, group_ids, groups, w_), w_, cfg)
        return llep.dispatch_compute_combine(cfg, n_shards, x, ids, weights, w, ffn=ffn,
                                             exchange=_ragged_exchange)
    if n_shards == 1 and _all_experts_is_cheaper(cfg, x.shape[0], w):
        return all_experts_ffn(cfg, x, ids, weights, w)
    n, k = ids.shape
    a = n * k
    n_local = cfg.n_experts // n_shards
    eid = ids.reshape(a)
    order = jnp.argsort(eid, stable=True)               # by destination shard, then local expert
    sorted_eid = eid[order]
    rows = jnp.repeat(x, k, axis=0).at[order].get(unique_indices=True)   # [a, embed]
    dest = sorted_eid // n_local
    local = sorted_eid % n_local
    send_counts = jnp.bincount(dest, length=n_shards).astype(jnp.int32)
    send_start = jnp.cumsum(send_counts) - send_counts

    if n_shards == 1:
        out_sorted = _sum_mlp_shards(expert_ffn(cfg, rows, local, n_local, w), w, cfg)
    elif cfg.moe_dispatch == "padded":
        pos = jnp.arange(a) - send_start[dest]
        buf = jnp.zeros((n_shards, a, x.shape[-1]), x.dtype).at[dest, pos].set(rows)
        ids_buf = jnp.full((n_shards, a), n_local, jnp.int32).at[dest, pos].set(local)
        recv = jax.lax.all_to_all(buf, EXPERT_AXIS, 0, 0)
        recv_ids = jax.lax.all_to_all(ids_buf, EXPERT_AXIS, 0, 0)
        y = expert_ffn(cfg, recv.reshape(n_shards * a, -1), recv_ids.reshape(-1), n_local, w)
        y = _sum_mlp_shards(y, w, cfg)
        back = jax.lax.all_to_all(y.reshape(n_shards, a, -1), EXPERT_AXIS, 0, 0)
        out_sorted = back[dest, pos]
    else:  # ragged
        me = jax.lax.axis_index(EXPERT_AXIS)
        counts = jax.lax.all_gather(send_counts, EXPERT_AXIS)     # [src, dst]
        recv_sizes = counts[:, me]
        # Where my rows land in each receiver: after the rows of lower-ranked senders.
        below = (jnp.arange(n_shards) < me)[:, None]
        output_offsets = jnp.sum(jnp.where(below, counts, 0), axis=0).astype(jnp.int32)
        cap = n_shards * a
        recv = _ragged_exchange(rows, jnp.zeros((cap, x.shape[-1]), x.dtype), send_start,
                                send_counts, output_offsets, recv_sizes)
        recv_ids = _ragged_exchange(local, jnp.full((cap,), n_local, jnp.int32), send_start,
                                    send_counts, output_offsets, recv_sizes)
        y = _sum_mlp_shards(expert_ffn(cfg, recv, recv_ids, n_local, w), w, cfg)
        # Return trip: my received chunk from sender s sits at recv_start[s]; it goes back to
        # where s sent it from, i.e. s's send offset for me.
        recv_start = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
        sender_offsets = (jnp.cumsum(counts, axis=1) - counts)[:, me].astype(jnp.int32)
        out_sorted = _ragged_exchange(y, jnp.zeros((a, x.shape[-1]), y.dtype), recv_start,
                                      recv_sizes, sender_offsets, send_counts)
    per_assignment = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", per_assignment.astype(jnp.float32),
                      weights.astype(jnp.float32)).astype(x.dtype)


def _in_chunks(cfg: ModelConfig, n_shards: int, n_local: int, x, ids, weights, w):
    """`_dispatch_compute_combine` over the device's n_local tokens in chunks of
    cfg.moe_chunk_tokens (all at once when 0 or >= n_local): a scan whose body is rematerialised,
    so one chunk's worst-case exchange buffers live at a time, forward and backward."""
    chunk = cfg.moe_chunk_tokens
    if not chunk or chunk >= n_local:
        return _dispatch_compute_combine(cfg, n_shards, x, ids, weights, w)
    pad = -n_local % chunk
    split = lambda a: jnp.pad(a, ((0, pad), (0, 0))).reshape((-1, chunk) + a.shape[1:])
    # padding tokens route to expert 0 with weight 0: computed, then multiplied away
    body = jax.checkpoint(lambda _, xs: (None, _dispatch_compute_combine(cfg, n_shards, *xs, w)))
    _, y = jax.lax.scan(body, None, (split(x), split(ids), split(weights)))
    return y.reshape((-1,) + y.shape[2:])[:n_local]


def _mlp_is_split(w, cfg) -> bool:
    """Inside shard_map: this device holds a slice of the experts' mlp dim (split over tensor)."""
    return TENSOR_AXIS in _current_axes() and w["w_down"].shape[1] != cfg.d_ff_expert


def _sum_mlp_shards(y, w, cfg):
    return jax.lax.psum(y, TENSOR_AXIS) if _mlp_is_split(w, cfg) else y


def _weight_specs(cfg: ModelConfig, w: dict, mesh) -> dict:
    axes = {"w_gate": ("experts", "embed", "mlp"), "w_up": ("experts", "embed", "mlp"),
            "w_down": ("experts", "mlp", "embed"), "b_gate": ("experts", "mlp"),
            "b_up": ("experts", "mlp"), "b_down": ("experts", "embed")}
    def spec(name, v):
        if not isinstance(v, LoraWeight):
            return logical_to_spec(axes[name], shape=v.shape, mesh=mesh)
        a_axes, b_axes = adapted_axes(axes[name], v.n_in, v.n_batch)
        return dataclasses.replace(v, base=logical_to_spec(axes[name], shape=v.base.shape, mesh=mesh),
                                   a=logical_to_spec(a_axes, shape=v.a.shape, mesh=mesh),
                                   b=logical_to_spec(b_axes, shape=v.b.shape, mesh=mesh))
    return {n: spec(n, v) for n, v in w.items()}


def moe_experts(cfg: ModelConfig, x, ids, weights, w: dict):
    """Expert outputs combined with routing weights. x [tokens, embed] -> [tokens, embed].

    Under a mesh with an `expert` axis this runs in `shard_map`; tokens are split over
    (data, expert, context), padded to a multiple of that product (padding rows are dropped after).
    """
    # the concrete mesh when the model runs inside a user's jit on params closed over (mesh.py)
    mesh = concrete_mesh_in_trace() or jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _dispatch_compute_combine(cfg, 1, x, ids, weights, w)
    n_shards = mesh.shape[EXPERT_AXIS]
    if cfg.n_experts % n_shards:
        raise ValueError(f"n_experts={cfg.n_experts} is not divisible by the mesh's expert axis ({n_shards})")
    token_axes = tuple(a for a in TOKEN_AXES if a in mesh.shape)
    token_shards = math.prod(mesh.shape[a] for a in token_axes)
    n = x.shape[0]
    pad = (-n) % token_shards
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    tok = P(token_axes, None)
    body = functools.partial(_in_chunks, cfg, n_shards, (n + pad) // token_shards)
    y = jax.shard_map(
        body, mesh=mesh, in_specs=(tok, tok, tok, _weight_specs(cfg, w, mesh)), out_specs=tok,
        check_vma=False,
    )(x, ids, weights, w)
    return y[:n]
