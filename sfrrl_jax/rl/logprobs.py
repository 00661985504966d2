"""Per-token log-probs and entropy of the LM head without materialising the logits.

For hidden states h [batch, seq, d_model] and the unembedding W [d_model, vocab], the logits
z = h @ W are [batch, seq, vocab] float32: at long context and a 200k vocabulary that is the
largest buffer of the train step. Here they are produced one [batch, seq_chunk, vocab_chunk] tile
at a time inside `lax.scan`s, reduced on the fly with an online log-sum-exp:

  running max m, s = sum exp(z - m), u = sum exp(z - m) * z   (over the vocab chunks seen so far)
  lse = m + log s,  E_p[z] = u / s,  entropy = lse - E_p[z],  logp(y) = z_y - lse

z_y is a gather of W's target columns (no logits needed). The backward pass (`jax.custom_vjp`)
recomputes every tile from the saved per-token (lse, E_p[z]) and applies

  d logp(y) / dz_v = [v = y] - p_v,    d entropy / dz_v = -p_v (z_v - E_p[z]),

so the gradient equals the naive one while the peak memory stays one tile (plus a weight-sized
float32 gradient accumulator).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def naive_token_logprobs_and_entropy(
    hidden: jnp.ndarray, unembed: jnp.ndarray, targets: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Reference implementation with full float32 logits. Shapes as in the chunked version.

    Materialises the `[batch, seq, vocab]` float32 logits (and their log-softmax); differentiable by plain
    autodiff. Inputs are not validated.

    Args:
      hidden: `[batch, seq, d_model]` hidden states (any float dtype).
      unembed: `[d_model, vocab]` unembedding.
      targets: `[batch, seq]` int token ids in [0, vocab).
    Returns:
      `(logp, entropy)`, both `[batch, seq]` float32: log p(targets) and the entropy of p per token.
    """
    logits = jnp.einsum("btd,dv->btv", hidden, unembed, preferred_element_type=jnp.float32)
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def token_logprobs_and_entropy(
    hidden: jnp.ndarray,
    unembed: jnp.ndarray,
    targets: jnp.ndarray,
    vocab_chunk: int = 8192,
    seq_chunk: int = 1024,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """log p(targets) and the entropy of p, per token, computed in tiles.

    The logits are produced one `[batch, seq_chunk, vocab_chunk]` float32 tile at a time (see the module
    doc); seq and vocab are padded up to multiples of the chunk sizes internally. Differentiable in hidden
    and unembed (a `jax.custom_vjp` that recomputes the tiles); the gradient matches
    `naive_token_logprobs_and_entropy`, with gradients cast back to the dtypes of `hidden` and `unembed`.

    Args:
      hidden: `[batch, seq, d_model]` hidden states (any float dtype).
      unembed: `[d_model, vocab]` unembedding.
      targets: `[batch, seq]` int token ids in [0, vocab) (not differentiated).
      vocab_chunk: vocab columns per tile (capped at vocab; at least 1).
      seq_chunk: sequence positions per tile (capped at seq; at least 1).
    Returns:
      `(logp, entropy)`, both `[batch, seq]` float32.
    Raises:
      ValueError: `hidden` is not 3-D, `unembed` not 2-D, `targets` not `[batch, seq]` of `hidden`, or
        the d_model of `hidden` differs from the rows of `unembed`.
    """
    if hidden.ndim != 3 or unembed.ndim != 2 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"token_logprobs_and_entropy: need hidden [batch, seq, d_model], unembed [d_model, vocab], "
            f"targets [batch, seq]; got hidden {tuple(hidden.shape)}, unembed {tuple(unembed.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if hidden.shape[-1] != unembed.shape[0]:
        raise ValueError(f"token_logprobs_and_entropy: hidden d_model {hidden.shape[-1]} != "
                         f"unembed rows {unembed.shape[0]}")
    b, t, _ = hidden.shape
    vocab = unembed.shape[1]
    vc = max(1, min(vocab_chunk, vocab))
    tc = max(1, min(seq_chunk, t))
    t_pad = -t % tc
    v_pad = -vocab % vc
    h = jnp.pad(hidden, ((0, 0), (0, t_pad), (0, 0))) if t_pad else hidden
    y = targets.astype(jnp.int32)
    y = jnp.pad(y, ((0, 0), (0, t_pad))) if t_pad else y
    w = jnp.pad(unembed, ((0, 0), (0, v_pad))) if v_pad else unembed
    logp, ent = _chunked(h, w, y, vocab, tc, vc)
    return logp[:, :t], ent[:, :t]


def _split_seq(x: jnp.ndarray, tc: int) -> jnp.ndarray:
    """[batch, seq, ...] -> [seq / tc, batch, tc, ...] (the scan axis first; batch stays whole)."""
    b, t = x.shape[:2]
    return jnp.swapaxes(x.reshape((b, t // tc, tc) + x.shape[2:]), 0, 1)


def _merge_seq(x: jnp.ndarray) -> jnp.ndarray:
    """Inverse of `_split_seq`."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _split_vocab(w: jnp.ndarray, vc: int) -> jnp.ndarray:
    """[d_model, vocab] -> [vocab / vc, d_model, vc]."""
    d, v = w.shape
    return jnp.swapaxes(w.reshape(d, v // vc, vc), 0, 1)


def _tile_logits(h_c, w_v, v_index, vocab):
    """Logits of one tile, float32 [batch, tc, vc]; padded vocab columns are -inf."""
    z = jnp.einsum("btd,dv->btv", h_c, w_v, preferred_element_type=jnp.float32)
    valid = (v_index * w_v.shape[1] + jnp.arange(w_v.shape[1])) < vocab
    return jnp.where(valid, z, -jnp.inf), valid


def _forward_stats(h, w, vocab, tc, vc):
    """Per-token (lse, E_p[z]) over the whole vocab, each [batch, seq] float32."""
    w_chunks = _split_vocab(w, vc)
    n_v = w_chunks.shape[0]

    def seq_body(_, h_c):
        shape = h_c.shape[:2]
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape, jnp.float32))

        def vocab_body(carry, xs):
            m, s, u = carry
            w_v, v_index = xs
            z, valid = _tile_logits(h_c, w_v, v_index, vocab)
            m_new = jnp.maximum(m, jnp.max(z, axis=-1))
            scale = jnp.exp(m - m_new)
            p = jnp.exp(z - m_new[..., None])
            s = s * scale + jnp.sum(p, axis=-1)
            u = u * scale + jnp.sum(jnp.where(valid, p * z, 0.0), axis=-1)
            return (m_new, s, u), None

        (m, s, u), _ = jax.lax.scan(vocab_body, init, (w_chunks, jnp.arange(n_v)))
        return None, (m + jnp.log(s), u / s)

    _, (lse, ez) = jax.lax.scan(seq_body, None, _split_seq(h, tc))
    return _merge_seq(lse), _merge_seq(ez)


def _target_logits(h, w, y):
    """z_y = <h, W[:, y]>, [batch, seq] float32, via a gather of W's target columns."""
    w_y = jnp.take(w.T, y, axis=0)  # [batch, seq, d_model]
    return jnp.einsum("btd,btd->bt", h, w_y, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(h, w, y, vocab, tc, vc):
    lse, ez = _forward_stats(h, w, vocab, tc, vc)
    return _target_logits(h, w, y) - lse, lse - ez


def _chunked_fwd(h, w, y, vocab, tc, vc):
    lse, ez = _forward_stats(h, w, vocab, tc, vc)
    out = (_target_logits(h, w, y) - lse, lse - ez)
    return out, (h, w, y, lse, ez)


def _chunked_bwd(vocab, tc, vc, res, cotangents):
    h, w, y, lse, ez = res
    g_logp, g_ent = cotangents
    g_logp = g_logp.astype(jnp.float32)
    g_ent = g_ent.astype(jnp.float32)
    w_chunks = _split_vocab(w, vc)
    n_v = w_chunks.shape[0]

    def seq_body(dw_acc, xs):
        h_c, lse_c, ez_c, gl_c, ge_c = xs

        def vocab_body(dh_c, xs_v):
            w_v, v_index = xs_v
            z, valid = _tile_logits(h_c, w_v, v_index, vocab)
            p = jnp.where(valid, jnp.exp(z - lse_c[..., None]), 0.0)
            zc = jnp.where(valid, z - ez_c[..., None], 0.0)
            # dense part of d(out)/dz; the [v = y] part of logp is added outside the scan.
            g_z = -p * (gl_c[..., None] + ge_c[..., None] * zc)
            dh_c = dh_c + jnp.einsum("btv,dv->btd", g_z, w_v.astype(jnp.float32))
            dw_v = jnp.einsum("btd,btv->dv", h_c.astype(jnp.float32), g_z)
            return dh_c, dw_v

        dh_c, dw_chunks = jax.lax.scan(
            vocab_body, jnp.zeros(h_c.shape, jnp.float32), (w_chunks, jnp.arange(n_v)))
        return dw_acc + dw_chunks, dh_c

    split = lambda x: _split_seq(x, tc)
    dw_chunks, dh = jax.lax.scan(
        seq_body,
        jnp.zeros(w_chunks.shape, jnp.float32),
        (split(h), split(lse), split(ez), split(g_logp), split(g_ent)),
    )
    dh = _merge_seq(dh)
    dw = jnp.swapaxes(dw_chunks, 0, 1).reshape(w.shape)
    # The one-hot part: d logp / d z_y = +1.
    w_y = jnp.take(w.T, y, axis=0).astype(jnp.float32)
    dh = dh + g_logp[..., None] * w_y
    d = h.shape[-1]
    dw_t = jnp.zeros((w.shape[1], d), jnp.float32).at[y.reshape(-1)].add(
        (g_logp[..., None] * h.astype(jnp.float32)).reshape(-1, d))
    dw = dw + dw_t.T
    return dh.astype(h.dtype), dw.astype(w.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
