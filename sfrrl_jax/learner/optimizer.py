"""AdamW with linear warmup + cosine decay and global-norm clipping; ZeRO-1 state shardings.

The optimizer state is `OptState(step: int32 scalar, inner: optax state)`, a NamedTuple pytree
(`state['step']` / `state['inner']` still read the fields, as the former dict did). `step` counts
*applied* updates (a skipped non-finite update does not advance it), and is what the schedule
reads. The train step also takes any optax `GradientTransformation` instead of an
`OptimizerConfig` (`as_transformation`); its state sits in `inner` the same way.
Params keep the shared sharding (generation reads the same arrays); the moments, which only the
train step reads, may additionally be split over the `data` axis (config path), or follow the
params' shardings (a raw transformation).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.checks import check_bool, check_int, check_number, check_str
# HOST_MEMORY is re-exported: the learner names it from here
from sfrrl_jax.mesh import HOST_MEMORY, with_memory_kind as mesh_with_memory_kind  # noqa: F401


class OptState(NamedTuple):
    """Optimizer state: applied-update counter + the optax transformation's own state."""
    step: Any   # int32 scalar: updates applied (skipped ones not counted)
    inner: Any  # optax state of the transformation

    def __getitem__(self, key):
        # state['step'] / state['inner'] keep reading like the former {'step', 'inner'} dict
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)


def as_opt_state(state) -> OptState:
    """An OptState as is; a `{'step', 'inner'}` dict (the former layout) converted."""
    if isinstance(state, OptState):
        return state
    if isinstance(state, dict) and set(state) == {"step", "inner"}:
        return OptState(step=state["step"], inner=state["inner"])
    raise TypeError(f"expected an OptState (or a {{'step', 'inner'}} dict), got {type(state).__name__}")


