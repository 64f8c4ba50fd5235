"""The expert-major layout: one row per received (token, local expert) pair, grouped in
per-expert segments, the layout the grouped GEMMs read.

A receiver-side move of a rank-major receive's rows (no communication): `plan` places the pairs,
`expand_rows` moves the rows there and `reduce_rows` sums them back per received token with
their routing weights. Both moves are gathers, and so are their transposes (autodiff of a
gather would scatter-add). Both backends use this module.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import _ffi, runtime
from jax_ep._common import axis_info, first_occurrence, order_by_key


class ExpertDispatchHandle(NamedTuple):
    """What combine needs after a `layout="expert"` dispatch. A pytree of arrays."""
    rank: Any               # the DispatchHandle of the rank-major receive underneath
    # row_of [C, K] int32: expert-major row of slot (c, k), or -1 (slots naming one expert
    # share the row)
    row_of: jax.Array
    src: jax.Array          # [capacity] int32: c * K + k held by each row, -1 on padding
    weights: jax.Array      # [C, K] float32: each slot's routing weight (1 without weights)
    num_dropped: jax.Array  # [] int32: tokens and (token, expert) rows that did not fit

    @property
    def num_invalid(self):
        return self.rank.num_invalid


class ExpertDispatchResult(NamedTuple):
    """What `dispatch(layout="expert")` returns: one row per received (token, local expert)
    pair, grouped in per-expert segments (docs/API.md)."""
    recv_x: Any                          # [capacity, H] expert-major rows (or the FP8 tuple)
    recv_weights: Optional[jax.Array]    # [capacity] float32 routing weight of each row
    expert_sizes: jax.Array              # [L] int32 segment lengths (group sizes of a GEMM)
    expert_offsets: jax.Array            # [L] int32 segment starts
    recv_tokens_per_expert: jax.Array    # [L] int32 rows holding data per expert
    recv_count: jax.Array                # [] int32 rows up to the end of the last segment
    handle: ExpertDispatchHandle


def _positions_kernel(backend, L):
    """Whether `plan` places the pairs with the CUDA kernels (jax_ep_expert_positions): on the
    CUDA backend, for as many local experts as they serve (the extension's
    `max_position_experts`); else XLA ops (a sort by expert), the same integers."""
    if backend != "cuda":
        return False
    return L <= int(getattr(runtime.extension(), "max_position_experts", 0))


def _positions(key, L, capacity, A):
    """(pos [P], src [capacity], counts [L], offsets [L]) of the pairs `key` (their experts, L:
    none), from one call: a stable counting sort by expert over blocks of the extension's
    `position_slice_pairs` pairs (their counts a scratch result)."""
    P = key.shape[0]
    blocks = -(-P // int(runtime.extension().position_slice_pairs))
    return _ffi.call("jax_ep_expert_positions", [key],
                     [((P,), jnp.int32), ((capacity,), jnp.int32), ((L,), jnp.int32),
                      ((L,), jnp.int32), ((blocks, L), jnp.int32)],
                     pure=True, num_experts=L, capacity=capacity, alignment=A)[:4]


def _positions_xla(key, L, capacity, A):
    """`_positions` in XLA's ops: a histogram, a stable sort by expert and scatters."""
    P = key.shape[0]
    counts = jnp.zeros((L + 1,), jnp.int32).at[key].add(1)[:L]
    padded = (counts + (A - 1)) // A * A
    offsets = (jnp.cumsum(padded) - padded).astype(jnp.int32)               # aligned starts
    starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)                 # starts unaligned
    order = order_by_key(key, L)          # by expert, slot (past the last: no pair, any order)
    e = jnp.minimum(key[order], L - 1)
    pos_sorted = jnp.where(key[order] < L,
                           offsets[e] + jnp.arange(P, dtype=jnp.int32) - starts[e], capacity)
    pos = jnp.zeros((P,), jnp.int32).at[order].set(pos_sorted, unique_indices=True)
    src = jnp.full((capacity,), -1, jnp.int32).at[jnp.where(pos < capacity, pos, capacity)].set(
        jnp.arange(P, dtype=jnp.int32), mode="drop")   # dropped pairs share one index
    return pos, src, counts, offsets


