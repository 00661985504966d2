"""LoRA adapters as a value: `LoraConfig`, `init_adapter`, `with_adapter`, on the one sharded mesh.

An adapter is a pytree (`LoraAdapter`) of low-rank pairs, one per adapted weight, laid out like
the params (stacked layers on a leading dim) and sharded like the weights they adapt: a keeps the
base's input dims' sharding, b its output dims', the rank dim is replicated; the experts' pairs
are stacks [layers, experts, in, r] / [layers, experts, r, out] split over `expert` as the
experts are. `with_adapter(params, adapter)` is a view of the params in which every adapted leaf
is a `LoraWeight(base, a, b)` holding the same base buffer: built inside the jitted train step or
engine step, it copies nothing, so the base weights stay where they are and train and generate
still take the one param pytree (the adapter beside it).

Targets are named as PEFT's `target_modules` name them for the families `load_hf` reads:
attention `q_proj`, `k_proj`, `v_proj`, `o_proj` (latent attention: `q_proj` or `q_a_proj` /
`q_b_proj`, `kv_a_proj`, `o_proj`), the dense MLP's (and a MoE's shared expert's) `gate_proj`,
`up_proj`, `down_proj`, the experts' stacks `experts.gate_proj`, `experts.up_proj`,
`experts.down_proj` (each expert its own pair), and the MoE `router`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sfrrl_jax.checks import check_bool, check_int, check_number
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import sharding_for
from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.models.lora_weight import LoraWeight, adapted_axes

# target name -> the weights it adapts inside a block: (path in the block, n_in, n_batch); a
# target adapts whichever of its paths a layer has (a MoE model's dense layers have `mlp`).
TARGETS: dict[str, tuple[tuple[tuple[str, ...], int, int], ...]] = {
    "q_proj": ((("attn", "q_proj"), 1, 0),),
    "k_proj": ((("attn", "k_proj"), 1, 0),),
    "v_proj": ((("attn", "v_proj"), 1, 0),),
    "o_proj": ((("attn", "o_proj"), 2, 0),),
    "q_a_proj": ((("attn", "q_a_proj"), 1, 0),),
    "q_b_proj": ((("attn", "q_b_proj"), 1, 0),),
    "kv_a_proj": ((("attn", "kv_a_proj"), 1, 0),),
    "gate_proj": ((("mlp", "w_gate"), 1, 0), (("shared_expert", "w_gate"), 1, 0)),
    "up_proj": ((("mlp", "w_up"), 1, 0), (("shared_expert", "w_up"), 1, 0)),
    "down_proj": ((("mlp", "w_down"), 1, 0), (("shared_expert", "w_down"), 1, 0)),
    "experts.gate_proj": ((("moe", "w_gate"), 1, 1),),
    "experts.up_proj": ((("moe", "w_up"), 1, 1),),
    "experts.down_proj": ((("moe", "w_down"), 1, 1),),
    "router": ((("moe", "router"), 1, 0),),
}
# Named so a researcher's list can be refused with the reason: latent attention's k_b / v_b are
# absorbed into the query and the output in the engine (models.mla), never multiplied as weights.
_NOT_ADAPTABLE = {
    "kv_b_proj": "latent attention's kv_b_proj is absorbed into the query and output in the engine "
                 "(models.mla); adapt q_proj / q_a_proj / q_b_proj, kv_a_proj or o_proj instead",
    "embed_tokens": "LoRA on the embedding is not built",
    "lm_head": "LoRA on the LM head is not built",
}
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
EXPERT_TARGETS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which weights get a low-rank adapter, and its size.

    Attributes:
      rank: r, the adapters' inner width.
      alpha: the scale's numerator: each adapted weight acts as W + (alpha / r) A B (alpha / sqrt(r)
        with `use_rslora`), as PEFT's `lora_alpha`.
      dropout: PEFT's `lora_dropout`, kept for the record and for export; only 0 is trained here
        (the train step refuses more: an RL step's forward must be the one the engine sampled from).
      targets: the weights to adapt (`TARGETS`' names: "q_proj", ..., "experts.gate_proj", "router");
        default the four attention projections.
      use_rslora: rank-stabilised LoRA's scale alpha / sqrt(r).
      dtype: the adapters' storage dtype (float32: they are what is trained).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ATTENTION_TARGETS
    use_rslora: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        check_int("LoraConfig.rank", self.rank, 1)
        check_number("LoraConfig.alpha", self.alpha, 0, lo_open=True)
        check_number("LoraConfig.dropout", self.dropout, 0, 1, hi_open=True)
        check_bool("LoraConfig.use_rslora", self.use_rslora)
        if isinstance(self.targets, str) or not all(isinstance(t, str) for t in self.targets):
            raise ValueError(f"LoraConfig.targets must be a list of target names, got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ValueError("LoraConfig.targets is empty: name the weights to adapt, e.g. ('q_proj', 'v_proj')")
        for t in self.targets:
            if t in _NOT_ADAPTABLE:
                raise ValueError(f"LoraConfig.targets: {t!r}: {_NOT_ADAPTABLE[t]}")
            if t not in TARGETS:
                raise ValueError(f"LoraConfig.targets: unknown target {t!r}; known: {sorted(TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoraConfig.targets names a target twice: {self.targets!r}")
        if jnp.dtype(self.dtype).kind != "f":
            raise ValueError(f"LoraConfig.dtype must be a float dtype, got {self.dtype!r}")

    @property
    def scale(self) -> float:
        """The factor on A B: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def check_trainable(lora_cfg: LoraConfig) -> None:
    """Raises ValueError naming `LoraConfig.dropout` when it is not 0: the train step runs the
    forward the engine sampled from (an RL ratio of exactly 1 on-policy), so it applies no dropout;
    an adapter loaded with PEFT's lora_dropout trains after `dataclasses.replace(cfg, dropout=0.0)`."""
    if lora_cfg.dropout:
        raise ValueError(f"LoraConfig.dropout={lora_cfg.dropout}: training with LoRA dropout is not built (the train "
                         "forward must be the one the engine sampled from); set dropout=0.0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """The trained pytree of a LoRA run: the low-rank pairs and (static) the config that made them.

    Attributes:
      weights: nested dict laid out like the params, one `{"a": ..., "b": ...}` per adapted leaf,
        e.g. `weights["layers"]["attn"]["q_proj"]["a"]` `[layers, embed, rank]` and `["b"]`
        `[layers, rank, heads, head_dim]`; the experts' `weights["layers"]["moe"]["w_gate"]["a"]`
        `[layers, experts, embed, rank]`.
      config: the `LoraConfig` (static: not a leaf; jit recompiles for another).
    """

    weights: dict
    config: LoraConfig = dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class AdaptedLeaf:
    """One weight an adapter adapts: where it is in the params, and how it multiplies."""

    path: tuple[str, ...]        # in the params, e.g. ("layers", "attn", "q_proj")
    target: str                  # the LoraConfig target naming it
    n_in: int                    # base dims (after the batch dims) contracted with the input
    n_batch: int                 # per-slice dims (1: the experts)
    base_axes: tuple             # the base's logical axes, stacked-layer dim first
    base_shape: tuple[int, ...]  # the base's shape


def _leaves_of(cfg: ModelConfig, target: str) -> list[AdaptedLeaf]:
    """The weights one target names in a model of `cfg` (none where the model lacks them)."""
    # adapters keep the stacked layout ([layers, ...]) whatever cfg.scan_layers says: they are small,
    # and a per-layer view takes its rows (`with_adapter`)
    axes, shapes = tfm.stacked_param_logical_axes(cfg), tfm.stacked_param_shapes(cfg)
    out = []
    for stack, _ in tfm.layer_stacks(cfg):
        for rel, n_in, n_batch in TARGETS[target]:
            node_axes, node_shape = axes.get(stack, {}), shapes.get(stack, {})
            for key in rel:
                node_axes, node_shape = node_axes.get(key, {}), node_shape.get(key, {})
            if isinstance(node_axes, tuple):
                out.append(AdaptedLeaf((stack,) + rel, target, n_in, n_batch, node_axes, tuple(node_shape.shape)))
    return out


def adapted_leaves(cfg: ModelConfig, lora_cfg: LoraConfig) -> tuple[AdaptedLeaf, ...]:
    """The weights `lora_cfg` adapts in a model of `cfg`, in a fixed order.

    Raises:
      ValueError: naming a target that adapts nothing in this model (e.g. `experts.gate_proj` on a
        dense model), and the targets the model has.
    """
    per_target = {t: _leaves_of(cfg, t) for t in lora_cfg.targets}
    missing = [t for t, leaves in per_target.items() if not leaves]
    if missing:
        have = sorted(t for t in TARGETS if adapted_leaves_hit(cfg, t))
        raise ValueError(f"LoraConfig.targets {missing} adapt no weight of this {cfg.family} model; "
                         f"its adaptable targets: {have}")
    return tuple(leaf for leaves in per_target.values() for leaf in leaves)


def adapted_leaves_hit(cfg: ModelConfig, target: str) -> bool:
    """Whether `target` names a weight of a model of `cfg`."""
    return bool(_leaves_of(cfg, target))


def _pair_shapes(leaf: AdaptedLeaf, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    cut = 1 + leaf.n_batch + leaf.n_in    # the stacked-layer dim, the batch dims, the input dims
    s = leaf.base_shape
    return s[:cut] + (rank,), s[:1 + leaf.n_batch] + (rank,) + s[cut:]


def adapter_logical_axes(cfg: ModelConfig, lora_cfg: LoraConfig) -> dict:
    """The adapter's weights' logical axes (`LoraAdapter.weights` layout): a keeps the base's input
    dims' names, b its output dims', the rank dim is None."""
    def pair(leaf):
        a, b = adapted_axes(leaf.base_axes, leaf.n_in, leaf.n_batch, lead=1)
        return {"a": a, "b": b}
    return tfm.unflatten_paths({leaf.path: pair(leaf) for leaf in adapted_leaves(cfg, lora_cfg)})


def adapter_shapes(cfg: ModelConfig, lora_cfg: LoraConfig) -> dict:
    """The adapter's weights as `jax.ShapeDtypeStruct`s (`LoraAdapter.weights` layout)."""
    dt = jnp.dtype(lora_cfg.dtype)

    def pair(leaf):
        a, b = _pair_shapes(leaf, lora_cfg.rank)
        return {"a": jax.ShapeDtypeStruct(a, dt), "b": jax.ShapeDtypeStruct(b, dt)}
    return tfm.unflatten_paths({leaf.path: pair(leaf) for leaf in adapted_leaves(cfg, lora_cfg)})


def adapter_shardings(cfg: ModelConfig, lora_cfg: LoraConfig, mesh: Mesh) -> dict:
    """The adapter's weights' `NamedSharding`s on `mesh`.

    Args:
      cfg: the model config.
      lora_cfg: which weights are adapted, and the rank.
      mesh: the params' mesh.
    Returns:
      A nested dict laid out as `LoraAdapter.weights`, each leaf a `NamedSharding` (a: the base's input dims'
      sharding, b: its output dims', the rank dim replicated).
    """
    axes, shapes = adapter_logical_axes(cfg, lora_cfg), adapter_shapes(cfg, lora_cfg)
    return jax.tree.map(lambda a, s: sharding_for(mesh, a, s.shape), axes, shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def init_adapter(cfg: ModelConfig, lora_cfg: LoraConfig, mesh: Mesh, seed: int = 0) -> LoraAdapter:
    """A fresh adapter, created in its shardings: every A uniform in +-1/sqrt(fan_in) (PEFT's
    default, Kaiming-uniform with a = sqrt(5)), every B zero, so the adapted model starts as the base.

    Args:
      cfg: the model config.
      lora_cfg: which weights to adapt, rank, alpha.
      mesh: the params' mesh (expert pairs are split over its `expert` axis, as the experts).
      seed: the PRNG seed of the A draws.
    Returns:
      A `LoraAdapter` (`LoraAdapter.weights` laid out as `adapter_shapes(cfg, lora_cfg)`).
    Raises:
      ValueError: for a target that adapts nothing in this model.
    """
    leaves = adapted_leaves(cfg, lora_cfg)
    dt = jnp.dtype(lora_cfg.dtype)

    def make(key):
        keys = jax.random.split(key, max(len(leaves), 1))
        items = []
        for leaf, k in zip(leaves, keys):
            a_shape, b_shape = _pair_shapes(leaf, lora_cfg.rank)
            bound = 1.0 / math.sqrt(math.prod(a_shape[1 + leaf.n_batch:-1]))
            a = jax.random.uniform(k, a_shape, jnp.float32, -bound, bound).astype(dt)
            items.append((leaf.path, {"a": a, "b": jnp.zeros(b_shape, dt)}))
        return tfm.unflatten_paths(dict(items))

    with jax.set_mesh(mesh):
        weights = jax.jit(make, out_shardings=adapter_shardings(cfg, lora_cfg, mesh))(jax.random.key(seed))
    return LoraAdapter(weights, lora_cfg)


def check_adapter(cfg: ModelConfig, adapter: LoraAdapter) -> None:
    """Raises a ValueError naming the leaf when `adapter`'s pairs do not have the shapes its config
    gives for a model of `cfg` (an adapter of another model, or another rank)."""
    if not isinstance(adapter, LoraAdapter):
        raise TypeError(f"adapter must be a LoraAdapter (S.init_adapter / S.load_adapter), got {type(adapter).__name__}")
    want = adapter_shapes(cfg, adapter.config)
    flat_want = dict(_flat(want))
    flat_have = dict(_flat(adapter.weights))
    if set(flat_want) != set(flat_have):
        extra, missing = sorted(set(flat_have) - set(flat_want)), sorted(set(flat_want) - set(flat_have))
        raise ValueError(f"adapter does not fit this model and LoraConfig: unexpected {['/'.join(p) for p in extra]}, "
                         f"missing {['/'.join(p) for p in missing]}")
    for path, spec in flat_want.items():
        have = tuple(flat_have[path].shape)
        if have != tuple(spec.shape):
            raise ValueError(f"adapter leaf {'/'.join(path)} has shape {have}; this model with rank "
                             f"{adapter.config.rank} needs {tuple(spec.shape)}")


def _flat(tree: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def with_adapter(cfg: ModelConfig, params: dict, adapter: LoraAdapter | None) -> dict:
    """A view of `params` with every adapted leaf a `LoraWeight(base, a, b)` (the base the same
    buffer): the model's matmuls then apply the adapter unmerged. Inside jit it moves no data.

    Args:
      cfg: the model config.
      params: the base params (`transformer.Params`).
      adapter: a `LoraAdapter` for this model, or None (then `params` itself is returned).
    Returns:
      A nested dict like `params`; only the dicts on the adapted leaves' paths are new.
    """
    if adapter is None:
        return params
    out = dict(params)
    per_layer = tfm.is_per_layer(params)
    for leaf in adapted_leaves(cfg, adapter.config):
        pair = adapter.weights
        for key in leaf.path:
            pair = pair[key]
        if not per_layer:
            _set_path(out, params, leaf.path, LoraWeight(_get_path(params, leaf.path), pair["a"], pair["b"],
                                                         adapter.config.scale, leaf.n_in, leaf.n_batch))
            continue
        # per-layer params (cfg.scan_layers=False): each layer's weight with its rows of the
        # stacked adapter (a small slice each)
        stack, rest = leaf.path[0], leaf.path[1:]
        if out[stack] is params[stack]:
            out[stack] = list(params[stack])
        for row, layer_params in enumerate(params[stack]):
            if out[stack][row] is layer_params:
                out[stack][row] = dict(layer_params)
            _set_path(out[stack][row], layer_params, rest,
                      LoraWeight(_get_path(layer_params, rest), pair["a"][row], pair["b"][row], adapter.config.scale,
                                 leaf.n_in, leaf.n_batch))
    return out


def _get_path(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set_path(out: dict, src: dict, path: tuple[str, ...], value) -> None:
    """out[path] = value, copying each dict on the path that `out` still shares with `src`."""
    node = out
    for key in path[:-1]:
        src = src[key]
        node[key] = dict(src) if node[key] is src else node[key]
        node = node[key]
    node[path[-1]] = value


def merge_adapter(cfg: ModelConfig, params: dict, adapter: LoraAdapter) -> dict:
    """Params with the adapter folded in (W + s A B per adapted leaf, in the base's dtype): a new
    pytree for export or for serving elsewhere; training and the engine use `with_adapter`.

    Args:
      cfg: the model config.
      params: the base params.
      adapter: a `LoraAdapter` for this model.
    Returns:
      Params laid out as `params`, the adapted leaves replaced by their merged values.
    """
    check_adapter(cfg, adapter)
    view = with_adapter(cfg, params, adapter)
    return jax.tree.map(lambda w: w.merged() if isinstance(w, LoraWeight) else w, view,
                        is_leaf=lambda w: isinstance(w, LoraWeight))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptedParams:
    """Base params and the adapter trained on top of them: the one pytree a LoRA run hands to the
    train step, the trainer and the engine (`RLTrainer(cfg, AdaptedParams(params, adapter), ...)`).
    The train step differentiates and updates `adapter` only (gradient sums and optimizer state are
    adapter-sized); every model entry point reads it as `with_adapter(cfg, base, adapter)`, so the
    base arrays are read in place, never copied, merged or donated.

    Attributes:
      base: the frozen base params (`transformer.Params`, sharded as `init_params` / `load_hf` give them).
      adapter: the `LoraAdapter`.
    """

    base: dict
    adapter: LoraAdapter


def model_view(cfg: ModelConfig, params) -> dict:
    """What the model multiplies with: `with_adapter(cfg, base, adapter)` for `AdaptedParams`,
    plain params as they are (inside jit: no data moves)."""
    if isinstance(params, AdaptedParams):
        return with_adapter(cfg, params.base, params.adapter)
    return params


def trained_part(params):
    """The pytree a train step differentiates and updates: the adapter of `AdaptedParams`, else
    the params themselves."""
    return params.adapter if isinstance(params, AdaptedParams) else params


def frozen_part(params):
    """The pytree a train step reads but never updates: the base of `AdaptedParams`, else None."""
    return params.base if isinstance(params, AdaptedParams) else None


def join_parts(trained, frozen):
    """The inverse of (`trained_part`, `frozen_part`)."""
    return trained if frozen is None else AdaptedParams(frozen, trained)