PARAM_ROUNDINGS = ("stochastic", "nearest")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters and the learning-rate schedule.

    Schedule: lr = peak * (step + 1) / warmup_steps during warmup (so step 0 already moves),
    then cosine from peak to peak * end_lr_ratio over the remaining total_steps - warmup_steps
    steps, constant afterwards.
    max_grad_norm: global-norm clip (None: no clipping).
    decay_matrices_only: weight decay only on weight matrices: not on norm scales, biases (q/k/v/o,
      the experts' b_*, the router's) or attention sinks, found by name (`decays`), since stacked
      layers give every per-layer vector a leading layers dim (a norm's scale is [layers, embed]).
    state_shard_axis: mesh axis the moments are further split over (None: like the params).
    offload_state: keep the optimizer state in host memory (`memory_kind='pinned_host'`) between
      updates; each update moves it to the device, applies, and moves it back. Frees the moments'
      device memory (2x the params for AdamW) for activations and the KV cache, at the cost of
      two host<->device copies per optimizer update (not per micro-step). Backends without a
      pinned_host memory refuse it when the train step is built.
    mu_dtype: the first moment's dtype (e.g. 'float32' beside bf16 params); None: the params'
      dtype (MaxText's default). Every state leaf keeps the dtype it was initialised with across
      updates (`learner.train_step`), whatever the update computes it in.
    param_rounding: how an update's float32 result becomes the params' dtype: 'stochastic'
      (unbiased: rounds up with probability equal to the distance from the lower neighbour, in
      ulps; `apply_updates_rounded`) or 'nearest' (a plain cast). For bf16 params at RL learning
      rates a step is far below half an ulp (lr 5e-7 against weights ~1e-2: ~1e-3 ulp), so nearest
      rounding drops almost every update (measured: 0.8 % of a tiny model's weights moved in 3
      updates, against 84 % in f32); stochastic rounding keeps the expected step. float32 params
      are unaffected either way.
    offload_accumulator: keep the gradient sums (float32, param-shaped) in host memory between
      micro-steps; each micro-step (and the update) moves them to the device and back. Frees
      their device memory (2x bf16 params) while the engine rolls out in 'pipelined' /
      'one_step_off' mode, where the sums of finished groups wait beside the KV cache, at the
      cost of two host<->device copies of them per micro-step. Pairs with
      TrainerConfig.swap_cache (the cache in host memory while a micro-step runs).
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    total_steps: int = 1000
    end_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    decay_matrices_only: bool = True
    state_shard_axis: str | None = "data"
    offload_state: bool = False
    offload_accumulator: bool = False
    mu_dtype: str | None = None
    param_rounding: str = "stochastic"

    def __post_init__(self):
        own = "OptimizerConfig"
        check_number(f"{own}.learning_rate", self.learning_rate, 0)
        check_int(f"{own}.warmup_steps", self.warmup_steps, 0)
        check_int(f"{own}.total_steps", self.total_steps, 1)
        check_number(f"{own}.end_lr_ratio", self.end_lr_ratio, 0, 1)
        for k in ("b1", "b2"):
            check_number(f"{own}.{k}", getattr(self, k), 0, 1, hi_open=True)
        check_number(f"{own}.eps", self.eps, 0)
        check_number(f"{own}.weight_decay", self.weight_decay, 0)
        check_number(f"{own}.max_grad_norm", self.max_grad_norm, 0, lo_open=True, optional=True)
        check_bool(f"{own}.decay_matrices_only", self.decay_matrices_only)
        check_str(f"{own}.state_shard_axis", self.state_shard_axis, optional=True)
        check_bool(f"{own}.offload_state", self.offload_state)
        check_bool(f"{own}.offload_accumulator", self.offload_accumulator)
        check_str(f"{own}.mu_dtype", self.mu_dtype, optional=True)
        if self.param_rounding not in PARAM_ROUNDINGS:
            raise ValueError(f"{own}.param_rounding={self.param_rounding!r}; valid: {list(PARAM_ROUNDINGS)}")
        if self.mu_dtype is not None:
            try:
                if not jnp.issubdtype(jnp.dtype(self.mu_dtype), jnp.floating):
                    raise TypeError
            except TypeError:
                raise ValueError(f"{own}.mu_dtype={self.mu_dtype!r} is not a float dtype (e.g. 'float32', "
                                 "'bfloat16'; None: the params' dtype)") from None


def _mix32(h):
    """murmur3's 32-bit finaliser: a bijection of uint32 whose output bits look independent."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hashed_bits(shape, seed):
    """uint32 draws, one per element of `shape`: the hashed element index and seed. Elementwise
    and counter-based (no key splitting, no buffer of draws): XLA fuses it into the rounding, so
    an update of a 9.6 GB expert stack holds no random array beside it (jax.random's did)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[d]
    return _mix32(index * jnp.uint32(0x9E3779B1) + _mix32(jnp.asarray(seed, jnp.uint32)))


def stochastic_round(x, dtype, seed):
    """x (float32) in `dtype`, rounded to one of its two neighbours there with probability
    proportional to closeness (E[result] = x). seed: an int or uint32 scalar (traced is fine);
    the draws are a hash of (element index, seed). Exact values, infinities and NaN come out as
    a cast gives them; float32 targets are x itself. Elementwise.
    bf16: the 16 low bits of x's float32 pattern plus 16 random bits carry into the kept half
    with probability low/2^16 (sign-magnitude, so |x| is rounded without bias); other 16-bit
    floats: between the neighbours found by nextafter."""
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    if dtype.itemsize >= 4:
        return x.astype(dtype)
    draws = _hashed_bits(x.shape, seed)
    if dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
        kept = (bits + (draws >> 16)) & jnp.uint32(0xFFFF0000)
        rounded = jax.lax.bitcast_convert_type(kept, jnp.float32).astype(dtype)   # exact: low half zero
        return jnp.where(jnp.isnan(x), x.astype(dtype), rounded)
    near = x.astype(dtype)
    near32 = near.astype(jnp.float32)
    lower = jnp.where(near32 <= x, near, jnp.nextafter(near, jnp.asarray(-jnp.inf, dtype)))
    upper = jnp.where(near32 >= x, near, jnp.nextafter(near, jnp.asarray(jnp.inf, dtype)))
    lo32, up32 = lower.astype(jnp.float32), upper.astype(jnp.float32)
    gap = jnp.where(up32 > lo32, up32 - lo32, 1.0)
    uniform = (draws >> 8).astype(jnp.float32) * (1.0 / (1 << 24))   # [0, 1)
    rounded = jnp.where(uniform < (x - lo32) / gap, upper, lower)
    return jnp.where(jnp.isfinite(x) & jnp.isfinite(up32), rounded, near)


def apply_updates_rounded(params, updates, seed, rounding: str = "stochastic"):
    """`optax.apply_updates` (params + updates, in each param's dtype) with the sum formed in
    float32 and rounded to the param's dtype by `rounding` ('stochastic': `stochastic_round`,
    leaf i with seed mixed from (seed, i); 'nearest': a cast, what optax does). seed: an int32
    or uint32 scalar (the update count)."""
    leaves, treedef = jax.tree.flatten(params)
    ups = treedef.flatten_up_to(updates)
    base = _mix32(jnp.asarray(seed).astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x5EED))
    out = []
    for i, (p, u) in enumerate(zip(leaves, ups)):
        total = p.astype(jnp.float32) + u.astype(jnp.float32)
        out.append(stochastic_round(total, p.dtype, base + jnp.uint32(i * 0x632BE5AB & 0xFFFFFFFF))
                   if rounding == "stochastic" else total.astype(p.dtype))
    return jax.tree.unflatten(treedef, out)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """The learning-rate schedule of `cfg`: linear warmup, then cosine decay (see `OptimizerConfig`).

    Args:
      cfg: the optimizer config (`learning_rate`, `warmup_steps`, `total_steps`, `end_lr_ratio`).
    Returns:
      `schedule(step) -> lr`: step (int array, applied updates) -> learning rate (float32, same shape).
    """
    peak = cfg.learning_rate
    end = peak * cfg.end_lr_ratio
    warm = cfg.warmup_steps
    decay_len = max(cfg.total_steps - warm, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm_lr = peak * jnp.minimum((step + 1.0) / max(warm, 1), 1.0)
        progress = jnp.clip((step - warm) / decay_len, 0.0, 1.0)
        cos_lr = end + (peak - end) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(step < warm, warm_lr, cos_lr)

    return schedule


def decays(path, leaf) -> bool:
    """Whether weight decay applies to the param at `path` (a key path into the params) under
    decay_matrices_only: matrices, not norm scales ('scale'), biases ('*bias', the experts'
    'b_gate' / 'b_up' / 'b_down') or sinks, as HF's Trainer and verl exclude norms and biases."""
    name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1]))) if path else ""
    vector = name == "scale" or name == "sinks" or name.endswith("bias") or name.startswith("b_")
    return getattr(leaf, "ndim", 0) >= 2 and not vector


