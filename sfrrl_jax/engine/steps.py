"""Pure jitted engine steps in the shape of JetStream's Engine API, on the training params.

  init_decode_state()                           -> DecodeState (KV cache for max_slots x max_len)
  prefill(params, tokens, true_length, request) -> (Prefix, first ResultTokens)
  insert(prefix, state, slot, request)          -> state   (slot starts decoding)
  prefill_many(params, state, slots, tokens, true_lengths, requests, sources=None)
                                                -> (state, first ResultTokens [n])
                                                   (prefill + insert of n prompts in one call;
                                                   a prompt several slots share computed once)
  generate(params, state)                       -> (state, ResultTokens)   one token per slot
  append_prefill(params, state, slot, tokens, true_length, request)
                                                -> (state, first ResultTokens)
  append_many(params, state, slots, tokens, true_lengths, requests)
                                                -> (state, first ResultTokens [n])
                                                   (append_prefill into n slots in one call)
  prefill_at_many(params, state, slots, tokens, starts, true_lengths, requests)
                                                -> (state, first ResultTokens [n])
                                                   (prompts whose first tokens are cached)
  free_resource(state, slot)                    -> state

With `record_routes=True` (a MoE model) every ResultTokens also carries `routes`: the experts
each token FED to the model in that step used (prefill: the padded prompt, append: the padded
appended tokens, generate: each slot's pending `last_token`), for routing replay in training.

`params` is whatever the train step holds: no step copies or reshards it. Token arrays are
padded to a bucket length so each step compiles once per bucket. The cache is indexed by
absolute position; sliding-window layers mask, they don't evict.

The cache is dense ([layers, max_slots, max_len, ...]) here; `engine.paged.PagedEngineSteps` (and the `engine_steps` factory)
overrides the three cache accesses (`_extend_all`, `_extend_slot`, `_write_prefixes`) and the
state's layout for a paged cache, and every step above is shared.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sfrrl_jax.checks import check_int
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.engine.model_step import CACHE_AXES, extend
from sfrrl_jax.engine.sampling import SamplingParams, sample
from sfrrl_jax.engine.slot_state import MAX_STOP_IDS, DecodeState, Prefix, ResultTokens, SlotRequest
from sfrrl_jax.mesh import sharding_for
from sfrrl_jax.models.transformer import moe_layer_ids

def _finish(state_like_request, token, generated, length, max_len):
    stop = jnp.any(token[..., None] == state_like_request.stop_ids, axis=-1)
    return stop | (generated >= state_like_request.max_new) | (length + 1 >= max_len)


def _expand(tree, n):
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (n,) + jnp.shape(x)), tree)


class EngineSteps:
    """Jitted steps for one (cfg, mesh, max_slots, max_len); counts their compilations."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, max_slots: int, max_len: int, buckets=None,
                 cache_dtype: str | None = None, record_routes: bool = False, decode_buckets=None):
        if record_routes and not moe_layer_ids(cfg):
            raise ValueError("record_routes=True: this model has no MoE layer to record routes of")
        self.record_routes = bool(record_routes)
        if max_len > cfg.max_seq_len:
            raise ValueError(f"engine max_len={max_len} > ModelConfig.max_seq_len={cfg.max_seq_len}")
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.cfg, self.mesh, self.max_slots, self.max_len = cfg, mesh, max_slots, max_len
        self.buckets = tuple(sorted(buckets or _default_buckets(max_len)))
        if self.buckets[-1] < max_len:
            self.buckets += (max_len,)
        self.decode_buckets = _check_decode_buckets(decode_buckets, max_len)
        self.cache_dtype = jnp.dtype(cache_dtype or cfg.compute_dtype)
        self._set_cache_shapes((cfg.n_layers, max_slots, max_len, cfg.n_kv_heads, cfg.head_dim), CACHE_AXES)
        self.slot_sharding = sharding_for(mesh, ("slots",), (max_slots,))
        # a slot's cache rows are read by a gather where the slot axis is whole on every device
        # (`model_step.extend`'s gather_slots), else by a select and sum over the slots
        self.gather_slots = not _splits(mesh, self.cache_sharding.spec, CACHE_AXES.index("slots"))
        self._init = jax.jit(self._init_impl, out_shardings=self._state_shardings())
        self._prefill = jax.jit(self._prefill_impl)
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
        self._prefill_many = jax.jit(self._prefill_many_impl, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,), static_argnums=(2, 3))
        self._append = jax.jit(self._append_impl, donate_argnums=(1,))
        self._append_many = jax.jit(self._append_many_impl, donate_argnums=(1,))
        self._prefill_at = jax.jit(self._prefill_at_impl, donate_argnums=(1,))
        self._free = jax.jit(self._free_impl, donate_argnums=(0,))

    def _set_cache_shapes(self, shape, axes) -> None:
        """The key cache's shape and sharding (`axes` its logical names), and the value cache's:
        the same but cfg.value_cache_dim wide (0 with latent attention, which reads its values
        from the keys' cache)."""
        self.cache_shape, self.cache_sharding = shape, sharding_for(self.mesh, axes, shape)
        self.value_cache_shape = shape[:-1] + (self.cfg.value_cache_dim,)
        self.value_cache_sharding = sharding_for(self.mesh, axes, self.value_cache_shape)
        # per-layer params (cfg.scan_layers=False) run their layers unrolled: a dense cache is then
        # a list of one [slots, max_len, ...] array per layer, each layer's read in place (a static
        # slice of a stacked cache is a copy on XLA:CPU). The shapes above describe it stacked.
        self.per_layer_cache = not self.cfg.scan_layers and tuple(axes) == CACHE_AXES

    def _cache_zeros(self, shape, dtype):
        """A zero cache of the stacked `shape` [layers, ...]: a per-layer list with per_layer_cache."""
        if self.per_layer_cache:
            return [jnp.zeros(shape[1:], dtype) for _ in range(shape[0])]
        return jnp.zeros(shape, dtype)

    def _cache_state_sharding(self, sharding, shape):
        if not self.per_layer_cache:
            return sharding
        return [sharding_for(self.mesh, CACHE_AXES[1:], shape[1:])] * shape[0]

    # -- sizes ----------------------------------------------------------------------------------
    def cache_bytes(self) -> int:
        return (int(np.prod(self.cache_shape)) + int(np.prod(self.value_cache_shape))) * self.cache_dtype.itemsize

    def bucket_for(self, n: int) -> int:
        if n < 1:
            raise ValueError("empty token list: nothing to prefill")
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the engine's max_len={self.max_len}")

    def pad(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens).reshape(-1)
        out = np.zeros((1, self.bucket_for(len(tokens))), np.int32)
        # the range is checked before the cast to int32, which would wrap a large id into the vocabulary
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}); got {tokens.min()}..{tokens.max()}")
        out[0, : len(tokens)] = tokens
        return out

    def compile_counts(self) -> dict:
        return {n: getattr(self, "_" + n)._cache_size() for n in
                ("init", "prefill", "insert", "prefill_many", "generate", "append", "append_many", "prefill_at",
                  "free")}

    # -- public steps (entered under the mesh) ----------------------------------------------
    def init_decode_state(self) -> DecodeState:
        with jax.set_mesh(self.mesh):
            return self._init()

    def prefill(self, params, tokens, true_length, request: SlotRequest):
        with jax.set_mesh(self.mesh):
            return self._prefill(params, tokens, np.int32(true_length), request)

    def insert(self, prefix: Prefix, state: DecodeState, slot: int, request: SlotRequest, first):
        with jax.set_mesh(self.mesh):
            return self._insert(prefix, state, np.int32(slot), request, first)

    def many_rows(self, n: int) -> int:
        """The row count `prefill_many` pads n prompts to: the next power of two, at most
        max_slots (each row count compiles once per prompt bucket)."""
        if not 1 <= n <= self.max_slots:
            raise ValueError(f"prefill_many of {n} prompts: between 1 and max_slots={self.max_slots}")
        return min(1 << (n - 1).bit_length(), self.max_slots)

    def prefill_many(self, params, state: DecodeState, slots, tokens, true_lengths, requests: list[SlotRequest],
                     sources=None):
        """Prefill and insert of n prompts in one device call: slots [n] distinct free slots,
        tokens [n, bucket] (each row padded to one bucket, `pad`), true_lengths [n], one
        SlotRequest per slot. Returns (state, first ResultTokens with fields [many_rows(n)];
        rows past n repeat row 0). Each row's results and cache are those of `prefill` +
        `insert` of that prompt alone, up to float rounding of the batched matmuls.

        sources [n] (optional): slot i's prompt is row sources[i] of tokens, which then holds the
        u distinct prompts [u, bucket] (true_lengths [u]): a prompt several slots share (the
        samples of a GRPO group) is run through the model once, and its cache rows and last
        logits go to each of those slots, which samples its first token with its own request.
        Slots sharing a prompt get bit-identical cache rows, each the cache of that prompt's row.

        Slots (and their requests and sources) are padded to `many_rows(n)`, prompts to
        `many_rows(u)`, with copies of the first: a padding slot row writes its prompt's cache
        rows (the same values, gathered from the same row) and no slot state, so the first token
        a slot keeps is always the one returned for it. Each (many_rows(u), many_rows(n), bucket)
        compiles once."""
        n = len(slots)
        rows = self.many_rows(n)
        tokens = np.asarray(tokens, np.int32)
        sources = np.arange(n, dtype=np.int32) if sources is None else np.asarray(sources, np.int32).reshape(-1)
        u = len(true_lengths)
        if len(sources) != n or len(requests) != n:
            raise ValueError(f"prefill_many: {n} slots need {n} sources and requests, got {len(sources)} and "
                             f"{len(requests)}")
        _check_sources("prefill_many", "prompt rows", sources, tokens, u)
        prompt_rows = self.many_rows(u)
        with jax.set_mesh(self.mesh):
            return self._prefill_many(params, state, _pad_rows(np.asarray(slots, np.int32), rows),
                                      _pad_rows(tokens.reshape(u, -1), prompt_rows),
                                      _pad_rows(np.asarray(true_lengths, np.int32), prompt_rows),
                                      _stacked_requests(requests, rows), _pad_rows(sources, rows),
                                      np.arange(rows) < n)

    def decode_k_len(self, longest: int) -> int:
        """The decode bucket for a chunk whose running slots hold at most `longest` cached tokens
        once the chunk ends (cached + decode steps): the smallest `decode_buckets` entry >= it."""
        for b in self.decode_buckets:
            if longest <= b:
                return b
        return self.max_len

    def generate(self, params, state: DecodeState, steps: int = 1, k_len: int | None = None):
        """`steps` decode steps of every slot. k_len (a `decode_buckets` entry; default max_len):
        attention reads cache positions < k_len only, so every running slot must end the chunk
        within it (`decode_k_len`); a slot past it (only an inactive one may be) computes garbage
        that nothing reads. Each bucket compiles once."""
        k_len = self.max_len if k_len is None else int(k_len)
        if k_len not in self.decode_buckets:
            raise ValueError(f"decode k_len={k_len} is not one of the engine's decode_buckets {self.decode_buckets}")
        with jax.set_mesh(self.mesh):
            return self._generate(params, state, steps, k_len)

    def append_prefill(self, params, state, slot, tokens, true_length, request: SlotRequest):
        with jax.set_mesh(self.mesh):
            return self._append(params, state, np.int32(slot), tokens, np.int32(true_length), request)

    def append_many(self, params, state, slots, tokens, true_lengths, requests: list[SlotRequest]):
        """`append_prefill` into n parked slots in one device call: slots [n] distinct, tokens
        [n, bucket] (each row padded to one bucket, `pad`), true_lengths [n], one SlotRequest per
        slot. Each row's results and cache are those of `append_prefill` into that slot alone, up
        to float rounding of the batched matmuls. Rows are padded to `many_rows(n)`; a padding row
        writes nothing (its cache writes fall past the cache, its state updates past the slots).
        Returns (state, first ResultTokens with fields [many_rows(n)]; rows past n are padding)."""
        n = len(slots)
        rows = self.many_rows(n)
        if len(set(int(s) for s in slots)) != n or len(true_lengths) != n or len(requests) != n:
            raise ValueError(f"append_many: {n} distinct slots need {n} token rows and requests")
        with jax.set_mesh(self.mesh):
            return self._append_many(params, state, _pad_rows(np.asarray(slots, np.int32), rows),
                                     _pad_rows(np.asarray(tokens, np.int32).reshape(n, -1), rows),
                                     _pad_rows(np.asarray(true_lengths, np.int32), rows),
                                     _stacked_requests(requests, rows), np.arange(rows) < n)

    def prefill_at_many(self, params, state, slots, tokens, starts, true_lengths, requests: list[SlotRequest],
                        sources=None):
        """Prefill of n prompts whose first tokens slot i's cache holds already (paged: pages
        shared from the prefix cache, `engine.prefix_cache`): slots [n] distinct free slots, one
        SlotRequest per slot; tokens [u, bucket] the u distinct prompts' remaining tokens (each row
        padded to one bucket, `pad`), starts [u] where they start, true_lengths [u] their counts;
        sources [n] (default: row i for slot i) the row of each slot. A row is computed into the
        first slot that names it; the others (a prompt several slots share) hold its full pages
        already (`PageTable` sharing) and get a copy of the rest (`_copy_rows`). Each slot then
        holds its whole prompt and samples its first token as after `prefill_many` (draw 0); logits
        equal a full prefill's up to float rounding (the rest reads the prefix's keys from the cache
        instead of computing them alongside). Slots are padded to `many_rows(n)`, rows to
        `many_rows(u)`; padding writes nothing. Returns (state, first ResultTokens [many_rows(n)])."""
        n = len(slots)
        rows = self.many_rows(n)
        slots = np.asarray(slots, np.int32).reshape(-1)
        sources = np.arange(n, dtype=np.int32) if sources is None else np.asarray(sources, np.int32).reshape(-1)
        u = len(true_lengths)
        if len(set(slots.tolist())) != n or len(requests) != n or len(sources) != n or len(starts) != u:
            raise ValueError(f"prefill_at_many: {n} distinct slots need {n} requests and sources, and the {u} rows "
                             f"{u} starts")
        _check_sources("prefill_at_many", "rows", sources, tokens, u)
        owners = np.asarray([slots[sources.tolist().index(r)] for r in range(u)], np.int32)
        row_count = self.many_rows(u)
        with jax.set_mesh(self.mesh):
            return self._prefill_at(params, state, _pad_rows(slots, rows),
                                    _pad_rows(np.asarray(tokens, np.int32).reshape(u, -1), row_count),
                                    _pad_rows(np.asarray(starts, np.int32), row_count),
                                    _pad_rows(np.asarray(true_lengths, np.int32), row_count),
                                    _stacked_requests(requests, rows), np.arange(rows) < n, _pad_rows(sources, rows),
                                    _pad_rows(owners, row_count), np.arange(row_count) < u)

    def free_resource(self, state: DecodeState, slot: int) -> DecodeState:
        with jax.set_mesh(self.mesh):
            return self._free(state, np.int32(slot))

    # -- implementations --------------------------------------------------------------------
    def _state_shardings(self):
        s = self.slot_sharding
        req = SlotRequest(
            sampling=SamplingParams(temperature=s, top_k=s, top_p=s, seed=s), max_new=s,
            stop_ids=sharding_for(self.mesh, ("slots", None), (self.max_slots, MAX_STOP_IDS)),
        )
        return DecodeState(cache_k=self._cache_state_sharding(self.cache_sharding, self.cache_shape),
                           cache_v=self._cache_state_sharding(self.value_cache_sharding, self.value_cache_shape),
                           lengths=s,
                           last_token=s, generated=s, draws=s, active=s, request=req)

    def _init_impl(self):
        n = self.max_slots
        zeros = jnp.zeros((n,), jnp.int32)
        return DecodeState(
            cache_k=self._cache_zeros(self.cache_shape, self.cache_dtype),
            cache_v=self._cache_zeros(self.value_cache_shape, self.cache_dtype),
            lengths=zeros, last_token=zeros, generated=zeros, draws=zeros,
            active=jnp.zeros((n,), bool),
            request=_expand(SlotRequest.make(), n),
        )

    def _sample_one(self, logits, request, draws):
        """logits [1, 1, vocab] (one row's last token) -> its (token, logprob, raw logprob)."""
        tok, lp, raw = sample(logits[:, 0], _expand(request.sampling, 1), jnp.reshape(draws, (1,)))
        return tok[0], lp[0], raw[0]

    def _prefill_forward(self, params, tokens, true_lengths):
        """Prefill of tokens [u, t] (true_lengths [u]) from an empty cache: (cache_k [layers, u,
        t, kv_heads, head_dim], cache_v (cfg.value_cache_dim wide), the last token's logits [u,
        vocab], routes [u, t, moe layers, top_k] or None)."""
        u, t = tokens.shape
        cfg = self.cfg
        shape = (cfg.n_layers, u, t, cfg.n_kv_heads, cfg.head_dim)
        ck = self._cache_zeros(shape, self.cache_dtype)
        cv = self._cache_zeros(shape[:-1] + (cfg.value_cache_dim,), self.cache_dtype)
        logits, ck, cv, *routes = extend(cfg, params, tokens, jnp.zeros((u,), jnp.int32), ck,
                                         cv, true_lengths, self.record_routes,
                                         logits_at=true_lengths - 1)
        return ck, cv, logits[:, 0], routes[0] if routes else None

    def _first_tokens(self, logits, true_lengths, request, routes) -> ResultTokens:
        """Each row's first token from its prompt's last logits [n, vocab] (true_lengths [n],
        request fields [n, ...], routes [n, ...] or None)."""
        n = logits.shape[0]
        tok, lp, raw = sample(logits, request.sampling, jnp.zeros((n,), jnp.int32))
        done = _finish(request, tok, 1, true_lengths, self.max_len)
        return ResultTokens(tokens=tok, logprobs=lp, raw_logprobs=raw, valid=jnp.ones((n,), bool), done=done,
                            routes=routes)

    def _prefill_rows(self, params, tokens, true_lengths, request):
        """Prefill of tokens [n, t] (true_lengths [n], request fields [n, ...]) from an empty
        cache: (cache_k [layers, n, t, kv_heads, head_dim], cache_v (cfg.value_cache_dim wide), first
        ResultTokens [n])."""
        ck, cv, logits, routes = self._prefill_forward(params, tokens, true_lengths)
        return ck, cv, self._first_tokens(logits, true_lengths, request, routes)

    def _prefill_many_impl(self, params, state: DecodeState, slots, tokens, true_lengths, request, sources, real):
        # the distinct prompts once; each slot takes its prompt's cache rows and logits (a gather)
        ck, cv, logits, routes = self._prefill_forward(params, tokens, true_lengths)
        lengths = true_lengths[sources]
        first = self._first_tokens(logits[sources], lengths, request, None if routes is None else routes[sources])
        state = self._write_prefixes(state, slots, _cache_rows(ck, sources), _cache_rows(cv, sources))
        owned = jnp.where(real, slots, self.max_slots)   # a padding row's state update is dropped
        state = self._set_slot(state, owned, lengths, first, request, jnp.ones_like(slots))
        return state, self._on_every_host(first)

    def _prefill_impl(self, params, tokens, true_length, request):
        ck, cv, first = self._prefill_rows(params, tokens, jnp.reshape(true_length, (1,)), _expand(request, 1))
        first = jax.tree.map(lambda x: x[0], first)
        return Prefix(cache_k=ck, cache_v=cv, true_length=true_length), self._on_every_host(first)

    def _on_every_host(self, results: ResultTokens) -> ResultTokens:
        """Results replicated over the mesh: every process (multi-host) reads the tokens from its
        own devices, and one process's host never needs another's shards (a few bytes a slot)."""
        return jax.lax.with_sharding_constraint(results, NamedSharding(self.mesh, P()))

    def _set_slot(self, state: DecodeState, slot, length, first: ResultTokens, request, draws):
        """Slot `slot` starts decoding after its first token (slot, length, draws scalars, or
        [n] each with first's and request's fields [n, ...] for n slots at once)."""
        upd = lambda arr, v: arr.at[slot].set(v)
        state.lengths = upd(state.lengths, length)
        state.last_token = upd(state.last_token, first.tokens)
        state.generated = upd(state.generated, 1)
        state.draws = upd(state.draws, draws)
        state.active = upd(state.active, ~first.done)
        state.request = jax.tree.map(upd, state.request, request)
        return state

    # -- cache access (dense here; engine.paged overrides) ---------------------------------------
    def _extend_all(self, params, state: DecodeState, tokens, starts, valid_len, with_routes=False, k_len=None):
        """`extend` over every slot, reading cache positions < k_len (default all): (logits,
        new cache_k, new cache_v), then with_routes the routes [slots, t, moe layers, top_k]."""
        return extend(self.cfg, params, tokens, starts, state.cache_k, state.cache_v, valid_len, with_routes,
                      k_len)

    def _extend_slot(self, params, state: DecodeState, slot, tokens, start, valid_len, cast=False,
                     with_routes=False, logits_at=None):
        """`extend` of one slot's sequence, tokens [1, t] at start..: (logits, state), then
        with_routes the routes [1, t, moe layers, top_k]; logits_at [1] as `extend`'s. `cast`
        converts the written rows to the cache dtype once more (the restorer's historical form; a
        no-op for values `extend` already wrote in that dtype)."""
        logits, ck, cv, *routes = extend(self.cfg, params, tokens, jnp.reshape(start, (1,)), state.cache_k,
                                         state.cache_v, jnp.reshape(valid_len, (1,)), with_routes,
                                         logits_at=logits_at, slots=jnp.reshape(slot, (1,)),
                                         gather_slots=self.gather_slots)
        if cast:
            ck, cv = (jax.tree.map(lambda c: c.astype(self.cache_dtype), x) for x in (ck, cv))
        state.cache_k, state.cache_v = ck, cv
        return (logits, state, *routes)

    def _extend_slots(self, params, state: DecodeState, slots, tokens, starts, valid_len, with_routes=False,
                      logits_at=None):
        """`extend` of n slots' sequences, tokens [n, t] at starts [n]..: (logits, state), then
        with_routes the routes [n, t, moe layers, top_k]; logits_at [n] as `extend`'s."""
        logits, ck, cv, *routes = extend(self.cfg, params, tokens, starts, state.cache_k, state.cache_v, valid_len,
                                         with_routes, logits_at=logits_at, slots=slots,
                                         gather_slots=self.gather_slots)
        state.cache_k, state.cache_v = ck, cv
        return (logits, state, *routes)

    def _write_prefix(self, state: DecodeState, slot, prefix: Prefix) -> DecodeState:
        """The prefill's cache (positions 0..bucket-1) into `slot`."""
        return self._write_prefixes(state, jnp.reshape(slot, (1,)), prefix.cache_k, prefix.cache_v)

    def _write_prefixes(self, state: DecodeState, slots, cache_k, cache_v) -> DecodeState:
        """Prefill caches cache_k/v [layers, n, bucket, kv_heads, head_dim] (positions
        0..bucket-1) into slots [n] (a slot named twice gets the same values twice)."""
        if isinstance(state.cache_k, list):   # per-layer caches: cache_k/v are lists of [n, bucket, ...]
            t = cache_k[0].shape[1]
            state.cache_k = [c.at[slots, :t].set(p.astype(self.cache_dtype)) for c, p in zip(state.cache_k, cache_k)]
            state.cache_v = [c.at[slots, :t].set(p.astype(self.cache_dtype)) for c, p in zip(state.cache_v, cache_v)]
            return state
        t = cache_k.shape[2]
        state.cache_k = state.cache_k.at[:, slots, :t].set(cache_k.astype(self.cache_dtype))
        state.cache_v = state.cache_v.at[:, slots, :t].set(cache_v.astype(self.cache_dtype))
        return state

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, request, first):
        state = self._write_prefix(state, slot, prefix)
        return self._set_slot(state, slot, prefix.true_length, first, request, jnp.int32(1))

    def _generate_impl(self, params, state: DecodeState, steps: int, k_len: int | None = None):
        def one(state, _):
            was_active = state.active
            logits, ck, cv, *routes = self._extend_all(params, state, state.last_token[:, None], state.lengths,
                                                       state.lengths + 1, self.record_routes, k_len)
            tok, lp, raw = sample(logits[:, 0], state.request.sampling, state.draws)
            lengths = state.lengths + was_active
            generated = state.generated + was_active
            done = was_active & _finish(state.request, tok, generated, lengths, self.max_len)
            new = DecodeState(
                cache_k=ck, cache_v=cv, lengths=lengths,
                last_token=jnp.where(was_active, tok, state.last_token), generated=generated,
                draws=state.draws + was_active, active=was_active & ~done, request=state.request,
                page_table=state.page_table,
            )
            return new, ResultTokens(tokens=tok, logprobs=lp, raw_logprobs=raw, valid=was_active, done=done,
                                     routes=routes[0][:, 0] if routes else None)

        # Inactive slots compute too (fixed shapes) but their cache rows, lengths and tokens
        # are left as they were: a parked slot's KV stays intact.
        state, results = jax.lax.scan(one, state, None, length=steps)
        return state, self._on_every_host(results)

    def _append_impl(self, params, state: DecodeState, slot, tokens, true_length, request):
        start = state.lengths[slot]
        logits, state, *routes = self._extend_slot(params, state, slot, tokens, start, start + true_length,
                                                   with_routes=self.record_routes,
                                                   logits_at=jnp.reshape(true_length - 1, (1,)))
        draws = state.draws[slot]
        tok, lp, raw = self._sample_one(logits, request, draws)
        length = start + true_length
        done = _finish(request, tok, 1, length, self.max_len)
        first = ResultTokens(tokens=tok, logprobs=lp, raw_logprobs=raw, valid=jnp.bool_(True), done=done,
                             routes=routes[0][0] if routes else None)
        return self._set_slot(state, slot, length, first, request, draws + 1), self._on_every_host(first)

    def _prefill_at_impl(self, params, state, slots, tokens, starts, true_lengths, request, real, sources, owners,
                         real_rows):
        # each distinct row once, into its first slot; a padding row starts past the cache (its
        # writes are dropped, or land on a scratch page)
        start = jnp.where(real_rows, starts, self.max_len)
        logits, state, *routes = self._extend_slots(params, state, owners, tokens, start, start + true_lengths,
                                                    with_routes=self.record_routes, logits_at=true_lengths - 1)
        lengths = (start + true_lengths)[sources]
        src = owners[sources]
        state = self._copy_rows(state, src, slots, lengths, real & (src != slots))
        # its first token is the request's first draw, as after a prefill
        first = self._first_tokens(logits[sources, 0], lengths, request, routes[0][sources] if routes else None)
        first.valid = real
        owned = jnp.where(real, slots, self.max_slots)   # past the slots: the update is dropped
        return self._set_slot(state, owned, lengths, first, request, jnp.ones_like(slots)), self._on_every_host(first)

    def _copy_rows(self, state: DecodeState, src, dst, lengths, mask) -> DecodeState:
        """Slot dst[i] gets slot src[i]'s cache rows below lengths[i] where mask[i] (the dense
        cache copies the whole row; `engine.paged` only what the slots do not share)."""
        dst = jnp.where(mask, dst, self.max_slots)   # past the slots: dropped
        if isinstance(state.cache_k, list):
            state.cache_k = [c.at[dst].set(c[src], mode="drop") for c in state.cache_k]
            state.cache_v = [c.at[dst].set(c[src], mode="drop") for c in state.cache_v]
            return state
        state.cache_k = state.cache_k.at[:, dst].set(state.cache_k[:, src], mode="drop")
        state.cache_v = state.cache_v.at[:, dst].set(state.cache_v[:, src], mode="drop")
        return state

    def _append_many_impl(self, params, state, slots, tokens, true_lengths, request, real):
        # a padding row (real False) repeats row 0's slot for its reads, starts past the cache
        # (its writes are dropped, or land on a scratch page) and sets no slot state
        start = jnp.where(real, state.lengths[slots], self.max_len)
        logits, state, *routes = self._extend_slots(params, state, slots, tokens, start, start + true_lengths,
                                                    with_routes=self.record_routes, logits_at=true_lengths - 1)
        draws = state.draws[slots]
        tok, lp, raw = sample(logits[:, 0], request.sampling, draws)
        length = start + true_lengths
        done = _finish(request, tok, 1, length, self.max_len)
        first = ResultTokens(tokens=tok, logprobs=lp, raw_logprobs=raw, valid=real, done=done,
                             routes=routes[0] if routes else None)
        owned = jnp.where(real, slots, self.max_slots)   # past the slots: the update is dropped
        return self._set_slot(state, owned, length, first, request, draws + 1), self._on_every_host(first)

    def _free_impl(self, state: DecodeState, slot):
        state.active = state.active.at[slot].set(False)
        state.lengths = state.lengths.at[slot].set(0)
        state.generated = state.generated.at[slot].set(0)
        return state


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """a [m, ...] padded to [rows, ...] with copies of its first row (a batched step's fixed shape)."""
    return np.concatenate([a, np.repeat(a[:1], rows - len(a), axis=0)], axis=0)


