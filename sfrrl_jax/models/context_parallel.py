"""Context parallelism: one training sequence split over the mesh's `context` axis (and its
`expert` axis when the rows do not split over it).

The sequence axes of a [rows, seq] forward are `mesh.seq_axes(mesh, rows)`: `context`, preceded
by `expert` where `batch` could not use it (one 1M-token row on expert=16 splits its sequence
16 ways instead of holding 16 replicas of it outside the MoE layer). With c = the product of
their sizes > 1, every activation [batch, seq, ...] of the training forward has its `seq` dim
split into c shards (`mesh.LOGICAL_AXIS_RULES['seq']`); below, "context" means those axes
together (collectives over a tuple of axes run over their product, first axis major, the order
the seq dim's sharding uses). Everything in a layer except
attention is per token, so it needs nothing more; attention needs every query to meet every key
it may see. Three choices, made on purpose:

1. **All-gather K/V, not a ring.** Each device keeps its own queries and all-gathers the keys and
   values (and their positions and segment ids) along `context`, then runs the ordinary
   memory-lean attention core (`models.attention.blockwise_attention`) of its queries against the
   whole sequence. A ring (pass K/V chunks around c times, overlapping each transfer with a block
   of compute) moves the same bytes; it saves the transient full-sequence K/V of one layer but needs
   its own c-step forward and backward. With grouped-query attention K and V are small (gpt-oss:
   8 kv heads x 64 = 1 KiB per token each in bf16, against 4 KiB of queries), so the gathered K/V
   of one layer at a time (1M tokens: 2 GiB, freed after the layer; recomputed in the backward
   under remat) is affordable, and one collective per layer is simpler for XLA to schedule than c
   permutes. Llama 3 made the same call for the same reasons. Masks are computed from the gathered
   positions and segment ids, so packed segments, causality, sliding windows and sinks hold by
   construction. The backward of the all-gather is a reduce-scatter of dK/dV, which JAX derives.
2. **Zig-zag order for causal balance.** Under a causal mask the last shard of a sequence has c
   times the work of the first. The forward therefore reorders the sequence once, at the input:
   it is cut into 2c chunks and device i holds chunks i and 2c-1-i (`to_zigzag`), so every device
   has the same number of (query, key) pairs. The mask uses positions and segment ids (values that
   travel with each token), never indices, so the order is invisible to the math; the final
   hidden states go back to natural order (`from_zigzag`) before the LM head, and the loss sees
   natural order. Both reorders are two `ppermute`s of one chunk each: no device ever holds more
   than its own shard.
3. **Padding.** The sequence must split into 2c equal chunks: the forward pads it with tokens of
   segment `CONTEXT_PAD_SEGMENT` (-1), which match no real segment (and, being < 1, are outside
   the router statistics), and slices them off at the end.

Functions here are traceable; they read the sequence axes from the mesh in context and the rows
of their inputs (the caller runs under `jax.set_mesh` / the abstract mesh, as every model
function does).
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sfrrl_jax.mesh import concrete_mesh_in_trace, seq_axes

CONTEXT_PAD_SEGMENT = -1


def _mesh():
    # the concrete mesh when the model runs inside a user's jit on params closed over (mesh.py)
    return concrete_mesh_in_trace() or jax.sharding.get_abstract_mesh()


def context_axes(rows: int) -> tuple[str, ...]:
    """The mesh axes a [rows, seq] sequence is split over (`mesh.seq_axes`; () without a mesh)."""
    return seq_axes(_mesh(), rows)


def context_size(rows: int) -> int:
    """How many shards a [rows, seq] sequence is split into (1 without sequence axes)."""
    return _shards(context_axes(rows))


def _shards(axes: tuple[str, ...]) -> int:
    return math.prod(_mesh().shape[a] for a in axes)


def _shard_over_context(fn: Callable, axes: tuple[str, ...], n_in: int, replicated: int = 0,
                        n_out: int | None = None):
    """`fn` as a shard_map that is manual over the sequence axes `axes` only: the first `n_in`
    args are [batch, seq, ...] split over them along seq, the next `replicated` args are whole
    on every shard; the output (a tuple of `n_out` outputs if given) is split like the first
    args. Other mesh axes stay automatic (the batch keeps its data/expert split, heads their
    tensor split)."""
    seq = P(None, axes)
    specs = (seq,) * n_in + (P(),) * replicated
    out_specs = seq if n_out is None else (seq,) * n_out

    def call(*args):
        # A replicated arg's gradient is summed over the shards (a psum in the backward). 16-bit
        # floats enter widened to f32 and are narrowed back inside (exact), so that sum runs in
        # f32: more accurate, and XLA:CPU aborts compiling a bf16 all-reduce ("Invalid binary
        # instruction opcode copy" in its all-reduce promotion).
        dtypes = [a.dtype for a in args[n_in:]]
        inner = lambda *xs: fn(*xs[:n_in], *(x.astype(d) for x, d in zip(xs[n_in:], dtypes)))
        mapped = jax.shard_map(inner, mesh=_mesh(), in_specs=specs, out_specs=out_specs,
                               axis_names=frozenset(axes), check_vma=False)
        return mapped(*args[:n_in], *(_widened(a) for a in args[n_in:]))

    return call


def _widened(x):
    """x as f32 when it is a 16-bit float (bf16, f16), else x."""
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4 else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_seq(x, axes: tuple[str, ...]):
    """all_gather of [batch, seq_shard, ...] over the sequence axes into [batch, seq, ...], whose
    backward reduce-scatters the cotangent in f32 (see `_shard_over_context`'s call)."""
    return jax.lax.all_gather(x, axes, axis=1, tiled=True)


def _gather_seq_fwd(x, axes):
    return _gather_seq(x, axes), None


def _gather_seq_bwd(axes, _, cotangent):
    summed = jax.lax.psum_scatter(_widened(cotangent), axes, scatter_dimension=1, tiled=True)
    return (summed.astype(cotangent.dtype),)


_gather_seq.defvjp(_gather_seq_fwd, _gather_seq_bwd)


def per_context_shard(fn: Callable, seq_args: tuple, replicated_args: tuple = (), n_out: int = 1):
    """Runs a per-token function on each context shard of its sequence inputs, locally.

    fn(*seq_args_shard, *replicated_args) -> `n_out` arrays [batch, seq_shard, ...] (a tuple if
    n_out > 1); seq_args: [batch, seq, ...] arrays, padded with zeros to a multiple of the
    context size and split over it; replicated_args: whole on every shard (weights). Use it for
    work that is independent per token but scans over seq inside (the chunked LM-head logprobs):
    under the automatic partitioner such a scan would gather the whole sequence on every device.
    Outputs are cut back to seq. Without a context axis this is `fn(*seq_args, *replicated_args)`.
    """
    axes = context_axes(seq_args[0].shape[0])
    if not axes:
        return fn(*seq_args, *replicated_args)
    c = _shards(axes)
    t = seq_args[0].shape[1]
    pad = -t % c

    def padded(x):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x

    out = _shard_over_context(fn, axes, len(seq_args), len(replicated_args), None if n_out == 1 else n_out)(
        *(padded(x) for x in seq_args), *replicated_args)
    return out[:, :t] if n_out == 1 else tuple(o[:, :t] for o in out)


# -- the zig-zag reorder -------------------------------------------------------------------------
# Natural order: device i holds chunks (2i, 2i+1). Zig-zag: device j holds chunks (j, 2c-1-j).

def _home(chunk: int, c: int) -> int:
    """The device that holds `chunk` in zig-zag order."""
    return chunk if chunk < c else 2 * c - 1 - chunk


def _to_zigzag_local(x, c: int, axes: tuple[str, ...]):
    n = x.shape[1] // 2
    first, second = x[:, :n], x[:, n:]                       # chunks 2i and 2i+1
    r_even = jax.lax.ppermute(first, axes, [(i, _home(2 * i, c)) for i in range(c)])
    r_odd = jax.lax.ppermute(second, axes, [(i, _home(2 * i + 1, c)) for i in range(c)])
    # Device j receives chunks j and 2c-1-j, one even and one odd; chunk j goes first.
    j_even = jax.lax.axis_index(axes) % 2 == 0
    return jnp.where(j_even, jnp.concatenate([r_even, r_odd], 1), jnp.concatenate([r_odd, r_even], 1))


def _from_zigzag_local(x, c: int, axes: tuple[str, ...]):
    n = x.shape[1] // 2
    mine, mirror = x[:, :n], x[:, n:]                        # chunks j and 2c-1-j
    j_even = jax.lax.axis_index(axes) % 2 == 0
    even, odd = jnp.where(j_even, mine, mirror), jnp.where(j_even, mirror, mine)
    even_chunk = [j if j % 2 == 0 else 2 * c - 1 - j for j in range(c)]
    odd_chunk = [2 * c - 1 - j if j % 2 == 0 else j for j in range(c)]
    back_even = jax.lax.ppermute(even, axes, [(j, even_chunk[j] // 2) for j in range(c)])
    back_odd = jax.lax.ppermute(odd, axes, [(j, odd_chunk[j] // 2) for j in range(c)])
    return jnp.concatenate([back_even, back_odd], 1)


def to_zigzag(x: jax.Array) -> jax.Array:
    """[batch, seq, ...] in natural order -> the same values in zig-zag order (seq a multiple of
    2 x context). Identity without sequence axes."""
    axes = context_axes(x.shape[0])
    if not axes:
        return x
    c = _shards(axes)
    return _shard_over_context(lambda a: _to_zigzag_local(a, c, axes), axes, 1)(x)


def from_zigzag(x: jax.Array) -> jax.Array:
    """Inverse of `to_zigzag`."""
    axes = context_axes(x.shape[0])
    if not axes:
        return x
    c = _shards(axes)
    return _shard_over_context(lambda a: _from_zigzag_local(a, c, axes), axes, 1)(x)


def zigzag_permutation(seq_len: int, c: int):
    """Host helper (tests, docs): index array p with to_zigzag(x)[:, k] == x[:, p[k]]."""
    n = seq_len // (2 * c)
    order = []
    for j in range(c):
        order += list(range(j * n, (j + 1) * n)) + list(range((2 * c - 1 - j) * n, (2 * c - j) * n))
    return order


def pad_for_context(tokens, segment_ids, positions):
    """Pads [batch, seq] inputs so seq splits into 2 x context equal chunks. Returns the padded
    (tokens, segment_ids, positions) and the original seq length (to slice outputs back)."""
    c = context_size(tokens.shape[0])
    t = tokens.shape[1]
    pad = -t % (2 * c) if c > 1 else 0
    if pad:
        widths = ((0, 0), (0, pad))
        tokens = jnp.pad(tokens, widths)
        segment_ids = jnp.pad(segment_ids, widths, constant_values=CONTEXT_PAD_SEGMENT)
        positions = jnp.pad(positions, widths)
    return tokens, segment_ids, positions, t


# -- attention -----------------------------------------------------------------------------------

def context_parallel_attention(core: Callable, q, k, v, positions, segment_ids, window, sinks):
    """Self-attention of a sequence split over `context`: local queries against all-gathered
    keys/values (module doc, choice 1).

    core(q, k, v, q_pos, k_pos, q_seg, k_seg, window, sinks) -> out: the attention core (e.g.
    `blockwise_attention` with its block sizes bound); q [batch, seq, heads, head_dim], k, v
    [batch, seq, kv_heads, head_dim], positions, segment_ids [batch, seq] (seq split over context,
    any order: masks come from the values); window int scalar; sinks [heads] or None.
    Returns [batch, seq, heads, head_dim], split like q.
    """
    axes = context_axes(q.shape[0])

    def gather(x):  # positions and segment ids have no gradient: a plain all_gather
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return _gather_seq(x, axes) if floating else jax.lax.all_gather(x, axes, axis=1, tiled=True)

    def body(q, k, v, pos, seg, window, *maybe_sinks):
        s = maybe_sinks[0] if maybe_sinks else None
        return core(q, gather(k), gather(v), pos, gather(pos), seg, gather(seg), window, s)

    args = (q, k, v, positions, segment_ids, jnp.asarray(window, jnp.int32))
    if sinks is not None:
        return _shard_over_context(body, axes, 5, 2)(*args, sinks)
    return _shard_over_context(body, axes, 5, 1)(*args)
