"""The pure-JAX semantics of jax_ep: readable as the spec, the tests' oracle, the CPU backend.

Every function runs per shard inside `shard_map` and communicates with `lax.all_to_all` /
`lax.all_gather` over `axis_name`. Memory is O(R * T * H) per shard: meant for correctness and
for small problems, not for speed. The CUDA kernels implement exactly the same functions
(docs/ffi.md states them in kernel terms).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep._common import (a2a, as_bytes, axis_info, first_occurrence, from_bytes,
                            ll_src_to_row, quantize_fp8, sanitize)


# ----------------------------------------------------------------------------------------------
# High-throughput mode
# ----------------------------------------------------------------------------------------------

def fair_quotas(cnt, capacity):
    """Rows each source keeps on each receiver: cnt [R(s), R(q)] tokens from s to q ->
    [R(s), R(q)] int32.

    All of them when they fit in `capacity`. Otherwise the capacity is shared fairly: every
    source keeps min(cnt, level), with the level the largest that fits, and the rows left over go
    one each to the sources with more tokens, in the order q + 1, q + 2, ... (mod R) from the
    receiver q. So a source loses rows only when it sends more than an equal share, and never
    all of them while others keep theirs.
    """
    R = cnt.shape[0]
    cnt = cnt.astype(jnp.int32)
    C = jnp.int32(capacity)
    hi = jnp.max(cnt, axis=0)
    lo = jnp.zeros_like(hi)

    def step(_, lh):  # largest level per receiver with sum_s min(cnt, level) <= C
        lo, hi = lh
        mid = lo + (hi - lo + 1) // 2
        fits = jnp.sum(jnp.minimum(cnt, mid[None, :]), axis=0) <= C
        return jnp.where(fits, mid, lo), jnp.where(fits, hi, mid - 1)

    level, _ = lax.fori_loop(0, 32, step, (lo, hi))
    base = jnp.minimum(cnt, level[None, :])
    left = C - jnp.sum(base, axis=0)                                           # [R(q)]
    s = jnp.arange(R)[:, None]
    q = jnp.arange(R)[None, :]
    turn = (s - q - 1) % R                                                     # [R(s), R(q)]
    over = cnt > level[None, :]
    earlier = jnp.sum(over[None, :, :] & (turn[None, :, :] < turn[:, None, :]), axis=1)
    return (base + (over & (earlier < left[None, :]))).astype(jnp.int32)


def ht_layout(topk_idx, *, num_experts, capacity, axis_name):
    """Layout of a high-throughput dispatch.

    Returns a dict: idx (sanitised [T, K]), send_rows [T, R] (row of token t on rank q, or -1),
    recv_src [C] (src_rank * T + src_token, -1 on padding), recv_mask [R, T] (token t of rank s
    is received here, dropped or not), recv_count, num_dropped, num_invalid.
    """
    R, r = axis_info(axis_name)
    T = topk_idx.shape[0]
    L = num_experts // R
    C = capacity
    idx, num_invalid = sanitize(topk_idx, num_experts)
    dest = jnp.where(idx >= 0, idx // L, -1)                                   # [T, K]
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(R)[None, None, :], axis=1)  # [T, R]
    counts = jnp.sum(in_rank, axis=0).astype(jnp.int32)                        # [R] to each q
    cnt = lax.all_gather(counts, axis_name)                                    # [R(s), R(q)]
    quota = fair_quotas(cnt, C)                                                # [R(s), R(q)]
    # Rows on rank q: sources in rank order (each its first quota[s, q] tokens), tokens in index
    # order.
    offset = jnp.sum(jnp.where(jnp.arange(R)[:, None] < r, quota, 0), axis=0)  # [R(q)] for me
    local = jnp.cumsum(in_rank, axis=0).astype(jnp.int32) - 1                  # [T, R]
    rows = offset[None, :] + local
    send_rows = jnp.where(in_rank & (local < quota[r][None, :]), rows, -1)
    # Receiver side: which tokens of which source come here, in order.
    recv_mask = a2a(in_rank.T[:, :, None], axis_name)[:, :, 0]                # [R(s), T]
    pos_s = jnp.cumsum(recv_mask, axis=1).astype(jnp.int32) - 1               # [R(s), T]
    mine = quota[:, r]                                                         # [R(s)]
    base = (jnp.cumsum(mine) - mine).astype(jnp.int32)
    keep = (recv_mask & (pos_s < mine[:, None])).reshape(-1)
    pos = (base[:, None] + pos_s).reshape(-1)
    total = jnp.sum(cnt[:, r])
    src_ids = jnp.arange(R * T, dtype=jnp.int32)
    recv_src = jnp.full((C,), -1, jnp.int32).at[jnp.where(keep, pos, C)].set(src_ids, mode="drop")
    recv_count = jnp.sum(mine).astype(jnp.int32)
    return dict(idx=idx, send_rows=send_rows, recv_src=recv_src, recv_mask=recv_mask,
                recv_count=recv_count, num_dropped=(total - recv_count).astype(jnp.int32),
                num_invalid=num_invalid)


def ht_gather(rows, send_rows, recv_src, *, axis_name):
    """Move rows to the ranks that receive them: [T, ...] -> [C, ...], zeros on padding.

    This is the data movement of dispatch, and the transpose of `ht_combine`.
    """
    R, _ = axis_info(axis_name)
    T = rows.shape[0]
    b = as_bytes(rows)                                                       # [T, ..., nb]
    mask = (send_rows >= 0).T                                                 # [R(q), T]
    send = jnp.where(mask.reshape(R, T, *([1] * (b.ndim - 1))), b[None], 0)   # [R(q), T, ...]
    got = a2a(send, axis_name).reshape(R * T, *b.shape[1:])                  # [R(s)*T, ...]
    valid = recv_src >= 0
    out = got[jnp.where(valid, recv_src, 0)]
    out = jnp.where(valid.reshape(-1, *([1] * (b.ndim - 1))), out, 0)
    return from_bytes(out, rows.dtype)


def ht_combine(y, recv_src, num_tokens, *, axis_name):
    """out[t] = sum over ranks q that received t of y_q[row of t on q], in float32."""
    R, _ = axis_info(axis_name)
    T = num_tokens
    valid = recv_src >= 0
    s = jnp.where(valid, recv_src // T, R)                                    # R: dropped
    t = jnp.where(valid, recv_src % T, 0)
    buf = jnp.zeros((R, T) + y.shape[1:], jnp.float32).at[s, t].set(
        y.astype(jnp.float32), mode="drop")
    back = a2a(buf, axis_name)                                               # [R(q), T, ...]
    # Sum in rank order q = 0..R-1 (what the kernel does), not a tree.
    acc = back[0]
    for q in range(1, R):
        acc = acc + back[q]
    return acc


def ht_dispatch(xs, topk_idx, topk_weights, *, num_experts, capacity, axis_name):
    """Reference dispatch. xs: tuple of [T, ...] arrays moved together (x, or x_fp8 and scales).

    Returns (recv_xs, recv_topk_idx, recv_topk_weights, recv_tokens_per_expert, layout).
    """
    R, r = axis_info(axis_name)
    L = num_experts // R
    lay = ht_layout(topk_idx, num_experts=num_experts, capacity=capacity, axis_name=axis_name)
    send_rows, recv_src = lay["send_rows"], lay["recv_src"]
    recv_xs = tuple(ht_gather(a, send_rows, recv_src, axis_name=axis_name) for a in xs)
    gidx = ht_gather(lay["idx"], send_rows, recv_src, axis_name=axis_name)  # global ids
    valid = recv_src >= 0
    mine = valid[:, None] & (gidx >= 0) & (gidx // L == r)
    recv_topk_idx = jnp.where(mine, gidx % L, -1)
    w = jnp.zeros(topk_idx.shape, jnp.float32) if topk_weights is None else topk_weights
    recv_topk_weights = jnp.where(mine, ht_gather(w.astype(jnp.float32), send_rows, recv_src,
                                                  axis_name=axis_name), 0.0)
    per_expert = jnp.sum(jnp.any(recv_topk_idx[:, :, None] == jnp.arange(L)[None, None, :],
                                 axis=1), axis=0).astype(jnp.int32)
    return recv_xs, recv_topk_idx, recv_topk_weights, per_expert, lay


def layout_counts(topk_idx, *, num_experts, num_ranks):
    """Local layout count: tokens per rank [R], tokens per expert [E], token-in-rank [T, R]."""
    L = num_experts // num_ranks
    idx, num_invalid = sanitize(topk_idx, num_experts)
    in_expert = jnp.any(idx[:, :, None] == jnp.arange(num_experts)[None, None, :], axis=1)
    dest = jnp.where(idx >= 0, idx // L, -1)
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(num_ranks)[None, None, :], axis=1)
    return (jnp.sum(in_rank, 0).astype(jnp.int32), jnp.sum(in_expert, 0).astype(jnp.int32),
            in_rank, num_invalid)


# ----------------------------------------------------------------------------------------------
# Low-latency mode
# ----------------------------------------------------------------------------------------------

def ll_dispatch(x, topk_idx, *, num_experts, max_tokens_per_rank, use_fp8, round_scale,
                axis_name):
    """Reference low-latency dispatch: expert-major [L, R*M, ...], rows by (source, token).

    Returns (recv_x (array or (fp8, scales)), recv_count [L], recv_src [L, R*M],
    recv_slot [L, R*M], num_invalid, src_rows [R*M, K]). recv_slot: the first top-k slot of the
    source token naming the row's expert (where combine finds that expert's output), -1 past the
    count. src_rows: for slot k of source row s*M + t, the flat row l*R*M + j holding that token
    when slot k names local expert l, else -1.
    """
    R, r = axis_info(axis_name)
    T, H = x.shape
    M = max_tokens_per_rank
    L = num_experts // R
    idx, num_invalid = sanitize(topk_idx, num_experts)
    idx = jnp.pad(idx, ((0, M - T), (0, 0)), constant_values=-1)
    x = jnp.pad(x, ((0, M - T), (0, 0)))
    first = first_occurrence(idx)
    # match[q, t, k, l]: slot k of token t is the first naming expert l of rank q
    gid = jnp.arange(R * L).reshape(R, L)
    match = first[None, :, :, None] & (idx[None, :, :, None] == gid[:, None, None, :])
    sel = jnp.any(match, axis=2)                                                # [R, M, L]
    kfirst = jnp.argmax(match, axis=2).astype(jnp.int32)                        # [R, M, L]
    payload = quantize_fp8(x, round_scale) if use_fp8 else (x,)
    got_sel = a2a(sel, axis_name)                                              # [R(s), M, L]
    got_kf = a2a(kfirst, axis_name)                                            # [R(s), M, L]
    moved = []
    for a in payload:
        b = as_bytes(a)                                                         # [M, ..., nb]
        send = jnp.where(jnp.any(sel, -1).reshape(R, M, *([1] * (b.ndim - 1))), b[None], 0)
        moved.append((a2a(send, axis_name).reshape(R * M, *b.shape[1:]), a.dtype))
    mask = got_sel.reshape(R * M, L).T                                          # [L, R*M]
    pos = jnp.cumsum(mask, axis=1).astype(jnp.int32) - 1
    recv_count = jnp.sum(mask, axis=1).astype(jnp.int32)
    rows = jnp.where(mask, pos, R * M)                                          # [L, R*M]
    src_ids = jnp.arange(R * M, dtype=jnp.int32)

    def place(b):
        return jax.vmap(lambda rw: jnp.zeros_like(b).at[rw].set(b, mode="drop"))(rows)

    def place_ids(vals):                                                        # [L, R*M]
        return jax.vmap(lambda rw, v: jnp.full((R * M,), -1, jnp.int32).at[rw].set(
            v, mode="drop"))(rows, vals)

    recv = tuple(from_bytes(place(b), dt) for b, dt in moved)
    recv_src = place_ids(jnp.broadcast_to(src_ids[None], (L, R * M)))
    recv_slot = place_ids(got_kf.reshape(R * M, L).T)
    recv_x = recv if use_fp8 else recv[0]
    return recv_x, recv_count, recv_src, recv_slot, num_invalid, ll_src_rows(recv_src, idx, r,
                                                                           axis_name)


def ll_src_rows(recv_src, idx, rank, axis_name):
    """[R*M, K]: the flat recv row (l * R*M + j) of slot k of source row s*M + t, or -1.

    idx: this rank's sanitised, padded [M, K] ids; each rank sends its ids to every rank.
    """
    L, RM = recv_src.shape
    R = RM // idx.shape[0]
    s2r = ll_src_to_row(recv_src, R).reshape(RM, L)                          # [R*M, L]
    ids = a2a(jnp.broadcast_to(idx[None], (R,) + idx.shape), axis_name)     # [R(s), M, K]
    ids = ids.reshape(RM, idx.shape[1])
    local = (ids >= 0) & (ids // L == rank)
    l = jnp.where(local, ids % L, 0)
    row = jnp.take_along_axis(s2r, l, axis=1)                                # [R*M, K]
    return jnp.where(local & (row >= 0), l * RM + row, -1).astype(jnp.int32)


def ll_rows_back(y, src_to_row, *, axis_name):
    """Receiver rows back to their sources: got[q, t, l] = y_q[l][row of (me, t, l) on q]."""
    R, M, L = src_to_row.shape
    valid = src_to_row >= 0
    rows = jnp.where(valid, src_to_row, 0)
    back = y[jnp.arange(L)[None, None, :], rows]                                # [R, M, L, H]
    back = jnp.where(valid[..., None], back, 0)
    return a2a(back, axis_name)                                                # [R(q), M, L, H]


def ll_combine(y, topk_idx, topk_weights, recv_src, *, num_experts, axis_name):
    """out[t] = sum_k w[t, k] * y[e_k][row of (t, k)] (float32), as bfloat16."""
    R, _ = axis_info(axis_name)
    L = num_experts // R
    T, K = topk_idx.shape
    idx, _ = sanitize(topk_idx, num_experts)
    src_to_row = ll_src_to_row(recv_src, R)
    got = ll_rows_back(y, src_to_row, axis_name=axis_name)[:, :T]              # [R, T, L, H]
    valid = idx >= 0
    q = jnp.where(valid, idx // L, 0)
    l = jnp.where(valid, idx % L, 0)
    rows = got[q, jnp.arange(T)[:, None], l].astype(jnp.float32)               # [T, K, H]
    w = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
    acc = jnp.zeros((T, y.shape[-1]), jnp.float32)
    for k in range(K):  # k order, as the kernel
        acc = acc + w[:, k, None] * rows[:, k]
    return acc.astype(y.dtype)
