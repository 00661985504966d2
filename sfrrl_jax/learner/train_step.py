"""The train step: exact gradient accumulation over micro-batches, then one optimizer update.

    ts = make_train_step(model_cfg, loss, optimizer)   # loss: rl.Loss | LossConfig;
                                                       # optimizer: optax transformation | OptimizerConfig
    opt_state = ts.init_opt_state(params)        # OptState(step, inner)
    acc = ts.init_accumulator(params)            # Accumulator(grads, scalars, sums, maxes, mins)
    for mb in microbatches:                      # any split of the batch
        acc = ts.grad_microstep(params, acc, mb)  # acc donated
    params, opt_state, metrics = ts.apply(params, opt_state, acc)  # params/opt_state donated
    # rows whose advantages are all 0, under a loss declaring `zero_advantage_zero_gradient` (and
    # router loss coefficients 0): their gradient is exactly 0, so forward only
    #   acc = ts.stats_microstep(params, acc, mb)  # loss, counts, metrics; grads untouched
    # or, for a batch that fits at once:  params, opt_state, metrics = ts.step(params, opt_state, batch)
    # samples trained before their group's advantages exist (a loss linear in the advantages,
    # e.g. behavior='current'; `learner.deferred`):
    #   buf = ts.deferred_microstep(params, ts.init_deferred(params), row, reward - reference_reward)
    #   acc = ts.merge_deferred(params, acc, buf, advantage_slope, reference_advantage)

The loss is a value (`sfrrl_jax.rl.Loss`; a `LossConfig` maps to its built-in through
`rl.loss_from_config`): a new loss needs no edit here. The optimizer is an optax
`GradientTransformation` or an `OptimizerConfig` (built by `learner.optimizer.build_optimizer`).

Gradients accumulate as *sums* (float32) together with the loss normaliser (loss tokens or
sequences, per the aggregation); `apply` divides once, so every split of a batch into
micro-batches yields the full-batch gradient. Params keep their sharding through the update
(generation reads the same arrays); optimizer moments may be split further over `data`
(OptimizerConfig.state_shard_axis); a raw transformation's param-shaped state is sharded like
the params and the rest replicated.
A non-finite gradient (or loss) skips the update: params and optimizer state come back unchanged
and `metrics['update_skipped']` is 1.

A micro-batch is a `rl.MicroBatch` (`sfrrl_jax.rl.microbatch`), a pytree of [rows, width] arrays
(see `objective.py` for the shift): tokens (int), loss_mask, and the fields the loss declares; for
the built-in policy loss: advantages ([rows, width], or [rows] for unpacked rows), rollout_logprobs,
old_logprobs (behavior='old'), ref_logprobs (kl_coef > 0); segment_ids, positions (optional, packed
rows; 0 = padding); a custom loss's own fields in `MicroBatch.extras`. The public methods also take
a mapping of field name -> array (`rl.as_microbatch` turns it into a MicroBatch at the edge).
`validate_microbatch` checks it against the loss, then fields the loss and forward do not read are
dropped (`MicroBatch.select`) before the jit.
Host numpy inputs are placed batch-sharded on the params' mesh. Multi-host: pass global
`jax.Array`s (e.g. from `jax.make_array_from_process_local_data`, `learner.process_rows`).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.models.api import mesh_of
from sfrrl_jax.models.lora import (AdaptedParams, check_adapter, check_trainable, frozen_part, join_parts, model_view,
                                   trained_part)
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.aggregation import SequenceLayout
from sfrrl_jax.rl.loss_fn import Loss, LossInputs, as_loss
from sfrrl_jax.rl.losses import ObjectiveParts, finalize_metrics
# validate_microbatch lives beside MicroBatch; re-exported here (`learner.validate_microbatch`)
from sfrrl_jax.rl.microbatch import MicroBatch, as_microbatch, validate_microbatch
from sfrrl_jax.learner.accumulator import (
    AccStats, Accumulator, accumulate, accumulate_stats, accumulator_shardings, zero_accumulator,
)
from sfrrl_jax.learner.deferred import DeferredBuffer, build_deferred_fns
from sfrrl_jax.learner.objective import ROUTER_METRICS, ForwardFn, microbatch_objective
from sfrrl_jax.mesh import moved, with_memory_kind as mesh_with_memory_kind
from sfrrl_jax.learner.optimizer import (
    HOST_MEMORY, OptimizerConfig, OptState, apply_updates_rounded, as_opt_state, as_transformation,
    learning_rate_in_state, learning_rate_schedule, opt_state_shardings, with_memory_kind,
)

if TYPE_CHECKING:
    from sfrrl_jax.config import ModelConfig


def _metric_template(loss: Loss):
    """Abstract (sums, maxes, mins) the loss produces, every declared field present (keys are static)."""
    def dummy():
        z = jnp.zeros((1, 2), jnp.float32)
        parts = loss.fn(LossInputs(z, z, z, SequenceLayout((1, 2)), {k: z for k in loss.input_fields}))
        if not isinstance(parts, ObjectiveParts):
            raise TypeError(f"Loss {loss.name!r}: fn must return rl.losses.ObjectiveParts, got "
                            f"{type(parts).__name__}")
        return parts.sums, parts.maxes, parts.mins
    return jax.eval_shape(dummy)


def _key(tree):
    return jax.tree.structure(tree), tuple(x.sharding for x in jax.tree.leaves(tree))


class TrainStep:
    """Jitted train functions for one (forward, loss, optimizer) triple; see the module doc.

    loss: a `sfrrl_jax.rl.Loss` (or a `LossConfig`, mapped by `rl.loss_from_config`).
    optimizer: an optax `GradientTransformation`, or an `OptimizerConfig` (AdamW + schedule +
      clipping via `build_optimizer`; `state_shard_axis` splits the moments further).
    metrics['learning_rate']: the config's schedule at the state's applied-update count; with a
      raw transformation, the learning rate its state exposes through `optax.inject_hyperparams`
      (the value this update used), else the metric is absent.
    router_coefs: (aux, z) coefficients of the forward's router losses (`make_train_step` takes
      them from the loss, else from the model config).
    aux_metrics: further scalars of the forward's aux reported as metrics (denominator-weighted
      over micro-batches, like the router losses): under routing replay the agreement metrics.

    Attributes: loss (Loss), loss_cfg (the LossConfig behind a built-in loss, else None), tx
    (the transformation), optimizer_cfg / schedule (None for a raw transformation).
    The jitted functions are built once per params layout (tree structure + shardings) and traced
    once per batch shape; `jitted_*` expose them for AOT lowering (`.lower(...).compile()`).
    """

    def __init__(self, forward_fn: ForwardFn, loss: Loss | LossConfig,
                 optimizer: optax.GradientTransformation | OptimizerConfig,
                 router_coefs: tuple[float, float] = (0.0, 0.0), vocab_size: int | None = None,
                 aux_metrics: tuple[str, ...] = ()):
        self.forward_fn = forward_fn
        # scalars of the forward's aux averaged into the metrics besides the router losses
        self.aux_metrics = tuple(aux_metrics)
        self.loss = as_loss(loss)
        self.loss_cfg = self.loss.config
        self.tx, self.optimizer_cfg = as_transformation(optimizer)
        self.schedule = None if self.optimizer_cfg is None else learning_rate_schedule(self.optimizer_cfg)
        self.router_coefs = tuple(float(c) for c in router_coefs)
        self.vocab_size = vocab_size
        self._template = _metric_template(self.loss)
        self._cache: dict = {}
        self._layouts: dict = {}         # per params layout: accumulator shardings, raw init
        self._deferred_cache: dict = {}  # per params layout: `learner.deferred` functions

    # -- state -----------------------------------------------------------------------------------
    def init_accumulator(self, params) -> Accumulator:
        """Zero gradient sums (float32, sharded like the params) and zero counts/metric sums;
        with OptimizerConfig.offload_accumulator the sums are in host memory."""
        return self._acc_out(params, self._fns(params)["init_acc"](trained_part(params)))

    @property
    def offloads_accumulator(self) -> bool:
        """Whether the gradient sums live in host memory between calls (offload_accumulator)."""
        return bool(self.optimizer_cfg is not None and self.optimizer_cfg.offload_accumulator)

    def _acc_in(self, params, acc: Accumulator, donated: bool = True) -> Accumulator:
        """acc with its gradient sums on the devices (offload_accumulator: moved in; the host copy
        deleted where the call donates acc)."""
        if not self.offloads_accumulator:
            return acc
        return acc._replace(grads=moved(acc.grads, self._layouts[_key(params)]["acc"].grads, donated))

    def _acc_out(self, params, acc: Accumulator) -> Accumulator:
        """acc with its gradient sums in host memory (offload_accumulator: moved out)."""
        if not self.offloads_accumulator:
            return acc
        return acc._replace(grads=moved(acc.grads, self._layouts[_key(params)]["acc_host"]))

    def init_opt_state(self, params) -> OptState:
        """OptState(step=0, inner=tx.init(params)); param-shaped state sharded per the module doc."""
        return self._fns(params)["init_opt"](trained_part(params))

    def opt_state_shardings(self, params) -> OptState:
        """Shardings of this step's OptState for params (arrays or ShapeDtypeStructs with .sharding)."""
        return opt_state_shardings(self.tx, trained_part(params), self.optimizer_cfg)

    def abstract_opt_state(self, params) -> OptState:
        """ShapeDtypeStructs (with shardings) of `init_opt_state(params)`: a restore target."""
        shapes = OptState(step=jax.ShapeDtypeStruct((), np.int32),
                          inner=jax.eval_shape(self.tx.init, trained_part(params)))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.opt_state_shardings(params))

    # -- steps -----------------------------------------------------------------------------------
    def grad_microstep(self, params, acc: Accumulator, microbatch: MicroBatch | Mapping[str, Any]) -> Accumulator:
        """Adds one micro-batch's gradient sum, loss numerator and counts to `acc` (donated).

        `microbatch`: a `rl.MicroBatch` ([rows, width] fields; module doc), or a mapping of field
        name -> array (`rl.as_microbatch`); checked by `validate_microbatch` (raises naming the field)."""
        fns = self._fns(params)
        mb = self._prepare(params, microbatch)
        with jax.set_mesh(mesh_of(params)):
            return self._acc_out(params, fns["micro"](trained_part(params), frozen_part(params),
                                                      self._acc_in(params, acc), mb))

    def stats_microstep(self, params, acc: Accumulator, microbatch: MicroBatch | Mapping[str, Any]) -> Accumulator:
        """`grad_microstep` without the backward pass: adds the micro-batch's loss numerator,
        denominator, counts (num_microbatches included) and metric sums / maxima / minima to `acc`
        exactly as `grad_microstep` would, and leaves the gradient sums as they are (not copied, not
        moved: with offload_accumulator they stay in host memory). `acc`'s stats are donated.

        For micro-batches whose gradient is exactly 0: rows whose advantages are all 0, under a loss
        declaring `Loss.zero_advantage_zero_gradient` and router loss coefficients 0
        (`forward_only_refusal` says why not, else None). The caller vouches for the advantages;
        this checks the loss and the coefficients, and raises ValueError naming what refuses.
        """
        refusal = self.forward_only_refusal()
        if refusal is not None:
            raise ValueError(f"stats_microstep (a forward-only micro-step) refused: {refusal}")
        fns = self._fns(params)
        mb = self._prepare(params, microbatch)
        with jax.set_mesh(mesh_of(params)):
            return acc.with_stats(fns["stats"](trained_part(params), frozen_part(params), acc.stats, mb))

    def forward_only_refusal(self) -> str | None:
        """Why rows whose advantages are all 0 still need their backward pass with this step (a
        sentence), or None when `stats_microstep` may stand in for `grad_microstep` on them: the
        loss declares `zero_advantage_zero_gradient` and both router loss coefficients are 0."""
        if not self.loss.zero_advantage_zero_gradient:
            return (f"the loss {self.loss.name!r} does not declare Loss.zero_advantage_zero_gradient (a row "
                    "whose advantages are all 0 may still have a gradient: KL or entropy terms "
                    "(LossConfig.kl_coef / entropy_coef > 0), an SFT or custom objective)")
        coefs = dict(zip(("router_aux_coef", "router_z_coef"), self.router_coefs))
        nonzero = {k: v for k, v in coefs.items() if v != 0.0}
        if nonzero:
            return (f"router loss coefficients {nonzero} are not 0: the router losses have a gradient "
                    "whatever the advantages")
        return None

    @property
    def zero_advantage_forward_only(self) -> bool:
        """Whether `stats_microstep` may train rows whose advantages are all 0 (no refusal)."""
        return self.forward_only_refusal() is None

    def apply(self, params, opt_state: OptState, acc: Accumulator):
        """One optimizer update from the accumulated sums -> (params, opt_state, metrics). With
        `AdaptedParams` only the adapter is updated (and donated); the base comes back as it was."""
        fns = self._fns(params)
        with jax.set_mesh(mesh_of(params)):
            new, opt_state, metrics = fns["apply"](trained_part(params), as_opt_state(opt_state),
                                                   self._acc_in(params, acc, donated=False))
        return join_parts(new, frozen_part(params)), opt_state, metrics

    def step(self, params, opt_state: OptState, batch: MicroBatch | Mapping[str, Any]):
        """grad_microstep on the whole batch (a `rl.MicroBatch` or a mapping, as `grad_microstep`
        takes) + apply, fused into one jitted function."""
        fns = self._fns(params)
        mb = self._prepare(params, batch)
        with jax.set_mesh(mesh_of(params)):
            new, opt_state, metrics = fns["step"](trained_part(params), frozen_part(params), as_opt_state(opt_state), mb)
        return join_parts(new, frozen_part(params)), opt_state, metrics

    # -- advantage-deferred gradients (see `learner.deferred`) -----------------------------------
    def init_deferred(self, params) -> DeferredBuffer:
        """A zero group buffer for trajectories back-propagated before their group finishes."""
        return self._deferred(params)["init"](trained_part(params))

    def deferred_microstep(self, params, buffer: DeferredBuffer, microbatch: MicroBatch | Mapping[str, Any],
                           centred_reward: float) -> DeferredBuffer:
        """Adds rows that share one reward (minus the group's reference reward) to `buffer` (donated)."""
        fns = self._deferred(params)
        mb = self._prepare(params, microbatch)
        with jax.set_mesh(mesh_of(params)):
            return fns["micro"](trained_part(params), frozen_part(params), buffer, mb, np.float32(centred_reward))

    def merge_deferred(self, params, acc: Accumulator, buffer: DeferredBuffer, slope: float,
                       reference_advantage: float) -> Accumulator:
        """acc (donated) + the group buffer's gradient at its final advantages -> acc."""
        fns = self._deferred(params)
        with jax.set_mesh(mesh_of(params)):
            merged = fns["merge"](self._acc_in(params, acc), buffer, np.float32(slope), np.float32(reference_advantage))
            return self._acc_out(params, merged)

    def compile_count(self) -> int:
        """Compiled executables of every jitted train function so far."""
        return sum(f._cache_size() for cache in (self._cache, self._deferred_cache)
                   for fns in cache.values() for f in fns.values())

    def _deferred(self, params) -> dict:
        key = _key(params)
        if key not in self._deferred_cache:
            self._fns(params)  # the accumulator layout
            layout = self._layouts[key]
            self._deferred_cache[key] = build_deferred_fns(
                self.forward_fn, self.loss, self.router_coefs, layout["acc"], layout["init_acc"],
                aux_metrics=self.aux_metrics, join=join_parts)
        return self._deferred_cache[key]

    def jitted_microstep(self, params):
        return self._fns(params)["micro"]

    def jitted_stats_microstep(self, params):
        """The jitted forward-only function: (params, AccStats (donated), micro-batch) -> AccStats."""
        return self._fns(params)["stats"]

    def jitted_apply(self, params):
        return self._fns(params)["apply"]

    def jitted_step(self, params):
        return self._fns(params)["step"]

    # -- internals -------------------------------------------------------------------------------
    def _prepare(self, params, batch: MicroBatch | Mapping[str, Any]) -> MicroBatch:
        """The checked micro-batch holding only the fields the loss and forward read, each on the
        params' mesh: a `jax.Array` already NamedSharding-placed there is kept, anything else is put
        batch-sharded (`batch_sharding`)."""
        batch = as_microbatch(batch)
        validate_microbatch(batch, self.loss, self.vocab_size)
        batch = batch.select(set(self.loss.fields) | set(self.loss.forward_fields))
        mesh = mesh_of(params)

        def place(v):
            if isinstance(v, jax.Array) and isinstance(v.sharding, NamedSharding) and v.sharding.mesh == mesh:
                return v
            return jax.device_put(np.asarray(v), batch_sharding(mesh, np.shape(v)))
        return jax.tree.map(place, batch)

    def _fns(self, params) -> dict:
        key = _key(params)
        if key not in self._cache:
            self._cache[key] = self._build(params)
        return self._cache[key]

    def _build(self, params) -> dict:
        # Every function below takes the trained pytree (`t`: the params, or an AdaptedParams'
        # adapter) and, where the forward runs, the frozen one (`f`: the base, or None): gradients,
        # their sums and the optimizer state exist for `t` only.
        if isinstance(params, AdaptedParams):
            check_trainable(params.adapter.config)
        mesh = mesh_of(params)
        rep = NamedSharding(mesh, P())
        param_sh = jax.tree.map(lambda p: p.sharding, trained_part(params))
        opt_sh = opt_state_shardings(self.tx, trained_part(params), self.optimizer_cfg)
        sums_t, maxes_t, mins_t = self._template
        sum_keys = list(sums_t) + list(ROUTER_METRICS) + list(self.aux_metrics)
        acc_sh = accumulator_shardings(param_sh, rep, sum_keys, list(maxes_t), list(mins_t))
        # where offloaded sums wait between calls (refused here, naming the switch, on devices
        # without a host memory)
        acc_host = (mesh_with_memory_kind(acc_sh.grads, HOST_MEMORY, "OptimizerConfig.offload_accumulator")
                    if self.offloads_accumulator else None)

        def init_acc(p):
            return zero_accumulator(p, sum_keys, list(maxes_t), list(mins_t))

        def init_opt(p):
            return OptState(step=jnp.zeros((), jnp.int32), inner=self.tx.init(p))

        def objective(t, f, mb):
            return microbatch_objective(self.forward_fn, self.loss, self.router_coefs, join_parts(t, f), mb,
                                        aux_metrics=self.aux_metrics)
        grad_fn = jax.value_and_grad(objective, has_aux=True)   # d/dt only

        def micro(t, f, acc, mb):
            (numerator, (parts, router_sums)), grads = grad_fn(t, f, mb)
            # Pin the gradients to the params' layout: otherwise the optimizer state's extra
            # `data` split propagates back into the backward pass (and reshuffles activations).
            grads = jax.lax.with_sharding_constraint(grads, param_sh)
            return accumulate(acc, grads, numerator, parts, router_sums)

        def stats(t, f, acc_stats: AccStats, mb):
            # the same objective as `micro`, forward only: the stats a grad micro-step adds
            numerator, (parts, router_sums) = objective(t, f, mb)
            return accumulate_stats(acc_stats, numerator, parts, router_sums)

        # Offloaded optimizer state (OptimizerConfig.offload_state) lives in host memory between
        # updates: moved to the device for the update and back, inside the same jitted function.
        offloaded = any(sh.memory_kind == HOST_MEMORY for sh in jax.tree.leaves(opt_sh))
        # a raw optax transformation gets the default rounding (OptimizerConfig's)
        rounding = (self.optimizer_cfg or OptimizerConfig()).param_rounding
        opt_on_device = with_memory_kind(opt_sh, "device") if offloaded else None

        def update(p, opt_state, acc):
            if offloaded:
                opt_state = jax.device_put(opt_state, opt_on_device)
            new_p, new_opt, metrics = _apply_update(self.tx, self.schedule, param_sh, p, opt_state, acc,
                                                    ROUTER_METRICS + self.aux_metrics, rounding)
            if offloaded:
                new_opt = jax.device_put(new_opt, opt_sh)
            return new_p, new_opt, metrics

        def apply(p, opt_state, acc):
            return update(p, opt_state, acc)

        def step(t, f, opt_state, mb):
            return update(t, opt_state, micro(t, f, init_acc(t), mb))

        self._layouts[_key(params)] = {"acc": acc_sh, "acc_host": acc_host, "params": param_sh, "init_acc": init_acc}
        return {
            "init_acc": jax.jit(init_acc, out_shardings=acc_sh),
            "init_opt": jax.jit(init_opt, out_shardings=opt_sh),
            "micro": jax.jit(micro, donate_argnums=(2,), out_shardings=acc_sh),
            "stats": jax.jit(stats, donate_argnums=(2,), out_shardings=acc_sh.stats),
            "apply": jax.jit(apply, donate_argnums=(0, 1), out_shardings=(param_sh, opt_sh, rep)),
            "step": jax.jit(step, donate_argnums=(0, 2), out_shardings=(param_sh, opt_sh, rep)),
        }


