"""The loss of one (micro-)batch: model forward -> chunked log-probs -> the `Loss`'s objective.

The objective is a value (`sfrrl_jax.rl.Loss`: built-ins from a `LossConfig`, or any new one);
it receives the target-aligned log-probs, entropies and mask plus the batch fields it declares
(`rl.loss_fn.LossInputs`) and returns `ObjectiveParts`.

Shift convention. A micro-batch (`rl.MicroBatch`) stores, per position t of `tokens` [batch, seq],
the loss-mask bit, the advantage and the rollout log-prob *of token t* (aligned to the token they
belong to; position 0 is never a target). The model's hidden state at position t predicts token t+1, so every per-token
quantity here lives in "target-aligned" [batch, seq] arrays where column t is the prediction of
token t+1: they are the stored arrays shifted left by one, and the last column is always masked.
Keeping the full length avoids copying the hidden states to drop their last position.

Packed rows (segment_ids): a target only counts if it lies in the same (non-padding) segment as
the position predicting it.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from sfrrl_jax.models.context_parallel import per_context_shard
from sfrrl_jax.rl.aggregation import SequenceLayout
from sfrrl_jax.rl.logprobs import token_logprobs_and_entropy
from sfrrl_jax.rl.loss_fn import BASE_FIELDS, LAYOUT_FIELDS, REPLAY_FIELDS, Loss, LossInputs
from sfrrl_jax.rl.losses import ObjectiveParts
from sfrrl_jax.rl.microbatch import MicroBatch

# forward_fn(params, tokens, segment_ids, positions) -> (hidden [batch, seq, embed],
#   unembedding [embed, vocab], aux dict of scalars incl. 'router_aux_loss', 'router_z_loss').
# Under routing replay (Loss.routing_replay='r3') it is also given routes=[batch, seq, moe
# layers, top_k] and routes_mask=[batch, seq] as keywords, and its aux then holds the
# routing-agreement metrics the train step was told about (`TrainStep(aux_metrics=...)`).
ForwardFn = Callable

ROUTER_METRICS = ("router_aux_loss", "router_z_loss")


def shift_left(x: jnp.ndarray) -> jnp.ndarray:
    """[batch, seq, ...] -> same shape, x[:, t + 1] at t, zeros in the last column."""
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def target_mask(loss_mask: jnp.ndarray, segment_ids: jnp.ndarray | None) -> jnp.ndarray:
    """Target-aligned float mask: token t+1 is a loss token predicted from inside its segment."""
    m = shift_left(loss_mask.astype(jnp.float32))
    if segment_ids is not None:
        nxt = shift_left(segment_ids)
        m = m * ((nxt == segment_ids) & (nxt > 0)).astype(jnp.float32)
    return m


def loss_inputs(loss: Loss, logp: jnp.ndarray, entropy: jnp.ndarray, batch: MicroBatch) -> LossInputs:
    """Target-aligned `LossInputs` from log-probs/entropy and the stored micro-batch.

    Args:
      loss: the loss; its declared fields (`Loss.fields`, extras included) are read from `batch`.
      logp: `[rows, width]` target-aligned log-probs.
      entropy: `[rows, width]` target-aligned entropies.
      batch: the stored (token-aligned) `MicroBatch`: `loss_mask` `[rows, width]`, optional
        `segment_ids` `[rows, width]`, and the loss's fields.
    Returns:
      `LossInputs` whose `fields` hold the declared fields the batch carries (not tokens, loss_mask
      or the layout), as float32 `[rows, width]` shifted left by one (per-row `[rows]` advantages
      broadcast over the row first).
    """
    seg = batch.segment_ids
    mask = target_mask(batch.loss_mask, seg)
    layout = SequenceLayout(mask.shape, None if seg is None else shift_left(seg))
    fields = {}
    for k in loss.fields:
        if k in BASE_FIELDS or k in LAYOUT_FIELDS or batch.get(k) is None:
            continue
        v = batch.get(k).astype(jnp.float32)
        if k == "advantages" and v.ndim == 1:  # one advantage per row (unpacked rows; checked by the caller)
            v = jnp.broadcast_to(v[:, None], mask.shape)
        fields[k] = shift_left(v)
    return LossInputs(logp, entropy, mask, layout, fields)


def objective_from_logprobs(loss: Loss, logp: jnp.ndarray, entropy: jnp.ndarray, batch: MicroBatch) -> ObjectiveParts:
    """The objective given target-aligned log-probs/entropy `[rows, width]` and the stored
    `MicroBatch` (`loss_inputs`): `loss.fn(loss_inputs(...))`, the loss's `ObjectiveParts`."""
    return loss.fn(loss_inputs(loss, logp, entropy, batch))


def microbatch_objective(
    forward_fn: ForwardFn,
    loss: Loss,
    router_coefs: tuple[float, float],
    params,
    batch: MicroBatch,
    aux_metrics: tuple[str, ...] = (),
):
    """(differentiable numerator, (ObjectiveParts, router metric sums)) of one micro-batch.

    The router losses (per-forward means from the model) join the numerator weighted by this
    micro-batch's aggregation denominator, so after accumulation the loss is
    policy_loss + coef * (denominator-weighted mean of the micro-batches' router losses); with a
    single micro-batch that is exactly policy_loss + coef * router_loss. `aux_metrics`: further
    scalars of the forward's aux (routing agreement) accumulated the same way, as metrics only.
    `batch`: the `MicroBatch` (`[rows, width]` fields, token-aligned; module doc).
    """
    tokens = batch.tokens
    replay = {k: batch.get(k) for k in REPLAY_FIELDS if batch.get(k) is not None}
    hidden, unembed, aux = forward_fn(params, tokens, batch.segment_ids, batch.positions, **replay)
    # Per token, so each context shard computes its own tokens' log-probs (no sequence gather).
    def logprobs(h, targets, w):
        return token_logprobs_and_entropy(h, w, targets, loss.vocab_chunk, loss.seq_chunk)

    logp, entropy = per_context_shard(logprobs, (hidden, shift_left(tokens)),
                                      (unembed.astype(hidden.dtype),), n_out=2)
    parts = objective_from_logprobs(loss, logp, entropy, batch)
    den = jax.lax.stop_gradient(parts.denominator)
    numerator = parts.numerator
    router_sums = {}
    for name, coef in zip(ROUTER_METRICS, router_coefs):
        value = jnp.asarray(aux.get(name, 0.0), jnp.float32)
        if coef != 0.0:
            numerator = numerator + coef * value * den
        router_sums[name] = jax.lax.stop_gradient(value) * den
    for name in aux_metrics:
        if name not in aux:
            raise KeyError(f"the forward's aux has no {name!r} (has {sorted(aux)}): a routing-replay "
                           "metric needs the batch's 'routes'")
        router_sums[name] = jax.lax.stop_gradient(jnp.asarray(aux[name], jnp.float32)) * den
    return numerator, (parts, router_sums)
