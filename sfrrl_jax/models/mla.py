"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Moonlight, GLM-4.7-Flash), on when cfg.mla_kv_rank > 0.

Per token, keys and values come from a latent c = norm(x @ kv_a)[:kv_rank] of mla_kv_rank dims
and one RoPE key k_rope (the rest of x @ kv_a, rotated) that every head shares. Head i's key is
[c @ k_b[:, i], k_rope], its value c @ v_b[:, i]; its query [q_nope, rotate(q_rope)] comes from x
directly (q_proj) or through a normed latent of mla_q_rank dims (q_a_proj, q_b_proj). The scores'
scale is cfg.query_scale (DeepSeek's YaRN folds mscale^2 into it) or 1/sqrt(nope + rope dims).

Two evaluations of the same function:
- the training forward (`__call__`) expands every head's key and value and runs the configured
  core (`layers.self_attention`: blockwise, Pallas, context parallel) on them;
- the engine (`project_qkv` / `output`, the KV-cache steps) absorbs k_b into the query: the
  score q_nope . (c @ k_b[:, i]) is (q_nope @ k_b[:, i]^T) . c, so the cache holds only
  [c, k_rope] as one KV head of cfg.head_dim = kv_rank + rope dims, and the values, the same
  [c, k_rope], are mapped through v_b after the softmax. For DeepSeek-V3 that caches 576 numbers a
  token and layer instead of 128 heads x (192 + 128).

RoPE rotates halves of its dims (`layers.apply_rope`); checkpoints that pair adjacent dims
(DeepSeek's `rope_interleave`) are permuted on load, which gives the same scores
(`checkpoints.hf.tensor_map`).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import constrain
from sfrrl_jax.models.layers import Attention, RMSNorm, cdtype, param, project, rope_unless_nope, self_attention


# The latents' RMSNorm epsilon: DeepSeek's reference code and transformers build q_a_layernorm and
# kv_a_layernorm with their default 1e-6 whatever the config's rms_norm_eps (Moonlight's and
# GLM-4.7-Flash's is 1e-5).
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
    """MLA's params (per layer): q_proj [embed, heads, nope + rope], or q_a_proj [embed, q_rank],
    q_a_norm, q_b_proj [q_rank, heads, nope + rope]; kv_a_proj [embed, kv_rank + rope]; kv_a_norm
    [kv_rank]; k_b_proj [kv_rank, heads, nope]; v_b_proj [kv_rank, heads, v]; o_proj [heads, v, embed]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, r, q_rank = cfg.d_model, cfg.n_heads, cfg.mla_kv_rank, cfg.mla_q_rank
        nope, rope, v = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
        self.cfg = cfg
        if q_rank:
            self.q_a_proj = param(rngs, "normal", (d, q_rank), ("embed", "latent"), cfg)
            self.q_a_norm = RMSNorm(q_rank, cfg, logical_axis="latent", eps=LATENT_NORM_EPS)
            self.q_b_proj = param(rngs, "normal", (q_rank, h, nope + rope), ("latent", "heads", "head_dim"), cfg)
        else:
            self.q_proj = param(rngs, "normal", (d, h, nope + rope), ("embed", "heads", "head_dim"), cfg)
        self.kv_a_proj = param(rngs, "normal", (d, r + rope), ("embed", "latent"), cfg)
        self.kv_a_norm = RMSNorm(r, cfg, logical_axis="latent", eps=LATENT_NORM_EPS)
        self.k_b_proj = param(rngs, "normal", (r, h, nope), ("latent", "heads", "head_dim"), cfg)
        self.v_b_proj = param(rngs, "normal", (r, h, v), ("latent", "heads", "head_dim"), cfg)
        self.o_proj = param(rngs, "normal", (h, v, d), ("heads", "head_dim", "embed"), cfg)

    @property
    def scale(self) -> float:
        """The scores' scale: cfg.query_scale, else 1/sqrt(nope + rope)."""
        cfg = self.cfg
        return cfg.query_scale if cfg.query_scale is not None else (cfg.mla_nope_dim + cfg.mla_rope_dim) ** -0.5

    def _queries(self, x, positions, window, rope):
        """x [b, s, embed] -> q_nope [b, s, heads, nope], q_rope [b, s, heads, rope] (rotated)."""
        cfg, dt = self.cfg, cdtype(self.cfg)
        if cfg.mla_q_rank:
            latent = self.q_a_norm(project(x, self.q_a_proj[...].astype(dt)))
            q = project(latent, self.q_b_proj[...].astype(dt))
        else:
            q = project(x, self.q_proj[...].astype(dt))
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        q_nope, q_rope = q[..., :cfg.mla_nope_dim], q[..., cfg.mla_nope_dim:]
        return q_nope, rope_unless_nope(q_rope, positions, cfg, window, rope)

    def _latent(self, x, positions, window, rope):
        """x [b, s, embed] -> c [b, s, kv_rank] (normed), k_rope [b, s, 1, rope] (rotated)."""
        cfg, dt = self.cfg, cdtype(self.cfg)
        both = project(x, self.kv_a_proj[...].astype(dt))
        c = self.kv_a_norm(both[..., :cfg.mla_kv_rank])
        k_rope = rope_unless_nope(both[..., None, cfg.mla_kv_rank:], positions, cfg, window, rope)
        return c, k_rope

    def _out(self, heads):
        """The heads' values [b, s, heads, v] -> [b, s, embed]."""
        return project(heads, self.o_proj[...].astype(cdtype(self.cfg)), n_in=2)

    def __call__(self, x, positions, segment_ids, window, rope=True):
        """Self-attention over a packed batch, heads expanded: x [b, s, embed]; positions,
        segment_ids [b, s]; window int scalar (0 = unlimited); rope: bool, may be traced."""
        cfg, dt = self.cfg, cdtype(self.cfg)
        q_nope, q_rope = self._queries(x, positions, window, rope)
        c, k_rope = self._latent(x, positions, window, rope)
        k_nope = project(c, self.k_b_proj[...].astype(dt))
        v = project(c, self.v_b_proj[...].astype(dt))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:-1] + k_rope.shape[-1:])], axis=-1)
        # The cores share one head dim and scale by its 1/sqrt: zero columns pad the shorter of
        # (q, k) and v (they change no score and no output), and q carries the rest of the scale.
        width = max(q.shape[-1], v.shape[-1])
        q, k, v = (jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])]) for a in (q, k, v))
        q = q * jnp.asarray(self.scale * math.sqrt(width), q.dtype)
        spec = ("batch", "seq", "heads", "head_dim")
        q, k, v = constrain(q, spec), constrain(k, spec), constrain(v, spec)
        out = self_attention(cfg, q, k, v, positions, segment_ids, window)
        return self._out(out[..., :cfg.mla_v_dim])

    def project_qkv(self, x, positions, window=None, rope=True):
        """The KV-cache steps' view, k_b absorbed into the query: x [b, s, embed] -> q [b, s, heads,
        head_dim], k = v = [c, k_rope] [b, s, 1, head_dim] (head_dim = kv_rank + rope); q carries
        the scale beyond the cores' 1/sqrt(head_dim). `output` maps the attended latent back."""
        cfg, dt = self.cfg, cdtype(self.cfg)
        q_nope, q_rope = self._queries(x, positions, window, rope)
        c, k_rope = self._latent(x, positions, window, rope)
        q_latent = jnp.einsum("bshk,rhk->bshr", q_nope, self.k_b_proj[...].astype(dt))
        q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
        q = q * jnp.asarray(self.scale * math.sqrt(cfg.head_dim), q.dtype)
        kv = jnp.concatenate([c[:, :, None, :], k_rope.astype(c.dtype)], axis=-1)
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        kv = constrain(kv, ("batch", "seq", "kv_heads", "head_dim"))
        return q, kv, kv

    def output(self, attn_out):
        """The cache steps' attention output [b, s, heads, head_dim] (weights over [c, k_rope])
        -> [b, s, embed]: the latent part through v_b, then o_proj."""
        cfg = self.cfg
        latent = attn_out[..., :cfg.mla_kv_rank]
        return self._out(jnp.einsum("bshr,rhk->bshk", latent, self.v_b_proj[...].astype(cdtype(cfg))))

    def sink_logits(self):
        return None


def attention_for(cfg: ModelConfig):
    """The attention module class of `cfg`: latent (cfg.mla_kv_rank > 0) or `layers.Attention`."""
    return LatentAttention if cfg.mla_kv_rank else Attention


__all__ = ["LatentAttention", "attention_for"]