def batch_sharding(mesh, shape) -> NamedSharding:
    """Rows over the batch axes of the mesh, a [batch, seq, ...] array's seq over `context`
    (each where it divides), the rest replicated."""
    from sfrrl_jax.mesh import sharding_for  # the one rules table
    axes = ("batch",) + (("seq",) if len(shape) > 1 else ()) + (None,) * (len(shape) - 2)
    return sharding_for(mesh, axes, shape)


def _apply_update(tx, schedule, param_sh, params, opt_state: OptState, acc: Accumulator,
                  forward_metrics: tuple[str, ...] = ROUTER_METRICS, rounding: str = "stochastic"):
    s = acc.scalars
    den = jnp.maximum(s.denominator, 1.0)
    grads = jax.tree.map(lambda g: g / den, acc.grads)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(grad_norm) & jnp.isfinite(s.numerator)
    updates, inner = tx.update(grads, opt_state.inner, params)
    updates = jax.lax.with_sharding_constraint(updates, param_sh)
    # the rounding draws hash the update count: a resumed run repeats them
    new_params = apply_updates_rounded(params, updates, opt_state.step, rounding)
    keep = lambda new, old: jnp.where(ok, new, old)
    new_params = jax.tree.map(keep, new_params, params)
    # Each state leaf keeps its dtype: optax keeps what it computes (adam's first moment with
    # mu_dtype=None comes out float32 from float32 gradient sums), so a bf16 state would turn
    # float32 at the first update (the update recompiles, a checkpoint no longer matches its
    # restore target, 1.5x the memory planned).
    new_inner = jax.tree.map(lambda new, old: jnp.where(ok, new.astype(old.dtype), old), inner, opt_state.inner)
    new_opt = OptState(step=opt_state.step + ok.astype(jnp.int32), inner=new_inner)
    metrics = finalize_metrics(
        {k: v for k, v in acc.sums.items() if "/" in k and k not in forward_metrics}, acc.maxes, acc.mins,
        s.denominator, s.num_tokens)
    for name in forward_metrics:
        metrics[name] = acc.sums[name] / den
    metrics.update(
        loss=s.numerator / den,
        grad_norm=grad_norm,
        update_skipped=(~ok).astype(jnp.float32),
        num_tokens=s.num_tokens,
        num_seqs=s.num_seqs,
        num_microbatches=s.num_microbatches,
    )
    # the config's schedule at the applied-update count; a raw transformation's injected rate
    lr = schedule(opt_state.step) if schedule is not None else learning_rate_in_state(inner)
    if lr is not None:
        metrics["learning_rate"] = lr
    return new_params, new_opt, metrics


