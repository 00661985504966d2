"""The decoder: embedding -> n_layers x (attention + MoE or dense MLP) -> final norm -> LM head.

Layers are stacked (every layer param has a leading `layers` dim) and run with `lax.scan`, so
compile time does not grow with depth. A MoE model with dense layers (`cfg.dense_layers`) keeps
two stacks, the MoE layers under `layers` and the dense ones under `dense_layers`, and runs one
scan per run of consecutive same-kind layers (`layer_runs`); a uniform model has the one stack
and the one scan. Params are a plain nested dict of `jax.Array`s; the NNX
modules define their structure, initialisers and logical axes, and are re-bound to the arrays
inside each jitted function (`nnx.merge`), which moves no data.

Functions here are pure and traceable; callers jit them under `jax.set_mesh(mesh)` so the MoE
layer can enter `shard_map` on that mesh (the public wrappers in `sfrrl_jax.models.api` do).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import constrain
from sfrrl_jax.models.context_parallel import from_zigzag, pad_for_context, to_zigzag
from sfrrl_jax.models.layers import DenseMLP, Embed, RMSNorm, cdtype, param, project
from sfrrl_jax.models.mla import attention_for
from sfrrl_jax.models.moe import MoE

Params = dict  # nested dict of jax.Array; see `param_logical_axes` for its layout


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)); x + ffn(norm(x)), the ffn a MoE (params under
    'moe') or, for dense families and a MoE model's dense layers, a GLU MLP (params under
    'mlp'). With cfg.sandwich_norms (Gemma) each sublayer's output is normed before the add;
    without cfg.pre_norms the inputs are not (OLMo 2/3: x + norm(attn(x)); x + norm(ffn(x)))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dense: bool = False):
        if cfg.pre_norms:
            self.attn_norm = RMSNorm(cfg.d_model, cfg)
            self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = attention_for(cfg)(cfg, rngs)
        if cfg.sandwich_norms:   # Gemma: the sublayers' outputs are normed too, before the residual add
            self.post_attn_norm = RMSNorm(cfg.d_model, cfg)
            self.post_mlp_norm = RMSNorm(cfg.d_model, cfg)
        if cfg.is_moe and not dense:
            self.moe = MoE(cfg, rngs)
            if cfg.d_ff_shared:
                self.shared_expert = DenseMLP(cfg, rngs, width=cfg.d_ff_shared)
            if cfg.shared_expert_gate:
                self.shared_gate = param(rngs, "normal", (cfg.d_model, 1), ("embed", None), cfg)
        else:
            self.mlp = DenseMLP(cfg, rngs)

    def ffn(self, h, token_mask=None, replay=None, with_ids: bool = False):
        """h [batch, seq, embed] (normed) -> (y, metrics: the router's for a MoE, {} for dense).
        replay / with_ids: routing replay and the experts used, for a MoE (`MoE.__call__`); a
        shared expert's output (gated per token where the config says) is added to the MoE's."""
        if not hasattr(self, "moe"):
            return self.mlp(h, token_mask)
        y, metrics = self.moe(h, token_mask, replay, with_ids)
        if hasattr(self, "shared_expert"):
            shared, _ = self.shared_expert(h, token_mask)
            if hasattr(self, "shared_gate"):
                gate = project(h, self.shared_gate[...].astype(h.dtype))
                shared = shared * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(shared.dtype)
            y = y + shared.astype(y.dtype)
        return y, metrics

    def attn_input(self, x):
        """The residual stream [batch, seq, embed] as the attention reads it (normed, pre-norm)."""
        return self.attn_norm(x) if hasattr(self, "attn_norm") else x

    def ffn_input(self, x):
        """The residual stream [batch, seq, embed] as the MLP / MoE reads it (normed, pre-norm)."""
        return self.mlp_norm(x) if hasattr(self, "mlp_norm") else x

    def attn_residual(self, y):
        """The attention's output as the residual stream adds it (normed first with sandwich
        norms, scaled by cfg.residual_scale)."""
        return self._scaled(self.post_attn_norm(y) if hasattr(self, "post_attn_norm") else y)

    def ffn_residual(self, y):
        """The MLP's output as the residual stream adds it (normed first with sandwich norms,
        scaled by cfg.residual_scale)."""
        return self._scaled(self.post_mlp_norm(y) if hasattr(self, "post_mlp_norm") else y)

    def _scaled(self, y):
        scale = self.attn.cfg.residual_scale
        return y if scale == 1.0 else y * jnp.asarray(scale, y.dtype)

    def __call__(self, x, positions, segment_ids, window, token_mask, replay=None, with_ids: bool = False, rope=True):
        x = x + self.attn_residual(self.attn(self.attn_input(x), positions, segment_ids, window, rope))
        x = constrain(x, ("batch", "seq", "embed"))
        y, metrics = self.ffn(self.ffn_input(x), token_mask, replay, with_ids)
        return constrain(x + self.ffn_residual(y), ("batch", "seq", "embed")), metrics


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, n: int, dense: bool):
    """`n` Blocks with every param stacked on a leading dim (each layer its own init draw)."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_layers(r):
        return Block(cfg, r, dense)

    return make_layers(rngs)


