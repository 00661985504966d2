"""The gradient accumulator of a train step: typed pytrees (NamedTuples) that jit and donation accept.

    Accumulator(grads,    param-shaped float32 gradient sums (sharded like the params)
                scalars,  Scalars: numerator (loss sum), denominator (aggregation normaliser:
                          loss tokens or sequences), num_tokens, num_seqs, num_microbatches
                sums,     {metric: float32 sum}: the loss's 'agg/..', 'tok/..' sums + router losses
                maxes,    {metric: running max} (-inf before any loss token)
                mins)     {metric: running min} (+inf before any loss token)

Every entry is a sum (or max/min) over micro-batches, so any split of a batch accumulates to the
same values; the update divides once (`train_step`). `AccStats` is the same without the
gradients: what `learner.deferred`'s group buffers carry alongside their own gradient sums.
Shared by `train_step` and `deferred` (neither imports the other's internals). For callers of
the former dict layout, `acc['scalars']['numerator']` still reads `acc.scalars.numerator`
(string keys read fields; integer indices index the tuple).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def field_getitem(self, key):
    """`__getitem__` of the state NamedTuples: a str reads the field, else tuple indexing."""
    return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)


class Scalars(NamedTuple):
    """The scalar sums of an accumulator, each a float32 scalar `jax.Array` summed over the micro-batches added.

    Attributes:
      numerator: sum of the differentiated loss numerators.
      denominator: sum of the aggregation denominators (loss tokens or sequences).
      num_tokens: loss tokens.
      num_seqs: sequences with at least one loss token.
      num_microbatches: micro-batches added (float32).
    """

    numerator: Any
    denominator: Any
    num_tokens: Any
    num_seqs: Any
    num_microbatches: Any

    __getitem__ = field_getitem


class AccStats(NamedTuple):
    """The non-gradient part of an accumulator."""
    scalars: Scalars
    sums: dict
    maxes: dict
    mins: dict

    __getitem__ = field_getitem


class Accumulator(NamedTuple):
    """Gradient sums plus `AccStats`' fields (flat: `acc.scalars.numerator`, `acc.sums[k]`)."""
    grads: Any
    scalars: Scalars
    sums: dict
    maxes: dict
    mins: dict

    __getitem__ = field_getitem

    @property
    def stats(self) -> AccStats:
        return AccStats(self.scalars, self.sums, self.maxes, self.mins)

    def with_stats(self, stats: AccStats) -> "Accumulator":
        return Accumulator(self.grads, *stats)


def accumulator_shardings(param_sh, replicated, sum_keys, max_keys, min_keys) -> Accumulator:
    """Shardings: gradients like the params, every scalar replicated."""
    return Accumulator(
        grads=param_sh,
        scalars=Scalars(*(replicated,) * len(Scalars._fields)),
        sums={k: replicated for k in sum_keys},
        maxes={k: replicated for k in max_keys},
        mins={k: replicated for k in min_keys},
    )


def zero_accumulator(params, sum_keys, max_keys, min_keys) -> Accumulator:
    """Zero gradient sums (float32, params' shapes) and counts, -inf maxes, +inf mins."""
    zero = lambda: jnp.zeros((), jnp.float32)
    return Accumulator(
        grads=jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params),
        scalars=Scalars(*(zero() for _ in Scalars._fields)),
        sums={k: zero() for k in sum_keys},
        maxes={k: jnp.full((), -jnp.inf, jnp.float32) for k in max_keys},
        mins={k: jnp.full((), jnp.inf, jnp.float32) for k in min_keys},
    )


def accumulate_stats(stats: AccStats | Accumulator, numerator, parts, router_sums) -> AccStats:
    """`stats` (or an accumulator's stats) plus one micro-batch's numerator, ObjectiveParts and
    router metric sums."""
    s = stats.scalars
    scalars = Scalars(
        numerator=s.numerator + numerator,
        denominator=s.denominator + parts.denominator,
        num_tokens=s.num_tokens + parts.num_tokens,
        num_seqs=s.num_seqs + parts.num_seqs,
        num_microbatches=s.num_microbatches + 1.0,
    )
    new_sums = {**parts.sums, **router_sums}
    return AccStats(
        scalars=scalars,
        sums={k: stats.sums[k] + new_sums[k] for k in stats.sums},
        maxes={k: jnp.maximum(stats.maxes[k], parts.maxes[k]) for k in stats.maxes},
        mins={k: jnp.minimum(stats.mins[k], parts.mins[k]) for k in stats.mins},
    )


def accumulate(acc: Accumulator, grads, numerator, parts, router_sums) -> Accumulator:
    """`acc` plus one micro-batch: its gradient (cast to float32) and its stats."""
    summed = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc.grads, grads)
    return Accumulator(summed, *accumulate_stats(acc, numerator, parts, router_sums))


def merge_stats(a: AccStats, b: AccStats) -> AccStats:
    """Elementwise sum (max, min) of two stats of the same layout."""
    return AccStats(
        scalars=Scalars(*(x + y for x, y in zip(a.scalars, b.scalars))),
        sums={k: a.sums[k] + b.sums[k] for k in a.sums},
        maxes={k: jnp.maximum(v, b.maxes[k]) for k, v in a.maxes.items()},
        mins={k: jnp.minimum(v, b.mins[k]) for k, v in a.mins.items()},
    )
