"""Per-slot sampling: greedy, temperature, top-k, top-p, each slot with its own settings.

Randomness is a function of (request seed, index of the token in the request) only, so a
request's output does not depend on which slot it got or what else was in the batch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
    """Per-slot settings, each [slots]. temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array

    @staticmethod
    def create(slots: int) -> "SamplingParams":
        return SamplingParams(
            temperature=jnp.zeros((slots,), jnp.float32), top_k=jnp.zeros((slots,), jnp.int32),
            top_p=jnp.ones((slots,), jnp.float32), seed=jnp.zeros((slots,), jnp.uint32),
        )


def sample(logits, sp: SamplingParams, token_index):
    """Samples one token per row.

    logits [b, vocab] fp32; sp fields [b]; token_index [b] (position of this token in its
    request's output, for the random stream). Returns (tokens [b] int32, logprob [b] under the
    distribution actually sampled from (0 for greedy), raw_logprob [b] under softmax(logits),
    the policy at temperature 1).
    """
    logits = logits.astype(jnp.float32)
    raw_logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = sp.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, sp.temperature)[:, None]
    vocab = logits.shape[-1]
    # The vocabulary sort that top-k / top-p need runs only when some sampled row asks for one
    # (a device-side cond): plain temperature sampling, the common RL setting, skips it.
    filters = ~greedy & (((sp.top_k > 0) & (sp.top_k < vocab)) | (sp.top_p < 1.0))
    filtered = jax.lax.cond(jnp.any(filters), _top_k_top_p, lambda x, *_: x, scaled, sp.top_k, sp.top_p)
    sample_logp = jax.nn.log_softmax(filtered, axis=-1)

    def draw(seed, idx, row):
        key = jax.random.fold_in(jax.random.key(seed), idx)
        return jax.random.categorical(key, row)

    drawn = jax.vmap(draw)(sp.seed, token_index.astype(jnp.uint32), filtered)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    pick = lambda a: jnp.take_along_axis(a, tokens[:, None], axis=-1)[:, 0]
    logp = jnp.where(greedy, 0.0, pick(sample_logp))
    return tokens, logp, pick(raw_logp)


def _top_k_top_p(scaled, top_k, top_p):
    """scaled [b, vocab] with every token outside a row's top-k / top-p set to -inf (rows with
    top_k 0 and top_p 1 unchanged)."""
    # One descending sort serves both top-k and top-p.
    sorted_logits = -jnp.sort(-scaled, axis=-1)
    vocab = scaled.shape[-1]
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    keep_sorted = rank < k[:, None]
    probs_sorted = jax.nn.softmax(jnp.where(keep_sorted, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted  # mass strictly above each token
    # top_p 1 keeps everything (the cumulative sum can round to 1 before the tail)
    keep_sorted &= (before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0)
    # Threshold in value space: ties at the cut-off are kept together.
    n_keep = jnp.sum(keep_sorted, axis=-1)
    cutoff = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)
