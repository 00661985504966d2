"""Public model entry points: `init_params` and `forward`.

Both take and return the one sharded param pytree. `forward` is a JAX function like any other:
it composes with `jax.jit`, `jax.grad` and `jax.vmap`. Concrete inputs are checked on the host
(shape, dtype, vocab range, length) before the jitted computation, because a gather with an
out-of-range index silently clamps inside XLA; traced inputs (inside a user's transformation)
get the static checks only (rank, dtype, length): their values are checked at the edges that see
them (batch building, engine admission).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import EXPERT_AXIS, constrain, sharding_for, use_mesh_in_trace
from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.models.lora import AdaptedParams, LoraAdapter, check_adapter, model_view, with_adapter


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def mesh_context(params):
    """The context to run the model under: `jax.set_mesh` of the params' mesh outside any trace;
    inside a user's jit/grad/vmap, the abstract mesh of the params' type (or the mesh already set);
    inside a user's jit over params closed over (concrete, but set_mesh is refused in a trace),
    their concrete mesh through `mesh.use_mesh_in_trace`."""
    leaf = jax.tree.leaves(params)[0]
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    if not _is_traced(leaf):
        mesh = mesh_of(params)
        try:
            return jax.set_mesh(mesh)
        except ValueError:  # called inside a trace (jit/vmap of a closure over concrete params)
            return use_mesh_in_trace(mesh)
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        raise ValueError("forward under a transformation: the params carry no mesh; run it under "
                         "`jax.set_mesh(mesh)` or pass params from init_params/load_hf")
    return jax.sharding.use_abstract_mesh(mesh)


def mesh_of(params: tfm.Params) -> Mesh:
    """The mesh the params live on (every leaf must share it).

    Args:
      params: the params (a nested dict of `jax.Array`; any pytree of arrays works); its first leaf is read.
    Returns:
      The `Mesh` of the first leaf's `NamedSharding`.
    Raises:
      ValueError: when the first leaf is not a `jax.Array` with a `NamedSharding` (use `init_params` / `load_hf`).
    """
    leaf = jax.tree.leaves(params)[0]
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"params must be jax.Arrays on a named mesh (NamedSharding), got {sharding}; "
                         "use init_params/load_hf")
    return sharding.mesh


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict:
    """The `NamedSharding` of every param, from its logical axes and the one rules table.

    Args:
      cfg: the model config.
      mesh: the mesh to shard over.
    Returns:
      A nested dict laid out as the params (`transformer.param_shapes(cfg)`), each leaf a `NamedSharding` on
      `mesh` (`mesh.LOGICAL_AXIS_RULES`, fitted to the param's shape).
    """
    axes = tfm.param_logical_axes(cfg)
    shapes = tfm.param_shapes(cfg)
    return jax.tree.map(
        lambda a, s: sharding_for(mesh, a, s.shape), axes, shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def check_mesh_fits(cfg: ModelConfig, mesh: Mesh) -> None:
    n = mesh.shape.get(EXPERT_AXIS, 1)
    if cfg.n_experts % n:
        raise ValueError(
            f"ModelConfig.n_experts={cfg.n_experts} is not divisible by the mesh's expert axis size {n}"
        )


def init_params(cfg: ModelConfig, mesh: Mesh, seed: int = 0) -> dict:
    """Random params, created directly in their shardings (no full host copy ever exists).

    Args:
      cfg: the model config.
      mesh: the mesh to create the params on.
      seed: the PRNG seed of the initialisers.
    Returns:
      A nested dict of `jax.Array` (laid out as `transformer.param_shapes(cfg)`, sharded as
      `param_shardings(cfg, mesh)`); expert weights are sharded over the `expert` axis, dense weights over
      `tensor` where their dims divide, replicated over `data`.
    Raises:
      ValueError: when `cfg.n_experts` is not divisible by the mesh's expert axis size.
    """
    check_mesh_fits(cfg, mesh)
    with jax.set_mesh(mesh):
        return _jitted_init(cfg, mesh)(jax.random.key(seed))


@functools.lru_cache(maxsize=32)
def _jitted_init(cfg: ModelConfig, mesh: Mesh):
    # One jitted init per (config, mesh): a fresh jax.jit per call would recompile every time.
    return jax.jit(functools.partial(tfm._init_pure, cfg), out_shardings=param_shardings(cfg, mesh))


@functools.partial(jax.jit, static_argnums=(0, 8))
def _forward_jit(cfg, params, adapter, tokens, segment_ids, positions, routes=None, routes_mask=None,
                 return_routes=False):
    params = with_adapter(cfg, model_view(cfg, params), adapter)
    out = tfm.forward_hidden(cfg, params, tokens, segment_ids, positions, routes=routes, routes_mask=routes_mask,
                             return_routes=return_routes)
    logits = constrain(tfm.logits_from_hidden(cfg, params, out[0]), ("batch", "seq", "vocab"))
    return (logits,) + tuple(out[1:])


def validate_routes(cfg: ModelConfig, tokens, routes, routes_mask=None) -> None:
    """Routing replay inputs, checked like tokens: dtype and the mask's shape always, expert ids'
    range when concrete (an out-of-range id would be clamped inside XLA, silently). The routes'
    own shape is checked where the forward reads them (`transformer.forward_hidden`)."""
    tfm.route_dims(cfg)  # a model without a MoE layer has nothing to replay
    if not jnp.issubdtype(jnp.result_type(routes), jnp.integer):
        raise TypeError(f"routes must be integer expert ids, got dtype {jnp.result_type(routes)}")
    if routes_mask is not None and np.shape(routes_mask) != np.shape(tokens):
        raise ValueError(f"routes_mask shape {np.shape(routes_mask)} != tokens shape {np.shape(tokens)}")
    ids = _concrete_range(routes)
    if ids is not None and (ids[0] < 0 or ids[1] >= cfg.n_experts):
        raise ValueError(f"routes must hold expert ids in [0, n_experts={cfg.n_experts}); found min {ids[0]}, "
                         f"max {ids[1]}")


def validate_tokens(cfg: ModelConfig, tokens, segment_ids=None, positions=None) -> None:
    """Checks with messages that name the offending input: rank, dtype and length always (they
    are static), value ranges only for concrete arrays (a traced value is unknown here)."""
    shape = np.shape(tokens)
    if len(shape) != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {shape}")
    dtype = jnp.result_type(tokens)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {dtype}")
    if shape[1] > cfg.max_seq_len:
        raise ValueError(f"tokens has seq length {shape[1]} > ModelConfig.max_seq_len={cfg.max_seq_len}")
    for name, arr in (("segment_ids", segment_ids), ("positions", positions)):
        if arr is not None and np.shape(arr) != shape:
            raise ValueError(f"{name} shape {np.shape(arr)} != tokens shape {shape}")
    token_range = _concrete_range(tokens)
    if token_range is not None and (token_range[0] < 0 or token_range[1] >= cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, vocab_size={cfg.vocab_size}); found min {token_range[0]}, "
                         f"max {token_range[1]}")
    position_range = None if positions is None else _concrete_range(positions)
    if position_range is not None and position_range[1] >= cfg.max_seq_len:
        raise ValueError(f"positions reach {position_range[1]} >= max_seq_len={cfg.max_seq_len}")


def _concrete_range(x) -> tuple[int, int] | None:
    """(min, max) of a concrete array; None for a traced one (or a constant inside a trace)."""
    if _is_traced(x):
        return None
    if isinstance(x, jax.Array):
        try:
            return int(jnp.min(x)), int(jnp.max(x))
        except jax.errors.ConcretizationTypeError:  # a concrete array captured inside a user's jit
            return None
    a = np.asarray(x)
    return int(a.min()), int(a.max())


def forward(cfg: ModelConfig, params: tfm.Params, tokens: jax.typing.ArrayLike,
            segment_ids: jax.typing.ArrayLike | None = None, positions: jax.typing.ArrayLike | None = None,
            return_aux: bool = False, *, routes: jax.typing.ArrayLike | None = None,
            routes_mask: jax.typing.ArrayLike | None = None, return_routes: bool = False,
            adapter: LoraAdapter | None = None) -> jax.Array | tuple[jax.Array | dict[str, jax.Array], ...]:
    """Logits [batch, seq, vocab] (fp32) of a packed batch; jitted once per shape.

    Composes with jax.jit / jax.grad / jax.vmap (see the module doc). Concrete inputs are checked on the host
    (shape, dtype, vocab range, length); traced ones get the static checks only (rank, dtype, length).

    Args:
      cfg: the model config.
      params: the sharded params (from `init_params` / `load_hf`), or `AdaptedParams` (base + adapter); the
        model runs on their mesh.
      tokens: `[batch, seq]` int token ids in `[0, cfg.vocab_size)`, seq <= `cfg.max_seq_len`.
      segment_ids: `[batch, seq]` int: tokens attend only within their segment (0 = padding).
        Default (None): one segment per row.
      positions: `[batch, seq]` int RoPE positions, below `cfg.max_seq_len` (default: restart at 0 in each
        segment).
      return_aux: also return the router metrics ('router_aux_loss', 'router_z_loss', ...).
      routes: routing replay (MoE): `[batch, seq, moe layers, top_k]` int expert ids in `[0, cfg.n_experts)`,
        the experts to use (e.g. an engine's `Completion.routes`) where `routes_mask` is true, gate weights
        from this forward's router; aux then holds 'routing_agreement' (overall and '/layer_<i>').
      routes_mask: `[batch, seq]` bool-like, where to replay `routes` (default: all); only with `routes`.
      return_routes: also return the experts used, `[batch, seq, moe layers, top_k]` int32.
      adapter: a `LoraAdapter` (`S.init_adapter` / `S.load_adapter`) applied unmerged on top of `params`
        (x W + s (x A) B at each adapted weight); differentiate through it to train only the adapter.
    Returns:
      The logits `[batch, seq, vocab]` float32 alone, or a tuple: logits, then aux (`{name: scalar}`, with
      `return_aux`), then routes (with `return_routes`).
    Raises:
      TypeError: when `tokens` or `routes` are not integer.
      ValueError: for a wrong rank or shape, a sequence past `cfg.max_seq_len`, token ids, positions or expert
        ids out of range (concrete inputs), `routes_mask` without `routes`, routes or `return_routes` on a model
        without a MoE layer, params that carry no mesh, or an adapter that does not fit the model.
    """
    validate_tokens(cfg, tokens, segment_ids, positions)
    if isinstance(params, AdaptedParams):
        if adapter is not None:
            raise ValueError("forward: params are AdaptedParams (they carry their adapter) and adapter= is given too")
        check_adapter(cfg, params.adapter)
    if adapter is not None:
        check_adapter(cfg, adapter)
    if routes is not None:
        validate_routes(cfg, tokens, routes, routes_mask)
    elif routes_mask is not None:
        raise ValueError("routes_mask without routes: pass the routes it masks")
    with mesh_context(params):
        out = _forward_jit(cfg, params, adapter, tokens, segment_ids, positions, routes, routes_mask,
                           bool(return_routes))
    if not (return_aux or return_routes):
        return out[0]
    return (out[0],) + ((out[1],) if return_aux else ()) + ((out[2],) if return_routes else ())
