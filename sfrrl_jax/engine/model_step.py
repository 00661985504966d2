"""The model run against a KV cache: `extend` writes new tokens' keys/values into their slots'
cache rows and returns logits for those tokens, attending to everything the slots already hold.

Prefill (an empty row), decode (one token per slot) and append-prefill (a tool observation
added to a parked slot) are all `extend` with different shapes; they share the layer code of
the training forward (`sfrrl_jax.models`), so the engine and the trainer compute the same
function of the same params.
"""
from __future__ import annotations

import jax.numpy as jnp

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import constrain
from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.models.layers import attend, attention_mask

CACHE_AXES = ("layers", "slots", "cache_len", "kv_heads", "head_dim")


def extend(cfg: ModelConfig, params, tokens, starts, cache_k, cache_v, valid_len):
    """Runs `tokens` [b, t] at positions starts[:, None] + 0..t-1 against cache rows.

    cache_k, cache_v: [layers, b, max_len, kv_heads, head_dim] (the rows of the slots involved).
    valid_len [b]: cache entries at positions < valid_len are attendable after this write
    (starts + the true number of new tokens; padding beyond it is written but never read).
    Returns (logits [b, t, vocab] fp32, new cache_k, new cache_v).
    """
    model = tfm.bind(cfg, params)
    b, t = tokens.shape
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    max_len = cache_k.shape[2]
    k_pos = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (b, max_len))
    k_valid = k_pos < valid_len[:, None]
    ones_q = jnp.ones((b, t), jnp.int32)
    ones_k = jnp.ones((b, max_len), jnp.int32)
    x = constrain(model.embed(tokens), ("batch", "seq", "embed"))

    rows = jnp.arange(b)[:, None]

    def body(block, carry, window, layer):
        # The whole cache rides in the scan carry and is updated in place layer by layer.
        x, ck_all, cv_all = carry
        h = block.attn_norm(x)
        q, k, v = block.attn.project_qkv(h, positions)
        ck_all = ck_all.at[layer, rows, positions].set(k.astype(ck_all.dtype), mode="drop")
        cv_all = cv_all.at[layer, rows, positions].set(v.astype(cv_all.dtype), mode="drop")
        mask = attention_mask(positions, k_pos, ones_q, ones_k, window, k_valid)
        ck, cv = ck_all[layer].astype(q.dtype), cv_all[layer].astype(q.dtype)
        x = x + block.attn.output(attend(q, ck, cv, mask, block.attn.sink_logits()))
        y, _ = block.moe(block.mlp_norm(x))
        return (constrain(x + y, ("batch", "seq", "embed")), ck_all, cv_all), None

    layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
    (x, cache_k, cache_v), _ = tfm.run_layers(cfg, model.layers, (x, cache_k, cache_v), body, layer_ids)
    logits = tfm.logits_from_hidden(cfg, params, model.final_norm(x))
    return logits, cache_k, cache_v