def plan(recv_topk_idx, *, num_local_experts, capacity, alignment, backend="reference"):
    """Where each received (row, local expert) pair goes in the expert-major layout.

    A pair is a row and a local expert it names (a row naming one expert in two slots is one
    pair). Pairs of local expert e form segment e; segments follow in expert order, each
    starting at a multiple of `alignment`, pairs inside one in row order, i.e. source rank,
    then token (the received rows' order). Pairs whose row would land at or past `capacity`
    are dropped.

    Returns a dict: row_of [C, K] (expert-major row of the pair of slot (c, k), -1 when the slot
    names no local expert or its pair was dropped; slots naming one expert share the row),
    src [capacity] (c * K + k of the first slot of the pair held by each row, -1 on padding),
    expert_sizes [L] (segment lengths, padding included: the group sizes of a grouped GEMM
    over the rows), expert_offsets [L] (segment starts), counts [L] (pairs held per expert),
    recv_count (rows up to the end of the last segment) and num_dropped (pairs past capacity).
    backend: "cuda" places the pairs in CUDA kernels where they serve L, the same integers.
    """
    C, K = recv_topk_idx.shape
    L, P, A = num_local_experts, C * K, alignment
    first = first_occurrence(recv_topk_idx)
    key = jnp.where(first, recv_topk_idx, L).reshape(P)                     # L: no new pair
    place = _positions if _positions_kernel(backend, L) and P > 0 else _positions_xla
    pos, src, counts, offsets = place(key, L, capacity, A)
    padded = (counts + (A - 1)) // A * A
    keep = pos < capacity
    # every slot takes the row of the first slot naming its expert
    same = recv_topk_idx[:, :, None] == recv_topk_idx[:, None, :]           # [C, k, k']
    first_slot = jnp.argmax(same, axis=2)                                    # [C, K]
    row = jnp.where(keep, pos, -1).reshape(C, K)
    row_of = jnp.where(recv_topk_idx >= 0, jnp.take_along_axis(row, first_slot, axis=1), -1)
    room = jnp.maximum(capacity - offsets, 0)
    sizes = jnp.minimum(padded, room).astype(jnp.int32)
    held = jnp.minimum(counts, room).astype(jnp.int32)
    offsets = jnp.minimum(offsets, capacity)     # a segment dropped whole starts at the end
    return dict(row_of=row_of, src=src, expert_sizes=sizes, expert_offsets=offsets,
                counts=held, recv_count=jnp.sum(sizes).astype(jnp.int32),
                num_dropped=(jnp.sum(counts) - jnp.sum(held)).astype(jnp.int32))


def take_rows(a, rows):
    """a[rows] with zeros where rows is -1."""
    n = a.shape[0]
    if n == 0:      # nothing received (T = 0): every row is padding
        return _ffi.varying([jnp.zeros(rows.shape + a.shape[1:], a.dtype), a, rows])[0]
    return a.at[jnp.where(rows >= 0, rows, n)].get(mode="fill", fill_value=0)


def _pair_weights(w, row_of):
    """[C, K]: for each slot, the summed weight of the slots sharing its row (0 without one)."""
    same = (row_of[:, :, None] == row_of[:, None, :]) & (row_of[:, :, None] >= 0)
    return jnp.sum(jnp.where(same, w.astype(jnp.float32)[:, None, :], 0.0), axis=2)