class Transformer(nnx.Module):
    """The decoder as an NNX module: it defines the params' structure, initialisers and logical axes.

    Params live as a plain nested dict of `jax.Array` (`Params`); this module is rebuilt abstractly per config
    (`_skeleton`) and re-bound to the arrays inside each jitted function (`bind`), which moves no data.

    Attributes:
      cfg: the model config.
      embed: the token embedding table `[vocab, embed]`.
      layers: the stacked blocks (every param with a leading `layers` dim): every layer of a uniform model, the MoE
        layers of a MoE model with `cfg.dense_layers`.
      dense_layers: the stacked dense blocks of a MoE model with `cfg.dense_layers` (absent otherwise).
      final_norm: the final RMSNorm.
      lm_head: the LM head `[embed, vocab]`; absent with `cfg.tie_embeddings` (the transposed embedding serves).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)
        (_, main), *rest = layer_stacks(cfg)
        self.layers = _stacked_blocks(cfg, rngs, len(main), dense=not cfg.is_moe)
        if rest:
            self.dense_layers = _stacked_blocks(cfg, rngs, len(rest[0][1]), dense=True)
        self.final_norm = RMSNorm(cfg.d_model, cfg)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, "normal", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg)


# -- structure ----------------------------------------------------------------------------------

STACK_KEYS = ("layers", "dense_layers")  # the params' stacked-layer subtrees (leading dim: layer)


def layer_stacks(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(param key, the model layers it stacks, in stack order) per stack: one `layers` stack for
    a uniform model; for a MoE model with `dense_layers`, its MoE layers under `layers` and its
    dense layers under `dense_layers`."""
    every = tuple(range(cfg.n_layers))
    if not cfg.dense_layers:
        return (("layers", every),)
    return (("layers", tuple(i for i in every if i not in cfg.dense_layers)),
            ("dense_layers", cfg.dense_layers))


