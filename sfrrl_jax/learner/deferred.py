"""Advantage-deferred gradients: back-propagate a trajectory before its group's advantages exist.

A group's advantages are known only when its last sample finishes, yet the first samples may
have finished seconds earlier, while the device idles on the stragglers' tools. With
`behavior='current'` the PPO/GSPO ratio is exactly 1 in value, so the clip never binds and a
row's loss gradient is linear in its advantage:

    grad_i = A_i * H_i + K_i

H_i: the gradient of the policy term at advantage 1; K_i: that of the advantage-free terms (KL,
entropy bonus, router losses). The group estimators (grpo, dr_grpo, rloo) are affine in the
reward with one slope per group: A_i = slope * (r_i - c) + A_c for any reference reward c of the
group with advantage A_c. So a group buffer keeps

    h1 = sum_i H_i,   hc = sum_i (r_i - c) H_i,   k = sum_i K_i   (k only if such terms exist)

with c the reward of the group's first early trajectory, and at completion adds
`slope * hc + A_c * h1 + k` to the step's accumulator: the same sum as back-propagating those
rows at their final advantages, up to float32 summation order. Centring on c (not on the unknown mean) keeps a group whose
rewards are all equal exact: every (r_i - c) is 0 and A_c is the advantage sync computes.
Loss-normaliser counts and metric sums are advantage-free and ride along in the buffer; the
policy-loss metric (`agg/pg_loss`) is linear too and is combined like the gradient.

Cost: two param-sized float32 buffers per group in flight (three with KL/entropy/router terms,
whose split also runs the backward twice). The trainer caps the number of such groups.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sfrrl_jax.learner.objective import microbatch_objective
from sfrrl_jax.learner.train_step import accumulate_stats


def advantage_free_terms(train_step) -> bool:
    """Whether the loss has terms whose gradient does not scale with the advantage."""
    cfg = train_step.loss_cfg
    return cfg.kl_coef > 0 or cfg.entropy_coef > 0 or any(c != 0.0 for c in train_step.router_coefs)


def check_deferrable(loss_cfg) -> None:
    """Raises unless the loss gradient is linear in the advantages (see the module doc)."""
    if loss_cfg.objective != "policy" or loss_cfg.behavior != "current":
        raise ValueError(
            "advantage-deferred gradients need a loss linear in the advantages: LossConfig.objective="
            f"'policy' with behavior='current' (ratio exactly 1); got objective={loss_cfg.objective!r}, "
            f"behavior={loss_cfg.behavior!r}")


def build_deferred_fns(train_step, layout: dict) -> dict:
    """Jitted init / micro / merge for one params layout of `train_step` (a `TrainStep`)."""
    check_deferrable(train_step.loss_cfg)
    acc_sh, param_sh, init_acc = layout["acc"], layout["params"], layout["init_acc"]
    scalar_sh = acc_sh["scalars"]["numerator"]
    with_rest = advantage_free_terms(train_step)
    stats_sh = {k: v for k, v in acc_sh.items() if k != "grads"}
    buf_sh = {"h1": param_sh, "hc": param_sh, "pg1": scalar_sh, "pgc": scalar_sh, "stats": stats_sh}
    if with_rest:
        buf_sh["k"] = param_sh

    def init(p):
        acc = init_acc(p)
        buf = {"h1": acc["grads"], "hc": jax.tree.map(jnp.zeros_like, acc["grads"]),
               "pg1": jnp.zeros((), jnp.float32), "pgc": jnp.zeros((), jnp.float32),
               "stats": {k: v for k, v in acc.items() if k != "grads"}}
        if with_rest:
            buf["k"] = jax.tree.map(jnp.zeros_like, acc["grads"])
        return buf

    objective = functools.partial(microbatch_objective, train_step.forward_fn, train_step.loss_cfg,
                                  train_step.router_coefs)

    def split_terms(p, mb):
        numerator, (parts, router_sums) = objective(p, mb)
        return (parts.advantage_term, numerator - parts.advantage_term), (parts, router_sums)

    def micro(p, buf, mb, centred_reward):
        mb = {**mb, "advantages": mb["loss_mask"].astype(jnp.float32)}  # advantage 1 on every token
        (pg, rest), pullback, (parts, router_sums) = jax.vjp(lambda q: split_terms(q, mb), p, has_aux=True)
        one, zero = jnp.ones((), pg.dtype), jnp.zeros((), pg.dtype)
        (h,) = pullback((one, zero))
        h = jax.lax.with_sharding_constraint(h, param_sh)
        add = lambda a, g, w=1.0: jax.tree.map(lambda x, y: x + w * y.astype(jnp.float32), a, g)
        # Metric sums hold no advantage-scaled entry until the merge knows the advantages.
        parts = parts._replace(sums={**parts.sums, "agg/pg_loss": jnp.zeros((), jnp.float32)})
        out = {"h1": add(buf["h1"], h), "hc": add(buf["hc"], h, centred_reward),
               "pg1": buf["pg1"] + pg, "pgc": buf["pgc"] + centred_reward * pg,
               "stats": accumulate_stats(buf["stats"], rest, parts, router_sums)}
        if with_rest:
            (k,) = pullback((zero, one))
            out["k"] = add(buf["k"], jax.lax.with_sharding_constraint(k, param_sh))
        return out

    def merge(acc, buf, slope, reference_advantage):
        pg = slope * buf["pgc"] + reference_advantage * buf["pg1"]
        grads = jax.tree.map(lambda a, hc, h1: a + slope * hc + reference_advantage * h1,
                             acc["grads"], buf["hc"], buf["h1"])
        if with_rest:
            grads = jax.tree.map(jnp.add, grads, buf["k"])
        s, b = acc["scalars"], buf["stats"]["scalars"]
        scalars = {k: s[k] + b[k] for k in s}
        scalars["numerator"] = scalars["numerator"] + pg
        sums = {k: acc["sums"][k] + buf["stats"]["sums"][k] for k in acc["sums"]}
        sums["agg/pg_loss"] = sums["agg/pg_loss"] + pg
        return {
            "grads": grads, "scalars": scalars, "sums": sums,
            "maxes": {k: jnp.maximum(v, buf["stats"]["maxes"][k]) for k, v in acc["maxes"].items()},
            "mins": {k: jnp.minimum(v, buf["stats"]["mins"][k]) for k, v in acc["mins"].items()},
        }

    return {
        "init": jax.jit(init, out_shardings=buf_sh),
        "micro": jax.jit(micro, donate_argnums=(1,), out_shardings=buf_sh),
        "merge": jax.jit(merge, donate_argnums=(0,), out_shardings=acc_sh),
    }
