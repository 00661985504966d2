"""The train step: exact gradient accumulation over micro-batches, then one AdamW update.

    ts = make_train_step(model_cfg, loss_cfg, optimizer_cfg)
    opt_state = ts.init_opt_state(params)
    acc = ts.init_accumulator(params)
    for mb in microbatches:                      # any split of the batch
        acc = ts.grad_microstep(params, acc, mb)  # acc donated
    params, opt_state, metrics = ts.apply(params, opt_state, acc)  # params/opt_state donated
    # or, for a batch that fits at once:  params, opt_state, metrics = ts.step(params, opt_state, batch)
    # samples trained before their group's advantages exist (behavior='current'; `train.deferred`):
    #   buf = ts.deferred_microstep(params, ts.init_deferred(params), row, reward - reference_reward)
    #   acc = ts.merge_deferred(params, acc, buf, advantage_slope, reference_advantage)

Gradients accumulate as *sums* (float32) together with the loss normaliser (loss tokens or
sequences, per the aggregation); `apply` divides once, so every split of a batch into
micro-batches yields the full-batch gradient. Params keep their sharding through the update
(generation reads the same arrays); optimizer moments may be split further over `data`.
A non-finite gradient (or loss) skips the update: params and optimizer state come back unchanged
and `metrics['update_skipped']` is 1.

A micro-batch is a dict of [batch, seq] arrays (see `rl`/`objective.py` for the shift):
  tokens (int), loss_mask, advantages ([batch, seq], or [batch] for unpacked rows),
  rollout_logprobs (required by the policy objective), old_logprobs (behavior='old'),
  ref_logprobs (kl_coef > 0), segment_ids, positions (optional, packed rows; 0 = padding).
Host numpy inputs are placed batch-sharded on the params' mesh. Multi-host: pass global
`jax.Array`s (e.g. from `jax.make_array_from_process_local_data`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.models.api import mesh_of
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.losses import finalize_metrics, policy_objective, sft_objective
from sfrrl_jax.rl.aggregation import SequenceLayout
from sfrrl_jax.learner.objective import ROUTER_METRICS, ForwardFn, microbatch_objective
from sfrrl_jax.learner.optimizer import (
    OptimizerConfig, build_optimizer, learning_rate_schedule, opt_state_shardings,
)

REQUIRED_KEYS = {"policy": ("tokens", "loss_mask", "advantages", "rollout_logprobs"),
                 "sft": ("tokens", "loss_mask")}
OPTIONAL_KEYS = ("advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs", "segment_ids",
                 "positions")


def validate_microbatch(batch: dict, loss_cfg: LossConfig, vocab_size: int | None = None) -> None:
    """Host-side checks (keys, shapes, dtypes, token range) with messages naming the tensor."""
    if not isinstance(batch, dict):
        raise TypeError(f"micro-batch must be a dict of arrays, got {type(batch).__name__}")
    required = list(REQUIRED_KEYS[loss_cfg.objective])
    if loss_cfg.objective == "policy":
        if loss_cfg.behavior == "old":
            required.append("old_logprobs")
        if loss_cfg.kl_coef > 0:
            required.append("ref_logprobs")
    missing = [k for k in required if batch.get(k) is None]
    if missing:
        raise KeyError(f"micro-batch is missing {missing} (objective={loss_cfg.objective!r}, "
                       f"behavior={loss_cfg.behavior!r}, kl_coef={loss_cfg.kl_coef}); has {sorted(batch)}")
    unknown = sorted(set(batch) - set(REQUIRED_KEYS["policy"]) - set(OPTIONAL_KEYS))
    if unknown:
        raise KeyError(f"micro-batch has unknown keys {unknown}; valid: "
                       f"{sorted(set(REQUIRED_KEYS['policy']) | set(OPTIONAL_KEYS))}")
    shape = tuple(np.shape(batch["tokens"]))
    if len(shape) != 2 or shape[1] < 2:
        raise ValueError(f"micro-batch 'tokens' must be [batch, seq] with seq >= 2, got {shape}")
    if not jnp.issubdtype(batch["tokens"].dtype, jnp.integer):
        raise TypeError(f"micro-batch 'tokens' must be integer ids, got {batch['tokens'].dtype}")
    for k, v in batch.items():
        if v is None or k == "tokens":
            continue
        s = tuple(np.shape(v))
        if k == "advantages" and s == shape[:1]:
            if batch.get("segment_ids") is not None:
                raise ValueError("micro-batch 'advantages' is per-row [batch] but rows are packed "
                                 "('segment_ids' given): pass per-token [batch, seq] advantages")
            continue
        if s != shape:
            raise ValueError(f"micro-batch '{k}' has shape {s}, expected {shape} like 'tokens'")
    if vocab_size is not None:
        lo, hi = int(jnp.min(batch["tokens"])), int(jnp.max(batch["tokens"]))
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"micro-batch 'tokens' must lie in [0, {vocab_size}); found min {lo}, max {hi}")


def _metric_template(loss_cfg: LossConfig):
    """Abstract (sums, maxes, mins) the objective produces for this config (keys are static)."""
    def dummy():
        z = jnp.zeros((1, 2), jnp.float32)
        layout = SequenceLayout((1, 2))
        if loss_cfg.objective == "sft":
            parts = sft_objective(z, z, z, layout, loss_cfg)
        else:
            parts = policy_objective(z, z, z, z, z, layout, loss_cfg, old_logp=z, ref_logp=z)
        return parts.sums, parts.maxes, parts.mins
    return jax.eval_shape(dummy)


def _key(tree):
    return jax.tree.structure(tree), tuple(x.sharding for x in jax.tree.leaves(tree))


class TrainStep:
    """Jitted train functions for one (forward, loss, optimizer) triple; see the module doc.

    The jitted functions are built once per params layout (tree structure + shardings) and traced
    once per batch shape; `jitted_*` expose them for AOT lowering (`.lower(...).compile()`).
    """

    def __init__(self, forward_fn: ForwardFn, loss_cfg: LossConfig, optimizer_cfg: OptimizerConfig,
                 router_coefs: tuple[float, float] = (0.0, 0.0), vocab_size: int | None = None):
        self.forward_fn = forward_fn
        self.loss_cfg = loss_cfg
        self.optimizer_cfg = optimizer_cfg
        self.router_coefs = tuple(float(c) for c in router_coefs)
        self.vocab_size = vocab_size
        self.tx = build_optimizer(optimizer_cfg)
        self.schedule = learning_rate_schedule(optimizer_cfg)
        self._template = _metric_template(loss_cfg)
        self._cache: dict = {}
        self._layouts: dict = {}         # per params layout: accumulator shardings, raw init
        self._deferred_cache: dict = {}  # per params layout: `train.deferred` functions

    # -- state -----------------------------------------------------------------------------------
    def init_accumulator(self, params) -> dict:
        """Zero gradient sums (float32, sharded like the params) and zero counts/metric sums."""
        return self._fns(params)["init_acc"](params)

    def init_opt_state(self, params) -> dict:
        """AdamW state {'step', 'inner'}; moments sharded like params plus the state shard axis."""
        return self._fns(params)["init_opt"](params)

    # -- steps -----------------------------------------------------------------------------------
    def grad_microstep(self, params, acc: dict, microbatch: dict) -> dict:
        """Adds one micro-batch's gradient sum, loss numerator and counts to `acc` (donated)."""
        fns = self._fns(params)
        mb = self._prepare(params, microbatch)
        with jax.set_mesh(mesh_of(params)):
            return fns["micro"](params, acc, mb)

    def apply(self, params, opt_state: dict, acc: dict):
        """One optimizer update from the accumulated sums -> (params, opt_state, metrics)."""
        fns = self._fns(params)
        with jax.set_mesh(mesh_of(params)):
            return fns["apply"](params, opt_state, acc)

    def step(self, params, opt_state: dict, batch: dict):
        """grad_microstep on the whole batch + apply, fused into one jitted function."""
        fns = self._fns(params)
        mb = self._prepare(params, batch)
        with jax.set_mesh(mesh_of(params)):
            return fns["step"](params, opt_state, mb)

    # -- advantage-deferred gradients (see `train.deferred`) -------------------------------------
    def init_deferred(self, params) -> dict:
        """A zero group buffer for trajectories back-propagated before their group finishes."""
        return self._deferred(params)["init"](params)

    def deferred_microstep(self, params, buffer: dict, microbatch: dict, centred_reward: float) -> dict:
        """Adds rows that share one reward (minus the group's reference reward) to `buffer` (donated)."""
        fns = self._deferred(params)
        mb = self._prepare(params, microbatch)
        with jax.set_mesh(mesh_of(params)):
            return fns["micro"](params, buffer, mb, np.float32(centred_reward))

    def merge_deferred(self, params, acc: dict, buffer: dict, slope: float, reference_advantage: float) -> dict:
        """acc (donated) + the group buffer's gradient at its final advantages -> acc."""
        fns = self._deferred(params)
        with jax.set_mesh(mesh_of(params)):
            return fns["merge"](acc, buffer, np.float32(slope), np.float32(reference_advantage))

    def compile_count(self) -> int:
        """Compiled executables of every jitted train function so far."""
        return sum(f._cache_size() for cache in (self._cache, self._deferred_cache)
                   for fns in cache.values() for f in fns.values())

    def _deferred(self, params) -> dict:
        from sfrrl_jax.learner.deferred import build_deferred_fns
        key = _key(params)
        if key not in self._deferred_cache:
            self._fns(params)  # the accumulator layout
            self._deferred_cache[key] = build_deferred_fns(self, self._layouts[key])
        return self._deferred_cache[key]

    def jitted_microstep(self, params):
        return self._fns(params)["micro"]

    def jitted_apply(self, params):
        return self._fns(params)["apply"]

    def jitted_step(self, params):
        return self._fns(params)["step"]

    # -- internals -------------------------------------------------------------------------------
    def _prepare(self, params, batch: dict) -> dict:
        batch = {k: v for k, v in batch.items() if v is not None}
        validate_microbatch(batch, self.loss_cfg, self.vocab_size)
        if self.loss_cfg.objective == "sft":
            batch = {k: v for k, v in batch.items() if k in ("tokens", "loss_mask", "segment_ids", "positions")}
        mesh = mesh_of(params)
        out = {}
        for k, v in batch.items():
            if isinstance(v, jax.Array) and isinstance(v.sharding, NamedSharding) and v.sharding.mesh == mesh:
                out[k] = v
            else:
                out[k] = jax.device_put(np.asarray(v), _batch_sharding(mesh, np.shape(v)))
        return out

    def _fns(self, params) -> dict:
        key = _key(params)
        if key not in self._cache:
            self._cache[key] = self._build(params)
        return self._cache[key]

    def _build(self, params) -> dict:
        mesh = mesh_of(params)
        rep = NamedSharding(mesh, P())
        param_sh = jax.tree.map(lambda p: p.sharding, params)
        opt_sh = opt_state_shardings(self.tx, params, self.optimizer_cfg)
        sums_t, maxes_t, mins_t = self._template
        acc_sh = {
            "grads": param_sh,
            "scalars": {k: rep for k in ("numerator", "denominator", "num_tokens", "num_seqs",
                                         "num_microbatches")},
            "sums": {k: rep for k in list(sums_t) + list(ROUTER_METRICS)},
            "maxes": {k: rep for k in maxes_t},
            "mins": {k: rep for k in mins_t},
        }

        def init_acc(p):
            return {
                "grads": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p),
                "scalars": {k: jnp.zeros((), jnp.float32) for k in acc_sh["scalars"]},
                "sums": {k: jnp.zeros((), jnp.float32) for k in acc_sh["sums"]},
                "maxes": {k: jnp.full((), -jnp.inf, jnp.float32) for k in maxes_t},
                "mins": {k: jnp.full((), jnp.inf, jnp.float32) for k in mins_t},
            }

        def init_opt(p):
            return {"step": jnp.zeros((), jnp.int32), "inner": self.tx.init(p)}

        grad_fn = jax.value_and_grad(
            functools.partial(microbatch_objective, self.forward_fn, self.loss_cfg, self.router_coefs),
            has_aux=True)

        def micro(p, acc, mb):
            (numerator, (parts, router_sums)), grads = grad_fn(p, mb)
            # Pin the gradients to the params' layout: otherwise the optimizer state's extra
            # `data` split propagates back into the backward pass (and reshuffles activations).
            grads = jax.lax.with_sharding_constraint(grads, param_sh)
            return _accumulate(acc, grads, numerator, parts, router_sums)

        def apply(p, opt_state, acc):
            return _apply_update(self.tx, self.schedule, param_sh, p, opt_state, acc)

        def step(p, opt_state, mb):
            acc = micro(p, init_acc(p), mb)
            return _apply_update(self.tx, self.schedule, param_sh, p, opt_state, acc)

        self._layouts[_key(params)] = {"acc": acc_sh, "params": param_sh, "init_acc": init_acc}
        return {
            "init_acc": jax.jit(init_acc, out_shardings=acc_sh),
            "init_opt": jax.jit(init_opt, out_shardings=opt_sh),
            "micro": jax.jit(micro, donate_argnums=(1,), out_shardings=acc_sh),
            "apply": jax.jit(apply, donate_argnums=(0, 1), out_shardings=(param_sh, opt_sh, rep)),
            "step": jax.jit(step, donate_argnums=(0, 1), out_shardings=(param_sh, opt_sh, rep)),
        }


