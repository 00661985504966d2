"""Advantage-deferred gradients: back-propagate a trajectory before its group's advantages exist.

A group's advantages are known only when its last sample finishes, yet the first samples may
have finished seconds earlier, while the device idles on the stragglers' tools. For a loss that
declares `Loss.linear_in_advantages` (the built-in policy loss with `behavior='current'`: the
PPO/GSPO ratio is exactly 1 in value, so the clip never binds) a row's loss gradient is linear in
its advantage:

    grad_i = A_i * H_i + K_i

H_i: the gradient of the advantage term (`ObjectiveParts.advantage_term`) at advantage 1; K_i:
that of the advantage-free terms (KL, entropy bonus: `Loss.has_advantage_free_terms`; router
losses). The group estimators (grpo, dr_grpo, rloo) are affine in the
reward with one slope per group: A_i = slope * (r_i - c) + A_c for any reference reward c of the
group with advantage A_c. So a group buffer keeps

    h1 = sum_i H_i,   hc = sum_i (r_i - c) H_i,   k = sum_i K_i   (k only if such terms exist)

with c the reward of the group's first early trajectory, and at completion adds
`slope * hc + A_c * h1 + k` to the step's accumulator: the same sum as back-propagating those
rows at their final advantages, up to float32 summation order. Centring on c (not on the unknown mean) keeps a group whose
rewards are all equal exact: every (r_i - c) is 0 and A_c is the advantage sync computes.
Loss-normaliser counts and metric sums are advantage-free and ride along in the buffer
(`DeferredBuffer.stats`, an `accumulator.AccStats`); the metric sums the loss names in
`Loss.advantage_metrics` (the policy loss: 'agg/pg_loss') equal the advantage term and are
combined like the gradient.

Cost: two param-sized float32 buffers per group in flight (three with KL/entropy/router terms,
whose split also runs the backward twice). The trainer caps the number of such groups.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.loss_fn import Loss, as_loss
from sfrrl_jax.rl.microbatch import MicroBatch
from sfrrl_jax.learner.accumulator import (
    AccStats, Accumulator, accumulate_stats, field_getitem, merge_stats,
)
from sfrrl_jax.learner.objective import microbatch_objective


class DeferredBuffer(NamedTuple):
    """One early group's sums (see the module doc); `k` is None without advantage-free terms."""
    h1: Any          # sum_i H_i (param-shaped, float32)
    hc: Any          # sum_i (r_i - c) H_i
    pg1: Any         # sum_i of the advantage term at advantage 1 (scalar)
    pgc: Any         # sum_i (r_i - c) * that
    stats: AccStats  # counts and metric sums (advantage metrics held at 0 until the merge)
    k: Any = None    # sum_i K_i

    __getitem__ = field_getitem  # buf['pg1'] reads buf.pg1 (the former dict layout)


def advantage_free_terms(train_step) -> bool:
    """Whether the loss has terms whose gradient does not scale with the advantage (the loss's
    declared advantage-free terms, or router losses)."""
    return (as_loss(train_step.loss).has_advantage_free_terms
            or any(c != 0.0 for c in train_step.router_coefs))


def check_deferrable(loss: Loss | LossConfig) -> None:
    """Raises unless the loss declares its gradient linear in the advantages (see the module doc)."""
    loss = as_loss(loss)
    if not loss.linear_in_advantages:
        raise ValueError(
            f"advantage-deferred gradients need a loss linear in the advantages; the loss {loss.name} "
            "does not declare Loss.linear_in_advantages (built-ins: LossConfig.objective='policy' "
            "with behavior='current', ratio exactly 1)")


def build_deferred_fns(forward_fn, loss: Loss, router_coefs, acc_sh: Accumulator, init_acc,
                       aux_metrics: tuple[str, ...] = (), join=lambda t, f: t) -> dict:
    """Jitted init / micro / merge for one params layout: the accumulator's shardings `acc_sh`
    and its (unjitted) zero `init_acc(trained)`, as the train step built them. `micro` takes the
    trained pytree and the frozen one (None for full training) and differentiates the first;
    `join(trained, frozen)` is the params the forward reads (`models.lora.join_parts`)."""
    check_deferrable(loss)
    param_sh = acc_sh.grads
    scalar_sh = acc_sh.scalars.numerator
    with_rest = loss.has_advantage_free_terms or any(c != 0.0 for c in router_coefs)
    adv_metrics = loss.advantage_metrics
    buf_sh = DeferredBuffer(h1=param_sh, hc=param_sh, pg1=scalar_sh, pgc=scalar_sh, stats=acc_sh.stats,
                            k=param_sh if with_rest else None)

    def init(p):
        acc = init_acc(p)
        zeros = lambda: jax.tree.map(jnp.zeros_like, acc.grads)
        return DeferredBuffer(h1=acc.grads, hc=zeros(), pg1=jnp.zeros((), jnp.float32),
                              pgc=jnp.zeros((), jnp.float32), stats=acc.stats,
                              k=zeros() if with_rest else None)

    objective = functools.partial(microbatch_objective, forward_fn, loss, router_coefs, aux_metrics=aux_metrics)

    def split_terms(t, f, mb: MicroBatch):
        numerator, (parts, router_sums) = objective(join(t, f), mb)
        return (parts.advantage_term, numerator - parts.advantage_term), (parts, router_sums)

    def micro(t, f, buf, mb: MicroBatch, centred_reward):
        mb = mb.replace(advantages=mb.loss_mask.astype(jnp.float32))  # advantage 1 on every token
        (pg, rest), pullback, (parts, router_sums) = jax.vjp(lambda q: split_terms(q, f, mb), t, has_aux=True)
        one, zero = jnp.ones((), pg.dtype), jnp.zeros((), pg.dtype)
        (h,) = pullback((one, zero))
        h = jax.lax.with_sharding_constraint(h, param_sh)
        add = lambda a, g, w=1.0: jax.tree.map(lambda x, y: x + w * y.astype(jnp.float32), a, g)
        # Metric sums hold no advantage-scaled entry until the merge knows the advantages.
        parts = parts._replace(sums={**parts.sums, **{k: jnp.zeros((), jnp.float32) for k in adv_metrics}})
        k = None
        if with_rest:
            (k,) = pullback((zero, one))
            k = add(buf.k, jax.lax.with_sharding_constraint(k, param_sh))
        return DeferredBuffer(h1=add(buf.h1, h), hc=add(buf.hc, h, centred_reward),
                              pg1=buf.pg1 + pg, pgc=buf.pgc + centred_reward * pg,
                              stats=accumulate_stats(buf.stats, rest, parts, router_sums), k=k)

    def merge(acc, buf, slope, reference_advantage):
        pg = slope * buf.pgc + reference_advantage * buf.pg1
        grads = jax.tree.map(lambda a, hc, h1: a + slope * hc + reference_advantage * h1,
                             acc.grads, buf.hc, buf.h1)
        if with_rest:
            grads = jax.tree.map(jnp.add, grads, buf.k)
        stats = merge_stats(acc.stats, buf.stats)
        scalars = stats.scalars._replace(numerator=stats.scalars.numerator + pg)
        sums = {**stats.sums, **{k: stats.sums[k] + pg for k in adv_metrics if k in stats.sums}}
        return Accumulator(grads, scalars, sums, stats.maxes, stats.mins)

    return {
        "init": jax.jit(init, out_shardings=buf_sh),
        "micro": jax.jit(micro, donate_argnums=(2,), out_shardings=buf_sh),
        "merge": jax.jit(merge, donate_argnums=(0,), out_shardings=acc_sh),
    }
