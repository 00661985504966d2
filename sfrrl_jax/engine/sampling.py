"""Per-slot sampling: greedy, temperature, top-k, top-p, each slot with its own settings.

Randomness is a function of (request seed, index of the token in the request) only, so a
request's output does not depend on which slot it got or what else was in the batch.
"""
from __future__ import annotations

import dataclasses
import math

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
    greedy = sp.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, sp.temperature)[:, None]
    vocab = logits.shape[-1]
    # The vocabulary sort that top-k / top-p need runs only when some sampled row asks for one
    # (a device-side cond): plain temperature sampling, the common RL setting, skips it.
    filters = ~greedy & (((sp.top_k > 0) & (sp.top_k < vocab)) | (sp.top_p < 1.0))
    filtered = jax.lax.cond(jnp.any(filters), _top_k_top_p, lambda x, *_: x, scaled, sp.top_k, sp.top_p)
    pick = lambda a, t: jnp.take_along_axis(a, t[:, None], axis=-1)[:, 0]

    def draw_all(filtered):
        drawn = gumbel_max_draw(sp.seed, token_index.astype(jnp.uint32), filtered)
        return drawn, pick(jax.nn.log_softmax(filtered, axis=-1), drawn)

    # The random draw runs only when some row samples: an all-greedy batch skips it.
    drawn, drawn_logp = jax.lax.cond(
        jnp.any(~greedy), draw_all,
        lambda f: (jnp.zeros(f.shape[:1], jnp.int32), jnp.zeros(f.shape[:1], jnp.float32)), filtered)
    top = jnp.max(logits, axis=-1, keepdims=True)
    tokens = jnp.where(greedy, first_argmax(logits, top), drawn)
    logp = jnp.where(greedy, 0.0, drawn_logp)
    # log_softmax(logits) at the token alone, in log_softmax's own order of operations (the same
    # bits): no [b, vocab] array of log-probs is written for a [b] read.
    raw_logp = (pick(logits, tokens) - top[:, 0]) - jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
    return tokens, logp, raw_logp


def gumbel_max_draw(seed, token_index, logits):
    """One token per row drawn from softmax(logits), logits [b, vocab] (entries may be -inf, not
    a whole row); seed, token_index [b] uint32: the row's random stream. Returns [b] int32.

    Gumbel-max in two stages, exact in distribution: the vocabulary is cut into blocks of
    `draw_block(vocab)` entries; a block is drawn by Gumbel-max over the blocks' log masses
    (logsumexp: the maximum of a block's Gumbel-perturbed logits is a Gumbel variate at that
    location), then a token inside it by Gumbel-max over its entries, so P(token) = P(block) x
    P(token | block) = softmax(logits)[token]. That is ~2 sqrt(vocab) random variates a row
    instead of vocab (threefry's bits were most of a sampled decode step on CPU). Both stages
    are argmaxes of perturbed values, so a last-bit change of the logits (another process
    count's summation order) flips a token about as rarely as one Gumbel-max does; an
    inverse-CDF draw moves every boundary with the normaliser (measured at vocab 512 and a 1e-5
    relative nudge: 72 of 20,000 tokens changed, against 1 here).
    """
    b, vocab = logits.shape
    block = draw_block(vocab)
    blocks = -(-vocab // block)
    x = jnp.pad(logits, ((0, 0), (0, blocks * block - vocab)), constant_values=-jnp.inf)
    x = x.reshape(b, blocks, block)
    mass = jax.nn.logsumexp(x, axis=-1)                                       # [b, blocks]

    def noise(seed, index):
        k_block, k_token = jax.random.split(jax.random.fold_in(jax.random.key(seed), index))
        return jax.random.gumbel(k_block, (blocks,)), jax.random.gumbel(k_token, (block,))

    g_block, g_token = jax.vmap(noise)(seed, token_index)
    chosen = first_argmax(mass + g_block)                                     # [b]
    inside = jnp.take_along_axis(x, chosen[:, None, None], axis=1)[:, 0]      # [b, block]
    return chosen * block + first_argmax(inside + g_token)


def draw_block(vocab: int) -> int:
    """Entries per block of `gumbel_max_draw`: the power of two nearest sqrt(vocab) (fewest
    variates: blocks + block)."""
    return 1 << max(0, round(math.log2(math.sqrt(vocab))))


def first_argmax(x, top=None):
    """`jnp.argmax(x, axis=-1)` (the first index of the maximum) for x [..., n] as int32, from two
    plain reductions: XLA:CPU runs argmax's (value, index) pair reduction ~3x slower. A row whose
    maximum is nan gets index n - 1 (argmax would give the nan's index). top: x's maximum
    [..., 1] where the caller has it."""
    n = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True) if top is None else top
    idx = jnp.min(jnp.where(x == top, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
    return jnp.minimum(idx, n - 1)


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