def layer_slot(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """(stack key, row in that stack) of model layer `layer`."""
    for key, members in layer_stacks(cfg):
        if layer in members:
            return key, members.index(layer)
    raise IndexError(f"layer {layer} out of range for n_layers={cfg.n_layers}")


def layer_runs(cfg: ModelConfig) -> tuple[tuple[str, int, int, int], ...]:
    """Maximal runs of consecutive model layers living in the same stack, in model order:
    (stack key, first row, end row (exclusive), first model layer). Each run is one scan."""
    runs: list = []
    for layer in range(cfg.n_layers):
        key, row = layer_slot(cfg, layer)
        if runs and runs[-1][0] == key and runs[-1][2] == row:
            runs[-1][2] = row + 1
        else:
            runs.append([key, row, row + 1, layer])
    return tuple(tuple(r) for r in runs)


@functools.lru_cache(maxsize=64)
def _skeleton(cfg: ModelConfig):
    """(graphdef, abstract param state) of the model for `cfg`; no arrays are allocated."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param)


def stacked_param_logical_axes(cfg: ModelConfig) -> dict:
    """`param_logical_axes` of the stacked layout (every stack's leaves `[layers, ...]`), whatever
    cfg.scan_layers says: the layout adapters (`models.lora`) and the HF tensor map are written in."""
    _, state = _skeleton(cfg)
    flat = {}
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata()["logical_axes"]
        if path[0] in STACK_KEYS:
            axes = ("layers",) + tuple(axes)
        flat[path] = tuple(axes)
    return unflatten_paths(flat)


def stacked_param_shapes(cfg: ModelConfig) -> dict:
    """`param_shapes` of the stacked layout, whatever cfg.scan_layers says."""
    _, state = _skeleton(cfg)
    return unflatten_paths({p: jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in nnx.to_flat_state(state)})


def param_logical_axes(cfg: ModelConfig) -> dict:
    """Same nested layout as the params, each leaf a tuple of logical names (one per dim).

    Args:
      cfg: the model config.
    Returns:
      A nested dict like the params, each leaf a tuple of logical axis names (`sfrrl_jax.mesh.LOGICAL_AXIS_RULES`)
      or None per dim; with cfg.scan_layers, stacked layers' leaves start with `"layers"`; without, each
      stack is a list of per-layer dicts (`per_layer_layout`).
    """
    axes = stacked_param_logical_axes(cfg)
    if cfg.scan_layers:
        return axes
    return per_layer_layout(cfg, axes, lambda a, row: a[1:], is_leaf=lambda a: isinstance(a, tuple))


def param_shapes(cfg: ModelConfig) -> dict:
    """Same layout as the params, each leaf a `jax.ShapeDtypeStruct` (stacked or per layer as
    cfg.scan_layers says)."""
    shapes = stacked_param_shapes(cfg)
    if cfg.scan_layers:
        return shapes
    return per_layer_layout(cfg, shapes, lambda a, row: jax.ShapeDtypeStruct(a.shape[1:], a.dtype))


# -- the per-layer layout (cfg.scan_layers=False) ---------------------------------------------------
# Each stack (`layers`, `dense_layers`) is a list of per-layer dicts in stack order (a list, not a
# tuple: logical axes are tuples), each leaf the stacked leaf's row: one buffer per layer's weight.
# XLA:CPU copies a dynamic slice of a stacked weight out before every matmul it feeds (a scan over
# stacked layers read SmolLM2's weights at 38 % of this CPU's bandwidth, a loop over per-layer
# arrays at 85 %; issue #44), so with per-layer params every forward (the engine's steps and the
# train step) runs the layers unrolled, each reading its own arrays in place: compile time grows
# with depth (about 2x a scan's for SmolLM2's 30 layers), the numbers are the stacked layout's.

def per_layer_layout(cfg: ModelConfig, stacked: dict, row_of, is_leaf=None) -> dict:
    """The stacked layout `stacked` with each stack replaced by a list of per-layer trees,
    leaf `row_of(stacked_leaf, row)` for row 0..n-1 of the stack."""
    out = dict(stacked)
    for key, members in layer_stacks(cfg):
        out[key] = [jax.tree.map(lambda a, r=r: row_of(a, r), stacked[key], is_leaf=is_leaf)
                    for r in range(len(members))]
    return out


def is_per_layer(params) -> bool:
    """Whether `params` (or a view of them) is in the per-layer layout (a list per stack)."""
    return isinstance(params.get("layers"), list)


def unstack_layers(cfg: ModelConfig, params: Params) -> Params:
    """Stacked params -> the per-layer layout (`cfg.scan_layers=False`): each stacked leaf's rows as
    separate arrays (a copy: the loader and `init_params` run it once, inside their jit)."""
    return per_layer_layout(cfg, params, lambda a, row: a[row])


def unflatten_paths(flat: dict) -> dict:
    """{(key, key, ...): leaf} -> nested dict (the params layout)."""
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def bind(cfg: ModelConfig, params: Params) -> Transformer:
    """An NNX view of `params` (inside jit: no copies). Per-layer params (`is_per_layer`) bind
    their global weights only (the stacks stand abstract); `per_layer_states` gives their layers."""
    graphdef, state = _skeleton(cfg)
    if is_per_layer(params):
        params = {**params, **{key: nnx.to_pure_dict(state[key]) for key, _ in layer_stacks(cfg)}}
    return nnx.merge(graphdef, params)


def per_layer_states(cfg: ModelConfig, params: Params) -> list:
    """(graphdef, that layer's params) in model order (`run_layers`' `layers`): per-layer params'
    own dicts, or static rows of stacked params (copies on XLA:CPU: correct, not fast)."""
    skeleton = nnx.merge(*_skeleton(cfg))   # abstract: no arrays
    graphdefs = {key: nnx.split(getattr(skeleton, key))[0] for key, _ in layer_stacks(cfg)}
    per_layer = is_per_layer(params)

    def rows(key, row):
        return params[key][row] if per_layer else jax.tree.map(lambda a: a[row], params[key])
    return [(graphdefs[key], rows(key, row)) for key, row in (layer_slot(cfg, i) for i in range(cfg.n_layers))]


def _init_pure(cfg: ModelConfig, key) -> Params:
    model = Transformer(cfg, nnx.Rngs(params=key))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return params if cfg.scan_layers else unstack_layers(cfg, params)


# -- forward ------------------------------------------------------------------------------------

# Per-layer rematerialisation (cfg.remat): what the backward keeps of each layer's forward.
#   full: only the layer input; everything is recomputed.
#   dots / dots_no_batch: matmul results (all / those without batch dims) are kept.
#   attention_out: the attention core's output and softmax log-sum-exp (names set in
#     models.layers / models.attention) are kept, so the backward recomputes the cheap
#     projections and the MoE but never re-runs the O(seq^2) attention forward.
#   dots_attention_out: both of the above.
_ATTENTION_NAMES = jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse")
_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "attention_out": _ATTENTION_NAMES,
    "dots_attention_out": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots, _ATTENTION_NAMES),
}


def default_positions_and_segments(tokens, segment_ids=None, positions=None):
    """Fills in segment ids (all 1) and positions (0..T-1, restarting at each new segment)."""
    b, t = tokens.shape
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    if positions is None:
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        starts = jnp.concatenate(
            [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
        )
        seg_start = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
        positions = idx - seg_start
    return segment_ids.astype(jnp.int32), positions.astype(jnp.int32)


def run_layers(cfg: ModelConfig, model: Transformer, x, body_fn, xs_extra=None, layers=None):
    """Runs the layers in model order: `body_fn(block, carry, window, extra, rope) -> (carry, out)`;
    rope: whether the layer applies RoPE (Python True unless cfg.nope_layers names some, then a
    traced bool scalar per layer).

    xs_extra: a pytree of per-layer inputs with leading dim n_layers (model order), or None.
    Returns (carry, {stack key: outs stacked over that stack's layers, in stack order}), e.g.
    {'layers': router metrics [n_moe_layers]} for a MoE model. One `lax.scan` per run of
    consecutive same-stack layers (`layer_runs`): a uniform model scans its whole stack once;
    a mixed one scans row ranges of its two stacks in turn, so no layer carries both MLP kinds.
    layers: per-layer params as (graphdef, params) in model order (`per_layer_states`): the layers
    then run unrolled, one after the other, each reading its own arrays (no scan, no slice of a
    stack), each rematerialised as cfg.remat says, as a scan's body is.
    """
    if layers is not None:
        return _run_layers_unrolled(cfg, layers, x, body_fn, xs_extra)
    stacks = {key: nnx.split(getattr(model, key)) for key, _ in layer_stacks(cfg)}
    sizes = {key: len(members) for key, members in layer_stacks(cfg)}
    outs: dict = {key: [] for key in stacks}
    for key, start, stop, first in layer_runs(cfg):
        graphdef, state = stacks[key]
        n = stop - start
        # A run over part of a stack scans a static slice of its rows, which XLA may copy (the
        # run's params, transiently). A stack in one run (e.g. Qwen3-MoE-style dense layers all
        # at the start) is scanned unsliced, as a uniform model's.
        if n != sizes[key]:
            state = jax.tree.map(lambda a: a[start:stop], state)
        extra = None if xs_extra is None else jax.tree.map(lambda a: a[first:first + n], xs_extra)
        windows = jnp.asarray(cfg.layer_windows[first:first + n], jnp.int32)
        ropes = jnp.asarray(cfg.layer_ropes[first:first + n]) if cfg.nope_layers else None

        def body(carry, scanned, graphdef=graphdef):
            layer_state, window, rope, layer_extra = scanned
            return body_fn(nnx.merge(graphdef, layer_state), carry, window, layer_extra, True if rope is None else rope)

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
        x, out = jax.lax.scan(body, x, (state, windows, ropes, extra))
        outs[key].append(out)
    return x, {key: out[0] if len(out) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *out)
               for key, out in outs.items()}


def _run_layers_unrolled(cfg: ModelConfig, layers, x, body_fn, xs_extra=None):
    """`run_layers` over per-layer params: a Python loop in model order, outs stacked per stack."""
    outs: dict = {key: [] for key, _ in layer_stacks(cfg)}
    for layer, (graphdef, layer_params) in enumerate(layers):
        extra = None if xs_extra is None else jax.tree.map(lambda a: a[layer], xs_extra)
        window = jnp.int32(cfg.layer_windows[layer])
        rope = bool(cfg.layer_ropes[layer]) if cfg.nope_layers else True

        # window and the per-layer extra are closed over, not arguments: a remat'd layer would
        # trace them, and the engine indexes per-layer caches by its (numpy) layer id
        def one(layer_params, carry, graphdef=graphdef, window=window, extra=extra, rope=rope):
            return body_fn(nnx.merge(graphdef, layer_params), carry, window, extra, rope)

        if cfg.remat != "none":
            one = jax.checkpoint(one, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
        x, out = one(layer_params, x)
        outs[layer_slot(cfg, layer)[0]].append(out)
    return x, {key: None if not out or out[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *out)
               for key, out in outs.items()}


def moe_layer_ids(cfg: ModelConfig) -> tuple[int, ...]:
    """The model layers with a router, in model order (index j of a routes array is layer ids[j])."""
    return tuple(i for i in range(cfg.n_layers) if cfg.is_moe and not cfg.layer_is_dense(i))


def route_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(moe layers, top_k): the trailing dims of a routes array [..., moe layers, top_k]. Raises
    ValueError for a model without a MoE layer (nothing to route)."""
    moe = moe_layer_ids(cfg)
    if not moe:
        raise ValueError("routes: this model has no MoE layer to replay routing in")
    return len(moe), cfg.top_k


def _replay_per_layer(cfg: ModelConfig, routes, routes_mask, segment_ids, seq_len: int):
    """routes [batch, seq, moe layers, k] -> per model layer [n_layers, batch, padded seq, k] in
    the layers' token order (context padding and zig-zag), and the mask likewise [batch, seq]."""
    b = segment_ids.shape[0]
    want = (b, seq_len) + route_dims(cfg)
    if tuple(routes.shape) != want:
        raise ValueError(f"routes has shape {tuple(routes.shape)}; expected [batch, seq, moe layers, top_k] = {want}")
    mask = jnp.ones((b, seq_len), bool) if routes_mask is None else routes_mask.astype(bool)
    pad = segment_ids.shape[1] - seq_len
    if pad:
        routes = jnp.pad(routes, ((0, 0), (0, pad), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))
    routes, mask = to_zigzag(routes), to_zigzag(mask)
    # dense layers get some MoE layer's routes, never read (they have no router)
    moe = moe_layer_ids(cfg)
    index = jnp.asarray([moe.index(i) if i in moe else 0 for i in range(cfg.n_layers)], jnp.int32)
    return jnp.moveaxis(routes, 2, 0)[index], mask


def forward_hidden(cfg: ModelConfig, params: Params, tokens: jax.Array, segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None, routes: jax.Array | None = None,
                   routes_mask: jax.Array | None = None, return_routes: bool = False
                   ) -> tuple[jax.Array, dict[str, jax.Array]] | tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """Final-normed hidden states [batch, seq, embed] and aux metrics (means over the MoE
    layers; a dense layer has no router).

    Pure and traceable: call it under `jax.set_mesh(mesh)` (inside a jit), as the public wrappers in
    `sfrrl_jax.models.api` do.

    Args:
      cfg: the model config.
      params: the params (`Params`, laid out as `param_shapes(cfg)`).
      tokens: `[batch, seq]` int token ids.
      segment_ids: `[batch, seq]` int (0 = padding, excluded from router statistics; tokens attend only
        within their segment). Default (None): one segment per row.
      positions: `[batch, seq]` int, RoPE positions (and causality). Default (None): 0..seq-1, restarting
        at each new segment.
      routes: routing replay (R3): `[batch, seq, moe layers, top_k]` int (any int dtype; layers in
        `moe_layer_ids` order), the experts to use where `routes_mask` is true; their weights come from this
        forward's router, so the router still learns. None: route as the router chooses.
      routes_mask: `[batch, seq]` bool-like, where to replay `routes` (default: all).
      return_routes: also return the experts used, as a third value.
    Returns:
      `(hidden, aux)`, or `(hidden, aux, routes)` with `return_routes`:
        hidden: `[batch, seq, embed]` in the compute dtype.
        aux: `{name: scalar}`, the router metrics ('router_aux_loss', 'router_z_loss', ...) averaged over the
          MoE layers ({} for a dense model); with `routes`, also 'routing_agreement' (the share of replayed
          choices this forward would have made, over the MoE layers) and 'routing_agreement/layer_<i>' per
          MoE layer i.
        routes: `[batch, seq, moe layers, top_k]` int32, the experts used.
    Raises:
      ValueError: when `routes` is given or `return_routes` is set on a model without a MoE layer, or `routes`
        does not have the shape `[batch, seq, moe layers, top_k]`.
    """
    model = bind(cfg, params)
    layers = per_layer_states(cfg, params) if is_per_layer(params) else None
    segment_ids, positions = default_positions_and_segments(tokens, segment_ids, positions)
    # Context parallelism (a no-op unless the sequence is split: a `context` axis, or `expert`
    # when the rows do not split over it): pad to 2 x context chunks and run the layers in
    # zig-zag order, which balances causal attention over the shards.
    tokens, segment_ids, positions, seq_len = pad_for_context(tokens, segment_ids, positions)
    tokens, segment_ids, positions = (to_zigzag(constrain(a, ("batch", "seq")))
                                      for a in (tokens, segment_ids, positions))
    token_mask = segment_ids > 0
    x = constrain(model.embed(tokens), ("batch", "seq", "embed"))
    replay_mask = per_layer_routes = None
    if routes is not None:
        per_layer_routes, replay_mask = _replay_per_layer(cfg, routes, routes_mask, segment_ids, seq_len)
    elif return_routes and not moe_layer_ids(cfg):
        raise ValueError("return_routes: this model has no MoE layer")

    def body(block, x, window, layer_routes, rope):
        replay = None if layer_routes is None else (layer_routes, replay_mask)
        return block(x, positions, segment_ids, window, token_mask, replay, return_routes, rope)

    x, outs = run_layers(cfg, model, x, body, per_layer_routes, layers)
    # The `layers` stack holds every MoE layer (and a dense model's layers, whose metrics are {}).
    per_layer = dict(outs["layers"])
    used = per_layer.pop("expert_ids", None)   # [moe layers, batch, padded seq, k]
    aux = {k: jnp.mean(v) for k, v in per_layer.items()}
    if "routing_agreement" in per_layer:
        for j, layer in enumerate(moe_layer_ids(cfg)):
            aux[f"routing_agreement/layer_{layer}"] = per_layer["routing_agreement"][j]
    hidden = from_zigzag(model.final_norm(x))[:, :seq_len]
    hidden = constrain(hidden, ("batch", "seq", "embed"))
    if return_routes:
        return hidden, aux, from_zigzag(jnp.moveaxis(used, 0, 2))[:, :seq_len]
    return hidden, aux


def unembedding(cfg: ModelConfig, params: Params) -> jax.Array:
    """The LM head matrix [embed, vocab] (the transposed embedding when tied), divided by
    cfg.logits_divisor (Granite's logits_scaling): every path to the logits, the engine's and the
    train step's chunked log-probs, goes through here.

    Args:
      cfg: the model config (`tie_embeddings`, `logits_divisor`).
      params: the params (`Params`).
    Returns:
      `[embed, vocab]` in the params' dtype: `params['lm_head']`, or `params['embed']['embedding'].T` when tied.
    """
    w = params["embed"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]
    return w if cfg.logits_divisor == 1.0 else w / jnp.asarray(cfg.logits_divisor, w.dtype)


def logits_from_hidden(cfg: ModelConfig, params: Params, hidden) -> jax.Array:
    """hidden [..., embed] -> logits [..., vocab] in fp32."""
    w = unembedding(cfg, params).astype(cdtype(cfg))
    return project(hidden, w, preferred_element_type=jnp.float32)


def forward_with_aux(cfg: ModelConfig, params: Params, tokens, segment_ids=None, positions=None):
    """(logits [batch, seq, vocab] fp32, aux metrics)."""
    hidden, aux = forward_hidden(cfg, params, tokens, segment_ids, positions)
    logits = constrain(logits_from_hidden(cfg, params, hidden), ("batch", "seq", "vocab"))
    return logits, aux


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