def build_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm (optional) -> AdamW with the schedule.

    Args:
      cfg: the optimizer config. `max_grad_norm` None: no clipping; `decay_matrices_only`: weight decay masked to
        the weight matrices (`decays`); `mu_dtype`: the first moment's dtype.
    Returns:
      The optax transformation: `optax.adamw(learning_rate_schedule(cfg), ...)`, chained after
      `optax.clip_by_global_norm(cfg.max_grad_norm)` when that is set.
    """
    mask = (lambda params: jax.tree_util.tree_map_with_path(decays, params)) if cfg.decay_matrices_only else None
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=mask, mu_dtype=cfg.mu_dtype)
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)


def as_transformation(optimizer) -> tuple[optax.GradientTransformation, OptimizerConfig | None]:
    """(transformation, config or None) of an OptimizerConfig or an optax GradientTransformation."""
    if isinstance(optimizer, OptimizerConfig):
        return build_optimizer(optimizer), optimizer
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer, None
    raise TypeError(f"expected an OptimizerConfig or an optax.GradientTransformation, got "
                    f"{type(optimizer).__name__}")


def learning_rate_in_state(inner):
    """The learning rate an `optax.inject_hyperparams(...)` state holds (the first one found,
    outermost first), or None if the state exposes none."""
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    for node in jax.tree.leaves(inner, is_leaf=lambda x: isinstance(x, kinds)):
        if isinstance(node, kinds) and "learning_rate" in node.hyperparams:
            return jnp.asarray(node.hyperparams["learning_rate"], jnp.float32)
    return None


def with_memory_kind(shardings, kind: str):
    """`mesh.with_memory_kind` for the optimizer state (a missing kind names offload_state)."""
    return mesh_with_memory_kind(shardings, kind, "OptimizerConfig.offload_state")


def _with_extra_axis(sharding: NamedSharding, shape, axis: str | None) -> NamedSharding:
    """The param's sharding with `axis` added on the first unsharded dim it divides."""
    mesh = sharding.mesh
    if axis is None or axis not in mesh.shape or mesh.shape[axis] == 1:
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    used = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    if axis in used:
        return sharding
    for i, (dim, entry) in enumerate(zip(shape, spec)):
        if entry is None and dim % mesh.shape[axis] == 0:
            return NamedSharding(mesh, P(*spec[:i], axis, *spec[i + 1:]))
    return sharding


