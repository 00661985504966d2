"""The model run against a KV cache: `extend` writes new tokens' keys/values into their slots'
cache rows and returns logits for those tokens, attending to everything the slots already hold.

Prefill (an empty row), decode (one token per slot) and append-prefill (a tool observation
added to a parked slot) are all `extend` with different shapes; they share the layer code of
the training forward (`sfrrl_jax.models`), so the engine and the trainer compute the same
function of the same params. Attention over the cache never builds [t, k_len] scores for a
prefill or append (the blockwise core, unless cfg.attention_impl == 'naive'; see
`_cache_attention`). `extend_paged` is the same run against a paged cache (a pool of
fixed-size pages reached through per-slot page tables; see `engine.pages`, `engine.paged`).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import constrain
from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.models.lora import model_view
from sfrrl_jax.models.attention import blockwise_attention
from sfrrl_jax.models.layers import attend, attention_mask, decode_attend
from sfrrl_jax.models.paged_attention import paged_decode_attention

CACHE_AXES = ("layers", "slots", "cache_len", "kv_heads", "head_dim")
# The page pools are shared by all slots, so they are not split over the slot axes: any slot may
# own any page. (Per-data-shard pools with slot affinity are a follow-up for multi-host meshes.)
PAGE_POOL_AXES = (None, None, "kv_heads", "head_dim")


def extend(cfg: ModelConfig, params, tokens, starts, cache_k, cache_v, valid_len,
           with_routes: bool = False, k_len: int | None = None, logits_at=None, slots=None,
           gather_slots: bool = False):
    """Runs `tokens` [b, t] at positions starts[:, None] + 0..t-1 against cache rows.

    cache_k, cache_v: [layers, b, max_len, kv_heads, head_dim] (the rows of the slots involved;
    cache_v cfg.value_cache_dim wide: empty with latent attention, whose values are cache_k), or
    with per-layer params (`ModelConfig.scan_layers=False`) lists of one [b, max_len, ...] per layer,
    or with `slots` [b] int32 the whole caches [layers, slots, max_len, ...], row i of the batch
    being cache row slots[i]: written in place, each layer's row read by a select and a sum
    over the slot axis (that axis is split over devices, and XLA partitions a gather or dynamic
    slice of a split axis by all-gathering every slot's row; the sum is an all-reduce of one).
    For a few rows (an append, a restore): the select reads [b, slots, k_len] per layer, every
    slot's cache, which on CPU made a 25-token append into 64 slots of SmolLM2-135M 3x a whole
    decode step (1.0 s against 84 ms gathered). gather_slots (static; the caller knows the slot
    axis is whole on every device): the rows are gathered instead, the same values bit for bit.
    valid_len [b]: cache entries at positions < valid_len are attendable after this write
    (starts + the true number of new tokens; padding beyond it is written but never read).
    k_len (static, default max_len): attention reads only cache positions < k_len, so a decode
    step whose rows are all short reads a short prefix of the cache; the caller guarantees
    valid_len <= k_len for every row whose output it uses (a row past it gets garbage).
    logits_at [b] int32 (optional): the logits of token logits_at[i] of row i only, [b, 1, vocab]
    (a prefill or an append samples after its last token: the LM head over every token of an
    8k-token append is [8k, vocab] fp32, 6.6 GB for gpt-oss' vocabulary, for one row of it).
    Returns (logits [b, t, vocab] fp32, new cache_k, new cache_v); with_routes (static, MoE only):
    also the experts each new token used, routes [b, t, moe layers, top_k] (`routes_dtype`).
    """
    rows = jnp.arange(tokens.shape[0])[:, None] if slots is None else slots[:, None]
    max_len = cache_k[0].shape[1]   # layer 0's [slots, max_len, ...], stacked or a per-layer list
    k_len = max_len if k_len is None else min(int(k_len), max_len)

    def write(c, layer, positions, x):
        if isinstance(c, list):   # per-layer caches: layer is a Python int (the layers run unrolled)
            return c[:layer] + [c[layer].at[rows, positions].set(x.astype(c[layer].dtype), mode="drop")] + c[layer + 1:]
        return c.at[layer, rows, positions].set(x.astype(c.dtype), mode="drop")

    def read(c, layer, positions, x):
        c = c[layer]   # [slots, max_len, kv_heads, head_dim]: a stacked cache's dynamic slice, or a layer's array
        if slots is None:
            return c[:, :k_len]
        if gather_slots:
            return c[slots, :k_len]
        mine = (jnp.arange(c.shape[0])[None, :] == slots[:, None])[:, :, None, None, None]   # [b, S]
        return jnp.sum(jnp.where(mine, c[None, :, :k_len], jnp.zeros((), c.dtype)), axis=1, dtype=c.dtype)

    return _extend(cfg, params, tokens, starts, cache_k, cache_v, valid_len, k_len, write, read, with_routes,
                   logits_at)


def extend_paged(cfg: ModelConfig, params, tokens, starts, pool_k, pool_v, page_table, valid_len,
                 k_len: int, layer_kind, layer_base, layer_scratch, overlay: bool,
                 with_routes: bool = False, logits_at=None, kernel: bool = False):
    """`extend` against a paged cache (see `engine.pages`, `engine.paged`).

    pool_k, pool_v: [units, page_size, kv_heads, head_dim]: every layer's pages, layer l's page p
    at unit layer_base[l] + p and its scratch page at layer_scratch[l] (static int arrays
    [layers], `pages.pool_units`); page_table [b, kinds, pages_per_slot] int32: the kind-local
    pages of the slots involved, in position order, layer l reading row kind layer_kind[l] (the
    kind's scratch id where unassigned). Each layer writes the new keys/values through its table
    row (positions past the table or on unassigned pages go to its scratch page, like `extend`'s
    dropped writes) and reads the slots' pages back gathered into a contiguous [b, k_len] view
    (k_len = the dense cache's max_len, so attention runs on the same shapes and values as the
    dense engine: bit-identical results; a decode bucket's smaller k_len reads only the pages
    below it, as the dense engine reads only the positions below it). `overlay` (static; set when a kind has a window): a slot
    holds only the pages later steps read, so the view takes this step's new keys/values from the
    step itself, and an append or a restore needs no page for a position no later query sees.
    kernel (static): a decode step (t == 1) attends with `models.paged_attention`'s kernel, which
    reads the pages in place and only those a query sees (a window layer's window, the pages
    below the slot's length) instead of the gathered view: the same function, summed in another
    order (equal to the gather path within float rounding, not bit for bit). Prefills and appends
    keep the gather path.
    Returns (logits [b, t, vocab] fp32, new pool_k, new pool_v), and routes as `extend` with
    with_routes; logits_at as `extend`'s.
    """
    page_size, n_pages = pool_k.shape[1], page_table.shape[2]
    rows = jnp.arange(tokens.shape[0])[:, None]
    single = page_table.shape[1] == 1
    kind = jnp.asarray(layer_kind, jnp.int32)
    base, scratch = jnp.asarray(layer_base, jnp.int32), jnp.asarray(layer_scratch, jnp.int32)

    def units(layer):  # [b, pages_per_slot]: the units of layer `layer`'s pages, per slot
        return base[layer] + (page_table[:, 0] if single else page_table[:, kind[layer]])

    def write(c, layer, positions, x):
        idx = positions // page_size
        unit = jnp.take_along_axis(units(layer), jnp.minimum(idx, n_pages - 1), axis=1)
        unit = jnp.where(idx < n_pages, unit, scratch[layer])
        return c.at[unit, positions % page_size].set(x.astype(c.dtype))

    read_pages = min(n_pages, -(-k_len // page_size))  # the pages holding positions < k_len

    def read(c, layer, positions, x):
        g = c[units(layer)[:, :read_pages]]  # [b, read_pages, page_size, kv_heads, head_dim]
        g = g.reshape((g.shape[0], read_pages * page_size) + g.shape[3:])[:, :k_len]
        if not overlay:  # full kinds only: every position written lies on a page the slot holds
            return g
        return g.at[rows, positions].set(x.astype(c.dtype), mode="drop")

    def attend_in_place(ck, cv, layer, positions, q, k, v, window, sinks):
        # the new token's own key/value come from the step (as the overlay read takes them), so a
        # slot's pending write that landed on the scratch page is never needed
        out = paged_decode_attention(q[:, 0], ck, cv, units(layer)[:, :read_pages], positions[:, 0], valid_len,
                                     k[:, 0], v[:, 0], window, sinks, k_len=k_len)
        return out[:, None]

    in_place = attend_in_place if kernel and tokens.shape[1] == 1 else None
    return _extend(cfg, params, tokens, starts, pool_k, pool_v, valid_len, k_len, write, read, with_routes,
                   logits_at, in_place)


def routes_dtype(cfg: ModelConfig):
    """The dtype of recorded routes: int16 while expert ids fit (n_experts <= 32767), else int32.
    Routes leave the device every decode step and the host keeps them for every token of every
    trajectory until the train step replays them (moe layers x top_k ids a token, e.g. 48 x 8
    for Qwen3-30B-A3B): half the bytes of int32 in transfer and host memory, and still exact."""
    return jnp.int16 if cfg.n_experts <= 32767 else jnp.int32


def _extend(cfg, params, tokens, starts, cache_k, cache_v, valid_len, k_len, write, read,
            with_routes=False, logits_at=None, attend_cache=None):
    """The layers run against a cache reached through `write(cache, layer, positions [b, t],
    x [b, t, kv_heads, head_dim]) -> cache` and `read(cache, layer, positions, x) -> [b, k_len,
    kv_heads, head_dim]` (key position j of row i is position j of slot i's sequence; read runs
    after write and gets the same positions and new keys or values). with_routes: see `extend`.
    attend_cache (optional): `attend_cache(cache_k, cache_v, layer, positions, q, k, v, window,
    sinks) -> [b, t, heads, head_dim]` replaces read + the attention core (after the write)."""
    if with_routes and not tfm.moe_layer_ids(cfg):
        raise ValueError("with_routes: this model has no MoE layer to record routes of")
    params = model_view(cfg, params)   # AdaptedParams: base + adapter, unmerged (models.lora)
    model = tfm.bind(cfg, params)
    b, t = tokens.shape
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    k_pos = jnp.broadcast_to(jnp.arange(k_len, dtype=jnp.int32), (b, k_len))
    k_valid = k_pos < valid_len[:, None]
    ones_q = jnp.ones((b, t), jnp.int32)
    core = _cache_attention(cfg, t, positions, k_pos, ones_q, k_valid)
    # latent attention's values are its keys ([latent, RoPE key], `models.mla`): the value cache
    # is empty (cfg.value_cache_dim 0) and the key cache serves both
    shared = cfg.value_cache_dim == 0
    x = constrain(model.embed(tokens), ("batch", "seq", "embed"))

    def body(block, carry, window, layer, rope):
        # The whole cache rides in the scan carry and is updated in place layer by layer.
        x, ck_all, cv_all = carry
        h = block.attn_input(x)
        q, k, v = block.attn.project_qkv(h, positions, window, rope)
        ck_all = write(ck_all, layer, positions, k)
        if not shared:
            cv_all = write(cv_all, layer, positions, v)
        if attend_cache is not None:
            att = attend_cache(ck_all, ck_all if shared else cv_all, layer, positions, q, k, v, window,
                               block.attn.sink_logits())
        else:
            ck = read(ck_all, layer, positions, k).astype(q.dtype)
            cv = ck if shared else read(cv_all, layer, positions, v).astype(q.dtype)
            att = core(q, ck, cv, window, block.attn.sink_logits())
        x = x + block.attn_residual(block.attn.output(att))
        y, metrics = block.ffn(block.ffn_input(x), with_ids=with_routes)
        # a MoE layer's experts [b, t, top_k] as the scan's output (a dense layer has none)
        used = metrics.get("expert_ids") if with_routes else None
        return (constrain(x + block.ffn_residual(y), ("batch", "seq", "embed")), ck_all, cv_all), used

    # layer_ids are model-order layer indices: the cache rows stay one per model layer whatever
    # stack (MoE or dense) the layer's params live in. Unrolled layers index per-layer caches by
    # Python int (numpy ids); a scan takes them as its traced xs.
    layer_ids = np.arange(cfg.n_layers, dtype=np.int32)
    # per-layer params (cfg.scan_layers=False) run unrolled, each layer's weights read in place
    # (stacked params against per-layer caches, a config that says per-layer with params loaded
    # stacked, also run unrolled: a scan cannot index a list)
    unrolled = tfm.is_per_layer(params) or isinstance(cache_k, list)
    layers = tfm.per_layer_states(cfg, params) if unrolled else None
    (x, cache_k, cache_v), outs = tfm.run_layers(cfg, model, (x, cache_k, cache_v), body, layer_ids, layers)
    h = model.final_norm(x)
    if logits_at is not None:
        h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)   # [b, 1, embed]
    logits = tfm.logits_from_hidden(cfg, params, h)
    if not with_routes:
        return logits, cache_k, cache_v
    # the `layers` stack holds the MoE layers in model order: [moe layers, b, t, k] -> [b, t, moe layers, k]
    routes = jnp.moveaxis(outs["layers"], 0, 2).astype(routes_dtype(cfg))
    return logits, cache_k, cache_v, routes


def _cache_attention(cfg, t, positions, k_pos, ones_q, k_valid):
    """The attention core of `_extend`: core(q, k, v, window, sinks) -> [b, t, heads, head_dim].

    cfg.attention_impl 'naive' builds the [b, t, k_len] mask and scores (`layers.attend`);
    otherwise `blockwise_attention` never holds more than one [block_q, block_k] tile of scores,
    so a long prefill or append costs memory linear in its length. Cache entries at or past
    valid_len get segment 0 and the queries segment 1: they match nothing, and key blocks holding
    none of a row's valid entries are skipped.
    Decode (t == 1) builds the scores too: they are [b, heads, 1, k_len], no larger than one key
    row per head, so there is no memory to save (on CPU the blockwise loop lost to one fused pass
    by 1.1-1.6x at b=8..32, k_len=512..2048). It runs `layers.decode_attend`, `attend` written as
    products and sums (4x faster than `attend`'s einsums on CPU at SmolLM2's shapes, issue #44);
    'naive' keeps `attend`, the reference. Prefill of 256 tokens against 2048 keys: blockwise 6x
    faster than naive.
    """
    if cfg.attention_impl == "naive" or t == 1:
        ones_k = jnp.ones_like(k_pos)
        core = attend if cfg.attention_impl == "naive" else decode_attend

        def naive(q, k, v, window, sinks):
            return core(q, k, v, attention_mask(positions, k_pos, ones_q, ones_k, window, k_valid), sinks)
        return naive
    k_seg = jnp.where(k_valid, 1, 0).astype(jnp.int32)

    def blockwise(q, k, v, window, sinks):
        return blockwise_attention(q, k, v, positions, k_pos, ones_q, k_seg, window, sinks,
                                   block_q=cfg.attention_block_q, block_k=cfg.attention_block_k)
    return blockwise