def _stacked_requests(requests: list[SlotRequest], rows: int) -> SlotRequest:
    """One SlotRequest per slot as one with fields [rows, ...], padded with copies of the first."""
    return jax.tree.map(lambda *xs: _pad_rows(np.stack([np.asarray(x) for x in xs]), rows), *requests)


def _check_sources(step: str, what: str, sources: np.ndarray, tokens, u: int) -> None:
    """sources [n] must name each of the u rows of tokens [u, bucket] (and nothing else)."""
    if u < 1 or np.asarray(tokens).size % u or sources.min() < 0 or sources.max() >= u \
            or len(set(sources.tolist())) != u:
        raise ValueError(f"{step}: sources must name each of the {u} {what}, got {sources.tolist()}")


def _splits(mesh: Mesh, spec, dim: int) -> bool:
    """Whether a sharding's PartitionSpec `spec` splits dimension `dim` over more than one device."""
    entry = spec[dim] if dim < len(spec) else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return int(np.prod([mesh.shape[n] for n in names], dtype=np.int64)) > 1


def _check_decode_buckets(decode_buckets, max_len: int) -> tuple[int, ...]:
    """The decode chunk's cache-read lengths, ascending, ending at max_len. Default: max_len / 8,
    / 4, / 2 and max_len, none below 128: four compilations of the decode chunk at most, and a
    chunk reads at most twice its longest slot's cache once that exceeds max_len / 8 (on CPU,
    attention over the whole cache was 17-35 % of a decode step at a quarter-full cache)."""
    if decode_buckets is None:
        out = {max_len >> k for k in range(4) if (max_len >> k) >= 128} | {max_len}
    else:
        out = set()
        for i, b in enumerate(decode_buckets):
            check_int(f"decode_buckets[{i}]", b, 1, max_len)
            out.add(int(b))
        out.add(max_len)
    return tuple(sorted(out))


def _default_buckets(max_len: int) -> tuple[int, ...]:
    out, b = [], 16
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_len,)


def _cache_rows(cache, rows):
    """Rows `rows` of every layer of a cache [layers, n, ...] (or a per-layer list of [n, ...])."""
    return [c[rows] for c in cache] if isinstance(cache, list) else cache[:, rows]