def opt_state_shardings(tx: optax.GradientTransformation, params: Any,
                        cfg: OptimizerConfig | None = None) -> OptState:
    """Shardings of `OptState(step, inner)` for params (arrays or ShapeDtypeStructs with .sharding).

    Param-shaped state (the moments) follows each param's sharding plus `cfg.state_shard_axis`;
    everything else (counts) is replicated. cfg None (a raw transformation): no extra axis, and a
    state leaf at a param's place but of another shape is replicated; if optax cannot locate the
    params in the state (`optax.tree_map_params`), leaves shaped like a param take that param's
    sharding and the rest is replicated.

    Args:
      tx: the optax transformation whose state is sharded (its `init` is traced abstractly, nothing is allocated).
      params: the params pytree: `jax.Array`s or `jax.ShapeDtypeStruct`s, each with a `NamedSharding`.
      cfg: the optimizer config that built `tx`, or None for a raw transformation. With `cfg.offload_state`
        the shardings are in host memory (`memory_kind='pinned_host'`).
    Returns:
      An `OptState` of `NamedSharding`s, shaped like the state `tx.init(params)` wrapped in `OptState`; `step`
      replicated.
    Raises:
      ValueError: when the params are not arrays with a `NamedSharding`.
    """
    leaves = jax.tree.leaves(params)
    if not leaves or not isinstance(getattr(leaves[0], "sharding", None), NamedSharding):
        raise ValueError("opt_state_shardings: params must be jax.Arrays with a NamedSharding")
    mesh = leaves[0].sharding.mesh
    replicated = NamedSharding(mesh, P())
    param_sh = jax.tree.map(lambda p: p.sharding, params)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    abstract = jax.eval_shape(tx.init, shapes)
    if cfg is not None:
        inner = optax.tree_map_params(
            tx,
            lambda leaf, sh: _with_extra_axis(sh, leaf.shape, cfg.state_shard_axis),
            abstract,
            param_sh,
            transform_non_params=lambda _: replicated,
        )
        shardings = OptState(step=replicated, inner=inner)
        return with_memory_kind(shardings, HOST_MEMORY) if cfg.offload_state else shardings
    try:
        inner = optax.tree_map_params(
            tx,
            lambda leaf, sh, p: sh if tuple(leaf.shape) == tuple(p.shape) else replicated,
            abstract,
            param_sh,
            shapes,
            transform_non_params=lambda _: replicated,
        )
    except Exception:  # a state optax cannot map over: match by shape
        by_shape = {}
        for p, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(param_sh)):
            by_shape.setdefault(tuple(p.shape), sh)
        inner = jax.tree.map(lambda leaf: by_shape.get(tuple(leaf.shape), replicated)
                             if getattr(leaf, "ndim", 0) > 0 else replicated, abstract)
    return OptState(step=replicated, inner=inner)
