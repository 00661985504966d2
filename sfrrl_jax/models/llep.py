"""Least-loaded expert parallelism (LLEP, Nguyen et al., arXiv 2601.17111): the MoE dispatch that
spills the excess tokens of overloaded experts, with those experts' weights, to the least-loaded
devices of the `expert` axis. Same function as standard EP (dropless, exact), with gradients.

Runs per device inside the MoE layer's `shard_map` (`moe_experts` with cfg.moe_dispatch='llep').
Notation: S devices on the expert axis, E experts, n_local = E / S native experts per device,
n tokens and a = n * k (token, expert) assignments per device, T = S * a per expert-parallel group.

Per forward:
  1. load: each device bincounts its assignments per expert; `all_gather` over `expert` gives
     counts [S, E] on every device, so every device computes the same plan from the same numbers.
  2. plan (`plan_spill`, on device, integer, deterministic): if the busiest device's native load
     is below `threshold` x the mean (a = T / S) nothing moves (standard EP). Otherwise least-loaded
     assignment, as in the paper: experts heaviest first; the native device keeps what fits under
     the capacity C = ceil(capacity_factor * a) (counting its native experts still to come), the
     rest is water-filled onto the other devices with the lowest effective load, up to C each.
     Only the `spill_slots` (Z) heaviest experts may spill: their weights travel in a static
     [Z, ...] table. Result: rows [E, S], how many of expert e's assignments device h computes;
     expert e's assignments in (source device, local order) are cut into consecutive segments
     for devices 0..S-1.
  3. weights: slot z holds the z-th heaviest expert; its native device fills the slot, zeros
     elsewhere, and a `psum` over `expert` gives every device the [Z, ...] guest table. A device
     computes groups [its n_local natives, Z guests] with one grouped matmul per matrix.
  4. tokens travel like the ragged path (`exchange`: `ragged_all_to_all` on GPU/TPU, its all-gather
     emulation on CPU), compute, and the same exchange brings the results home, where they are
     combined with the routing weights.

Static buffer sizes (rows of [embed]) and why they suffice (so no token is ever dropped):
  padded: send [S, a] and receive [S, a] per device, the FFN runs over S * a rows (the worst case:
          every assignment of the group on one device).
  llep:   send a rows; receive and FFN over R = max(ceil(threshold * a), ceil(capacity_factor * a),
          ceil(n_local * T / (n_local + Z))) rows. Why: below the threshold every device's native
          load is < threshold * a; above it, a device that ever got under C stays under C (spills
          only fill up to C), and one that never did holds only non-spillable experts (each at most
          as heavy as the (Z+1)-th heaviest, x say): at most min(n_local * x, T - Z * x) <=
          n_local * T / (n_local + Z). With Z = 2 * n_local that is T / 3 (vs T for padded); the
          guest table costs Z experts' weights per device.
  On CPU the exchange is the all-gather emulation, which holds [S, a] rows in transit (the same
  as padded's receive buffer); the FFN buffers are R rows. On GPU/TPU `ragged_all_to_all` writes
  straight into the R-row buffer. Caveat: XLA:CPU lowers `ragged_dot` to a dot over every group
  (cost ~ rows x groups), and R * (n_local + Z) >= n_local * S * a by the bound above, so on CPU
  LLEP's FFN bytes and FLOPs are not below padded's (experiments/bench/moe_dispatch.py); the
  smaller-buffer win needs a grouped-GEMM `ragged_dot` (cost ~ rows). What drops on any backend
  is the most rows one device computes (balanced to ~capacity_factor x the mean under skew).

Knobs: threshold = ModelConfig.llep_threshold (lambda, default 1.3 as the authors' code),
capacity_factor alpha = 1.1 (the authors' code default), spill_slots Z = min(E, 2 * n_local).
The paper's minimum GEMM chunk (m) is not applied: every spill chunk is taken, however small.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import EXPERT_AXIS

CAPACITY_FACTOR = 1.1


def default_spill_slots(n_experts: int, n_shards: int) -> int:
    return min(n_experts, 2 * (n_experts // n_shards))


def buffer_rows(a: int, n_shards: int, n_local: int, threshold: float, capacity_factor: float,
                spill_slots: int) -> int:
    """R: the rows one device receives and computes at most (see the module doc), <= S * a."""
    total = n_shards * a
    rows = max(math.ceil(threshold * a), math.ceil(capacity_factor * a),
               math.ceil(n_local * total / (n_local + spill_slots)))
    return min(total, rows)


def plan_spill(counts, n_local: int, a: int, threshold: float, capacity_factor: float, spill_slots: int):
    """counts [S, E] int (assignments of source device s to expert e) ->
    (rows [E, S] int32: how many of expert e's assignments device h computes (sums to the load),
     slot_experts [Z] int32: the spillable experts, heaviest first; slot z holds expert slot_experts[z]).

    Plain integer array code (runs under jit on every device, or on the host for benchmarks).
    """
    n_shards, n_experts = counts.shape
    load = jnp.sum(counts, axis=0).astype(jnp.int32)                       # [E]
    native_load = jnp.sum(load.reshape(n_shards, n_local), axis=1)        # [S]
    by_load = jnp.argsort(-load, stable=True).astype(jnp.int32)           # heaviest first, ties by id
    cap = math.ceil(capacity_factor * a)
    devices = jnp.arange(n_shards)

    def place(r, state):
        assigned, pending, rows = state
        e = by_load[r]
        ell = load[e]
        g = e // n_local
        pending = pending.at[g].add(-ell)
        eff = assigned + pending          # what each device holds now plus its natives still to come
        keep = jnp.clip(cap - eff[g], 0, ell)
        avail = jnp.where(devices == g, 0, jnp.maximum(cap - eff, 0))
        helpers = jnp.argsort(eff, stable=True)                           # least loaded first
        room = avail[helpers]
        before = jnp.cumsum(room) - room
        chunk = jnp.zeros_like(avail).at[helpers].set(jnp.clip(ell - keep - before, 0, room))
        # S * cap >= T leaves room for everything; anything left would stay native (still exact)
        spill = chunk.at[g].add(ell - jnp.sum(chunk))
        row = jnp.where(r < spill_slots, spill, jnp.where(devices == g, ell, 0))
        return assigned + row, pending, rows.at[e].set(row)

    init = (jnp.zeros(n_shards, jnp.int32), native_load.astype(jnp.int32),
            jnp.zeros((n_experts, n_shards), jnp.int32))
    _, _, lla = jax.lax.fori_loop(0, n_experts, place, init)
    native = jnp.where((jnp.arange(n_experts) // n_local)[:, None] == devices[None, :], load[:, None], 0)
    balanced = jnp.max(native_load).astype(jnp.float32) < threshold * a
    return jnp.where(balanced, native, lla).astype(jnp.int32), by_load[:spill_slots]


def _guest_weights(w: dict, slot_experts, n_local: int) -> dict:
    """[n_local + Z, ...] weights: the natives, then the spillable experts' weights (psum-broadcast
    from their native devices: exactly one device contributes each slot)."""
    me = jax.lax.axis_index(EXPERT_AXIS)
    mine = slot_experts // n_local == me
    local = slot_experts % n_local
    out = {}
    def with_guests(v):   # every array of a weight (an adapted one's base, a and b alike)
        mask = mine.reshape((-1,) + (1,) * (v.ndim - 1))
        guests = jax.lax.psum(jnp.where(mask, v[local], 0), EXPERT_AXIS)
        return jnp.concatenate([v, guests.astype(v.dtype)], axis=0)

    for name, v in w.items():
        out[name] = jax.tree.map(with_guests, v)
    return out


def dispatch_compute_combine(cfg: ModelConfig, n_shards: int, x, ids, weights, w: dict, *,
                             ffn: Callable, exchange: Callable, capacity_factor: float = CAPACITY_FACTOR,
                             spill_slots: int | None = None):
    """Per-device body (inside shard_map). x [n, embed] local tokens; ids/weights [n, k];
    w: this device's native expert weights [n_local, ...]. Returns [n, embed].

    ffn(rows [m, embed], group_ids [m] in [0, groups], groups, w) -> [m, embed]: the expert compute
    (group id == groups marks a padding row). exchange: `ragged_all_to_all`'s signature over the
    expert axis. Both are the standard EP path's own (passed in by models.moe).
    """
    n, k = ids.shape
    a = n * k
    n_experts = cfg.n_experts
    n_local = n_experts // n_shards
    z = default_spill_slots(n_experts, n_shards) if spill_slots is None else spill_slots
    r_rows = buffer_rows(a, n_shards, n_local, cfg.llep_threshold, capacity_factor, z)
    me = jax.lax.axis_index(EXPERT_AXIS)

    eid = ids.reshape(a)
    by_expert = jnp.argsort(eid, stable=True)
    sorted_eid = eid[by_expert]
    local_counts = jnp.bincount(eid, length=n_experts).astype(jnp.int32)
    counts = jax.lax.all_gather(local_counts, EXPERT_AXIS)                  # [S, E]
    rows_plan, slot_experts = plan_spill(counts, n_local, a, cfg.llep_threshold, capacity_factor, z)

    # Each assignment's place in its expert's global order (source-major), hence its device.
    src_offset = (jnp.cumsum(counts, axis=0) - counts)[me]                  # [E]
    local_start = jnp.cumsum(local_counts) - local_counts
    rank = src_offset[sorted_eid] + jnp.arange(a) - local_start[sorted_eid]
    seg_end = jnp.cumsum(rows_plan, axis=1)                                 # [E, S]
    dest = jnp.sum(seg_end[sorted_eid] <= rank[:, None], axis=1).astype(jnp.int32)
    slot_of = jnp.full((n_experts,), z, jnp.int32).at[slot_experts].set(jnp.arange(z, dtype=jnp.int32))
    group = jnp.where(dest == sorted_eid // n_local, sorted_eid % n_local, n_local + slot_of[sorted_eid])

    by_dest = jnp.argsort(dest, stable=True)
    order = by_expert[by_dest]                      # send position -> assignment index
    send_dest = dest[by_dest]
    send_rows = x[order // k]
    send_group = group[by_dest].astype(jnp.int32)
    send_counts = jnp.bincount(send_dest, length=n_shards).astype(jnp.int32)
    send_start = (jnp.cumsum(send_counts) - send_counts).astype(jnp.int32)

    flows = jax.lax.all_gather(send_counts, EXPERT_AXIS)                    # [src, dst]
    recv_sizes = flows[:, me]
    below = (jnp.arange(n_shards) < me)[:, None]
    output_offsets = jnp.sum(jnp.where(below, flows, 0), axis=0).astype(jnp.int32)
    n_groups = n_local + z
    recv = exchange(send_rows, jnp.zeros((r_rows, x.shape[-1]), x.dtype), send_start, send_counts,
                    output_offsets, recv_sizes)
    recv_group = exchange(send_group, jnp.full((r_rows,), n_groups, jnp.int32), send_start, send_counts,
                          output_offsets, recv_sizes)
    y = ffn(recv, recv_group, n_groups, _guest_weights(w, slot_experts, n_local))
    # Return trip: the chunk from sender s sits at recv_start[s]; it goes back to s's send offset.
    recv_start = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    sender_offsets = (jnp.cumsum(flows, axis=1) - flows)[:, me].astype(jnp.int32)
    back = exchange(y, jnp.zeros((a, x.shape[-1]), y.dtype), recv_start, recv_sizes, sender_offsets,
                    send_counts)
    per_assignment = jnp.zeros_like(back).at[order].set(back).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", per_assignment.astype(jnp.float32),
                      weights.astype(jnp.float32)).astype(x.dtype)