def _batch_sharding(mesh, shape) -> NamedSharding:
    """Batch dim over the token axes of the mesh where it divides, the rest replicated."""
    from sfrrl_jax.mesh import sharding_for  # the one rules table
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return sharding_for(mesh, axes, shape)


def _accumulate(acc: dict, grads, numerator, parts, router_sums) -> dict:
    return {"grads": jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc["grads"], grads),
            **accumulate_stats(acc, numerator, parts, router_sums)}


def accumulate_stats(acc: dict, numerator, parts, router_sums) -> dict:
    """The non-gradient entries of an accumulator (scalars, sums, maxes, mins) plus one micro-batch."""
    s = acc["scalars"]
    return {
        "scalars": {
            "numerator": s["numerator"] + numerator,
            "denominator": s["denominator"] + parts.denominator,
            "num_tokens": s["num_tokens"] + parts.num_tokens,
            "num_seqs": s["num_seqs"] + parts.num_seqs,
            "num_microbatches": s["num_microbatches"] + 1.0,
        },
        "sums": {k: acc["sums"][k] + {**parts.sums, **router_sums}[k] for k in acc["sums"]},
        "maxes": {k: jnp.maximum(acc["maxes"][k], parts.maxes[k]) for k in acc["maxes"]},
        "mins": {k: jnp.minimum(acc["mins"][k], parts.mins[k]) for k in acc["mins"]},
    }