def received_row(src, K):
    """[capacity] int32: the received row each expert-major row holds (src // K), -1 on
    padding."""
    return jnp.where(src >= 0, src // K, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def expand_rows(x, src, row_first, K):
    """[C, H] received rows -> [capacity, H] expert-major rows (row j holds x[src[j] // K]).
    row_first: row_of on the first slot of each pair, -1 on the others."""
    return take_rows(x, received_row(src, K))


def _expand_rows_fwd(x, src, row_first, K):
    return expand_rows(x, src, row_first, K), (src, row_first)


def expand_rows_transpose(g, src, row_first, K):
    """The transpose of `expand_rows`: [capacity, H] row cotangents -> [C, H], each received
    row the sum of its pairs' rows (in float32, rounded once to g's dtype)."""
    del src
    C = row_first.shape[0]
    dx = jnp.sum(take_rows(g, row_first.reshape(C * K)).reshape(C, K, *g.shape[1:])
                 .astype(jnp.float32), axis=1)
    return dx.astype(g.dtype)


def _expand_rows_bwd(K, res, g):
    src, row_first = res
    return expand_rows_transpose(g, src, row_first, K), None, None


expand_rows.defvjp(_expand_rows_fwd, _expand_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def reduce_rows(y, w, src, row_of, K):
    """[capacity, H] expert-major rows, [C, K] weights -> [C, H] float32: row c is
    sum_k w[c, k] * y[row_of[c, k]] over the slots with a row."""
    C = w.shape[0]
    # a product and a sum (not an einsum, which XLA would make a batched dot of the gathered
    # rows): one fusion that reads each row of y once
    yg = take_rows(y, row_of.reshape(C * K)).reshape(C, K, y.shape[-1]).astype(jnp.float32)
    return jnp.sum(yg * w.astype(jnp.float32)[:, :, None], axis=1)


def _reduce_rows_fwd(y, w, src, row_of, K):
    return reduce_rows(y, w, src, row_of, K), (y, w, src, row_of)


def row_weights(w, src, row_of):
    """[capacity] float32: each expert-major row's weight in `reduce_rows` (its pair's summed
    slot weights; 0 on rows without a pair)."""
    C, K = w.shape
    return take_rows(_pair_weights(w, row_of).reshape(C * K), src)


def reduce_rows_vjp(y, w, src, row_of, K, g):
    """(dy, dw): the VJP of `reduce_rows` in y and w for the cotangent g [C, H] of its output."""
    C = w.shape[0]
    wj = row_weights(w, src, row_of)
    dy = (take_rows(g, received_row(src, K)) * wj[:, None]).astype(y.dtype)
    yg = take_rows(y, row_of.reshape(C * K)).reshape(C, K, y.shape[-1]).astype(jnp.float32)
    dw = jnp.sum(g[:, None, :] * yg, axis=-1)
    return dy, dw.astype(w.dtype)


def _reduce_rows_bwd(K, res, g):
    return reduce_rows_vjp(*res, K, g) + (None, None)


reduce_rows.defvjp(_reduce_rows_fwd, _reduce_rows_bwd)


def gave_up(handle, poison):
    """Whether the rank-major receive of `handle` gave up waiting (a [] bool): its counts hold
    the sentinel `poison` (jax_ep.runtime.poison_int(), docs/API.md#timeouts). None when poison
    is None (a receive that cannot give up: the reference backend)."""
    return None if poison is None else handle.recv_count == poison


def plan_receive(ridx, rw, handle, L, capacity, alignment, has_weights, poison=None,
                 backend="reference"):
    """Where a rank-major receive's rows go in the expert-major layout, without moving them:
    (the dict of `plan`, the rows' weights or None, the ExpertDispatchHandle). poison: the
    CUDA kernels' int sentinel (None on the reference backend): when the receive gave up, every
    int result here takes it and every weight is NaN, as the kernels' own results. backend:
    `plan`'s."""
    C, K = ridx.shape
    lay = plan(ridx, num_local_experts=L, capacity=capacity, alignment=alignment,
               backend=backend)
    src, row_of = lay["src"], lay["row_of"]
    # without weights each (token, expert) pair weighs 1, however many slots name it
    w = rw if has_weights else first_occurrence(ridx).astype(jnp.float32)
    we = row_weights(w, src, row_of)
    num_dropped = handle.num_dropped + lay["num_dropped"]
    bad = gave_up(handle, poison)
    if bad is not None:
        lay = {k: jnp.where(bad, jnp.int32(poison), v) for k, v in lay.items()}
        src, row_of = lay["src"], lay["row_of"]
        w, we = (jnp.where(bad, jnp.float32(jnp.nan), a) for a in (w, we))
        num_dropped = jnp.where(bad, jnp.int32(poison), num_dropped)
    ehandle = ExpertDispatchHandle(handle, row_of, src, w, num_dropped)
    return lay, (we if has_weights else None), ehandle


def to_expert_major(recv_x, ridx, rw, handle, L, capacity, alignment, has_weights, poison=None,
                    backend="reference"):
    """A rank-major receive -> ExpertDispatchResult (poison, backend: as for `plan_receive`)."""
    K = ridx.shape[1]
    lay, we, ehandle = plan_receive(ridx, rw, handle, L, capacity, alignment, has_weights,
                                    poison, backend)
    src = lay["src"]
    bad = gave_up(handle, poison)
    if bad is not None:
        # every row from received row 0, NaN like every received row then: no [capacity, H] pass
        src = jnp.where(bad, 0, src)
    if isinstance(recv_x, tuple):    # FP8: forward only
        rows = received_row(src, K)
        xe = tuple(take_rows(a, rows) for a in recv_x)
    else:
        xe = expand_rows(recv_x, src, jnp.where(first_occurrence(ridx), lay["row_of"], -1), K)
    return ExpertDispatchResult(xe, we, lay["expert_sizes"], lay["expert_offsets"], lay["counts"],
                                lay["recv_count"], ehandle)


def passes_needed(tokens, *, num_ranks, num_local_experts, num_topk, capacity, alignment,
                  extra_capacity=None):
    """Expert-major dispatches, the first of `capacity` rows, the others of `extra_capacity`
    (default capacity), that carry every (token, local expert) pair a rank can receive (at most
    R * T * min(K, L)): each one keeps at least the first rows - (L - 1) * (alignment - 1)
    pairs of a rank in expert order (the alignment padding before the last segment is all a
    pair can lose). 0 pairs: one pass."""
    R, T, L, K, A = num_ranks, tokens, num_local_experts, num_topk, alignment
    extra = capacity if extra_capacity is None else extra_capacity
    for name, rows in (("capacity", capacity), ("extra_capacity", extra)):
        if rows - (L - 1) * (A - 1) < 1:
            raise ValueError(f"{name}={rows}: leaves no row for a pair after the alignment of "
                             f"{L} segments to {A} rows; at least {(L - 1) * (A - 1) + 1}")
    rest = R * T * min(K, L) - (capacity - (L - 1) * (A - 1))
    return 1 + max(0, -(-rest // (extra - (L - 1) * (A - 1))))


def pair_counts(topk_idx, *, num_experts, axis_name):
    """[R, E] int32: the (token, expert) pairs of every source rank (row) for every expert, from
    one all_gather of each rank's [E] counts (a token naming an expert in two slots is one
    pair). topk_idx: [T, K] ids with -1 for every slot that names no expert."""
    T, K = topk_idx.shape
    E = num_experts
    key = jnp.where(first_occurrence(topk_idx), topk_idx, E).reshape(T * K)
    mine = jnp.zeros((E + 1,), jnp.int32).at[key].add(1)[:E]
    return lax.all_gather(mine, axis_name)


def pass_keeps(counts, done, *, capacity, alignment, num_local_experts):
    """[R, E]: the pairs of each (source, expert) kept by the passes before one of `capacity`
    rows (`done`) and by that pass: it keeps, at each rank, the pairs left whose expert-major
    row, were every pair left sent, falls below capacity (segments of `alignment` rows in
    expert order, each by source, then token): for each (source, expert) a prefix of the pairs
    left. The kept pairs alone land on those same rows, so a pass that sends only them
    (`pass_slots` with `upto`) receives at most `capacity` pairs, hence tokens."""
    R, A, L = counts.shape[0], alignment, num_local_experts
    left = counts - done
    per_rank = jnp.sum(left, axis=0).reshape(R, L)
    padded = (per_rank + (A - 1)) // A * A
    offsets = (jnp.cumsum(padded, axis=1) - padded).reshape(R * L)
    row = offsets[None, :] + jnp.cumsum(left, axis=0) - left         # first left pair's row
    return done + jnp.clip(capacity - row, 0, left)


def pass_plan(topk_idx, *, num_experts, axis_name, capacity, alignment, passes,
              extra_capacity=None):
    """Which passes a routing needs, and what the passes before each one keep, from the pair
    counts of every source alone (one all_gather of [E] counts, no sort).

    The `passes` expert-major dispatches (`plan` with that alignment), the first of `capacity`
    rows and the others of `extra_capacity` (default capacity), carry every (token, local
    expert) pair of the group, none dropped, when the first pass sends every pair (its receive
    holds every token) and pass p > 0 sends the pairs it keeps (`pass_slots(topk_idx, done[p],
    done[p + 1])`). A pass keeps `pass_keeps`'s pairs. So every rank knows every pass's pairs,
    and whether it runs, before any row moves.

    topk_idx: [T, K] ids with -1 for every slot that names no expert. Returns (done [passes +
    1, R, E] int32: done[p] the pairs of (source, expert) that the passes before p kept,
    done[passes] those that all keep; run [passes] bool: pass p has a pair somewhere in the
    group, the same on every rank; the passes a routing needs come first)."""
    R, _ = axis_info(axis_name)
    E = num_experts
    cnt = pair_counts(topk_idx, num_experts=E, axis_name=axis_name)
    done = jnp.zeros((R, E), jnp.int32)          # pairs of (source, expert) kept so far
    dones, run = [], []
    for p in range(passes):
        C = capacity if p == 0 or extra_capacity is None else extra_capacity
        dones.append(done)
        run.append(jnp.any(cnt > done))
        done = pass_keeps(cnt, done, capacity=C, alignment=alignment, num_local_experts=E // R)
    return jnp.stack(dones + [done]), jnp.stack(run)


def pass_slots(topk_idx, done, upto=None, *, num_experts, axis_name):
    """[T, K] ids of the pass after those that kept `done` [R, E] pairs of each (source,
    expert) (`pass_plan`): the slots whose pair they did not keep and (with `upto` [R, E], what
    the passes up to this one keep) that this pass keeps, the others -1. The first pass (done
    all 0, no upto) sends every slot: its ids are topk_idx."""
    _, me = axis_info(axis_name)
    T, K = topk_idx.shape
    E = num_experts
    first = first_occurrence(topk_idx)
    key = jnp.where(first, topk_idx, E).reshape(T * K)
    mine = jnp.zeros((E + 1,), jnp.int32).at[key].add(1)[:E]
    # each pair's rank among this source's pairs of its expert (slots in token order)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    start = (jnp.cumsum(mine) - mine).astype(jnp.int32)
    rank_sorted = jnp.arange(T * K, dtype=jnp.int32) - start[jnp.minimum(key[order], E - 1)]
    rank = jnp.zeros((T * K,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)
    rank = rank.reshape(T, K)
    expert = jnp.where(first, topk_idx, 0)
    # every slot takes the status of the first slot naming its expert
    same = topk_idx[:, :, None] == topk_idx[:, None, :]
    first_slot = jnp.argmax(same, axis=2)
    here = first & (rank >= jnp.take(done, me, axis=0)[expert])
    if upto is not None:
        here = here & (rank < jnp.take(upto, me, axis=0)[expert])
    slot = jnp.take_along_axis(here, first_slot, axis=1) & (topk_idx >= 0)
    return jnp.where(slot, topk_idx, -1)


def pass_ids(topk_idx, *, num_experts, axis_name, capacity, alignment, passes,
             extra_capacity=None):
    """Every pass's ids at once: ([passes, T, K] `pass_slots` of each pass, [passes] bool run
    of `pass_plan`)."""
    done, run = pass_plan(topk_idx, num_experts=num_experts, axis_name=axis_name,
                          capacity=capacity, alignment=alignment, passes=passes,
                          extra_capacity=extra_capacity)
    ids = [pass_slots(topk_idx, done[p], done[p + 1] if p else None, num_experts=num_experts,
                      axis_name=axis_name) for p in range(passes)]
    return jnp.stack(ids), run