def make_train_step(cfg: ModelConfig, loss: Loss | LossConfig,
                    optimizer: optax.GradientTransformation | OptimizerConfig) -> TrainStep:
    """The train step of the sfrrl_jax transformer for `cfg` (a `sfrrl_jax.config.ModelConfig`).

    Router aux / z-loss coefficients come from the loss (`Loss.router_aux_coef` / `router_z_coef`,
    i.e. the LossConfig's) when set, else from `cfg`. Routing replay (`Loss.routing_replay='r3'`, a
    MoE `cfg`): the forward uses the batch's routes and metrics gain 'routing_agreement' and
    'routing_agreement/layer_<i>' per MoE layer i.

    Args:
      cfg: the model config; its `vocab_size` bounds the micro-batches' token ids.
      loss: a `sfrrl_jax.rl.Loss` or a `LossConfig`.
      optimizer: an optax `GradientTransformation` or an `OptimizerConfig` (see `TrainStep`).
    Returns:
      The `TrainStep` (jitted lazily, per params layout and batch shape).
    Raises:
      ValueError: when the loss has routing_replay='r3' but the model has no MoE layer.
    """
    from sfrrl_jax.models import transformer as tfm

    loss = as_loss(loss)
    aux_metrics = ()
    if loss.routing_replay == "r3":
        moe = tfm.moe_layer_ids(cfg)
        if not moe:
            raise ValueError(f"the loss {loss.name!r} has routing_replay='r3' but the model has no MoE layer "
                             f"(ModelConfig.n_experts={cfg.n_experts}): there are no routes to replay")
        aux_metrics = ("routing_agreement",) + tuple(f"routing_agreement/layer_{i}" for i in moe)

    def forward_fn(params, tokens, segment_ids, positions, routes=None, routes_mask=None):
        if isinstance(params, AdaptedParams):   # shapes only: checked as the step is traced
            check_adapter(cfg, params.adapter)
        params = model_view(cfg, params)   # AdaptedParams: the base with the adapter, unmerged
        hidden, aux = tfm.forward_hidden(cfg, params, tokens, segment_ids, positions, routes=routes,
                                         routes_mask=routes_mask)
        return hidden, tfm.unembedding(cfg, params), aux

    coefs = (
        cfg.router_aux_coef if loss.router_aux_coef is None else loss.router_aux_coef,
        cfg.router_z_coef if loss.router_z_coef is None else loss.router_z_coef,
    )
    return TrainStep(forward_fn, loss, optimizer, router_coefs=coefs, vocab_size=cfg.vocab_size,
                     aux_metrics=aux_metrics)