def _apply_update(tx, schedule, param_sh, params, opt_state, acc):
    s = acc["scalars"]
    den = jnp.maximum(s["denominator"], 1.0)
    grads = jax.tree.map(lambda g: g / den, acc["grads"])
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(grad_norm) & jnp.isfinite(s["numerator"])
    updates, inner = tx.update(grads, opt_state["inner"], params)
    updates = jax.lax.with_sharding_constraint(updates, param_sh)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(ok, new, old)
    new_params = jax.tree.map(keep, new_params, params)
    new_inner = jax.tree.map(keep, inner, opt_state["inner"])
    new_opt = {"step": opt_state["step"] + ok.astype(jnp.int32), "inner": new_inner}
    metrics = finalize_metrics(
        {k: v for k, v in acc["sums"].items() if "/" in k}, acc["maxes"], acc["mins"],
        s["denominator"], s["num_tokens"])
    for name in ROUTER_METRICS:
        metrics[name] = acc["sums"][name] / den
    metrics.update(
        loss=s["numerator"] / den,
        grad_norm=grad_norm,
        learning_rate=schedule(opt_state["step"]),
        update_skipped=(~ok).astype(jnp.float32),
        num_tokens=s["num_tokens"],
        num_seqs=s["num_seqs"],
        num_microbatches=s["num_microbatches"],
    )
    return new_params, new_opt, metrics


def make_train_step(cfg, loss_cfg: LossConfig, optimizer_cfg: OptimizerConfig) -> TrainStep:
    """The train step of the sfrrl_jax transformer for `cfg` (a `sfrrl_jax.config.ModelConfig`).

    Router aux / z-loss coefficients come from `loss_cfg` when set, else from `cfg`.
    """
    from sfrrl_jax.models import transformer as tfm

    def forward_fn(params, tokens, segment_ids, positions):
        hidden, aux = tfm.forward_hidden(cfg, params, tokens, segment_ids, positions)
        return hidden, tfm.unembedding(cfg, params), aux

    coefs = (
        cfg.router_aux_coef if loss_cfg.router_aux_coef is None else loss_cfg.router_aux_coef,
        cfg.router_z_coef if loss_cfg.router_z_coef is None else loss_cfg.router_z_coef,
    )
    return TrainStep(forward_fn, loss_cfg, optimizer_cfg, router_coefs=coefs, vocab_size=cfg.vocab_size)
