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

FP8_MAX = 448.0
FP8_GROUP = 128
AMAX_MIN = 1e-4


def axis_info(axis_name):
    """(R, r) of the EP axis; a ValueError naming the axis when it is not bound."""
    try:
        size = lax.axis_size(axis_name)
        rank = lax.axis_index(axis_name)
    except (NameError, KeyError, ValueError) as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the enclosing shard_map / mesh; jax_ep "
            "ops run per shard inside jax.shard_map over the EP axis") from e
    return int(size), rank


def sanitize(topk_idx, num_experts):
    """Ids outside [-1, E) act as -1; returns (clean int32 ids, count of such ids)."""
    idx = topk_idx.astype(jnp.int32)
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    return jnp.where(bad, -1, idx), jnp.sum(bad).astype(jnp.int32)


def as_bytes(a):
    """View any array as uint8 with the element bytes in a trailing axis (exact transport)."""
    if a.dtype == jnp.uint8:
        return a[..., None]
    # The byte count spelled out: reshape(..., -1) cannot infer it for an empty array (T = 0).
    return lax.bitcast_convert_type(a, jnp.uint8).reshape(*a.shape, jnp.dtype(a.dtype).itemsize)


def _from_bytes(b, dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.uint8:
        return b[..., 0]
    return lax.bitcast_convert_type(b, dtype) if dtype.itemsize > 1 else \
        lax.bitcast_convert_type(b[..., 0], dtype)


def a2a(x, axis_name):
    """[R, ...] -> [R, ...]: block q goes to rank q; block s of the result came from rank s."""
    # Under vmap over axis_name (the one-GPU multi-rank mode), all_to_all of a value that is
    # the same on every rank (unbatched, e.g. a cotangent of ones) returns a wrong shape
    # (JAX 0.10): make it per rank first. In shard_map, XLA folds the select away.
    x = jnp.where(lax.axis_index(axis_name) >= 0, x, x)
    return lax.all_to_all(x, axis_name, 0, 0, tiled=True)


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
    return _from_bytes(out, rows.dtype)


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


def expert_layout(recv_topk_idx, *, num_local_experts, capacity, alignment):
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
    """
    C, K = recv_topk_idx.shape
    L, P, A = num_local_experts, C * K, alignment
    first = first_occurrence(recv_topk_idx)
    key = jnp.where(first, recv_topk_idx, L).reshape(P)                     # L: no new pair
    counts = jnp.zeros((L + 1,), jnp.int32).at[key].add(1)[:L]
    padded = (counts + (A - 1)) // A * A
    offsets = (jnp.cumsum(padded) - padded).astype(jnp.int32)               # aligned starts
    starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)                 # starts unaligned
    order = jnp.argsort(key, stable=True).astype(jnp.int32)                  # by expert, slot
    e = jnp.minimum(key[order], L - 1)
    pos_sorted = jnp.where(key[order] < L,
                           offsets[e] + jnp.arange(P, dtype=jnp.int32) - starts[e], capacity)
    pos = jnp.zeros((P,), jnp.int32).at[order].set(pos_sorted, unique_indices=True)
    keep = pos < capacity
    src = jnp.full((capacity,), -1, jnp.int32).at[jnp.where(keep, pos, capacity)].set(
        jnp.arange(P, dtype=jnp.int32), mode="drop")   # dropped pairs share one index
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
# FP8 (e4m3, per 128-column group)
# ----------------------------------------------------------------------------------------------

def round_up_pow2(scale):
    """Smallest power of two >= scale (positive, finite), exactly, on the float32 bits."""
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return lax.bitcast_convert_type(exp << 23, jnp.float32)


def quantize_fp8(x, round_scale=False):
    """x [..., H] -> (float8_e4m3fn [..., H], float32 scales [..., H // 128]); x ~ q * scale."""
    *lead, H = x.shape
    g = x.astype(jnp.float32).reshape(*lead, H // FP8_GROUP, FP8_GROUP)
    amax = jnp.max(jnp.abs(g), axis=-1)
    # A NaN or an infinity in a group: scale NaN and every value NaN, so the group dequantises
    # to NaN (a non-finite value never turns into finite numbers).
    bad = ~jnp.isfinite(amax)
    amax = jnp.maximum(jnp.where(bad, 1.0, amax), AMAX_MIN)
    # base = amax * float32(1/448), written as the multiplication it is (docs/ffi.md): XLA
    # rewrites a division by a constant into this form anyway, and the kernel does the same.
    base = amax * jnp.float32(1.0 / FP8_MAX)
    if round_scale:
        scale = round_up_pow2(base)
        inv = 1.0 / scale
    else:
        scale = base
        inv = FP8_MAX / amax
    q = to_e4m3_rne(jnp.clip(g * inv[..., None], -FP8_MAX, FP8_MAX))
    q = jnp.where(bad[..., None], lax.bitcast_convert_type(jnp.uint8(0x7F), jnp.float8_e4m3fn), q)
    return q.reshape(*lead, H), jnp.where(bad, jnp.float32(jnp.nan), scale)


def to_e4m3_rne(v):
    """float32 in [-448, 448] -> float8_e4m3fn, round to nearest even, on the bits.

    Spelled out because XLA's own f32 -> e4m3 conversion is not the same everywhere (some
    lowerings round through float16 first: double rounding); this is what the kernels compute.
    """
    bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
    sign = (bits >> 24) & 0x80
    a = jnp.abs(v.astype(jnp.float32))
    # subnormals (and 0): multiples of 2^-9; code = round_half_even(a * 2^9) (8 = 2^-6, normal)
    sub = jnp.round(a * 512.0).astype(jnp.uint32)
    # normals: keep 3 of the 23 mantissa bits, round half to even, re-bias the exponent 127 -> 7
    m = lax.bitcast_convert_type(a, jnp.uint32)
    rounded = (m + 0x7FFFF + ((m >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    code = jnp.where(a < 2.0 ** -6, sub, normal) | sign
    return lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn)


def dequantize_fp8(q, scales):
    *lead, H = q.shape
    g = q.astype(jnp.float32).reshape(*lead, H // FP8_GROUP, FP8_GROUP)
    return (g * scales[..., None]).reshape(*lead, H)


# ----------------------------------------------------------------------------------------------
# Low-latency mode
# ----------------------------------------------------------------------------------------------

def first_occurrence(idx):
    """[T, K] bool: slot k is valid and no earlier slot of the token names the same expert."""
    K = idx.shape[1]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)                     # [k, k'] k' < k
    dup = jnp.any((idx[:, :, None] == idx[:, None, :]) & earlier[None], axis=2)
    return (idx >= 0) & ~dup


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

    recv = tuple(_from_bytes(place(b), dt) for b, dt in moved)
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


def ll_src_to_row(recv_src, num_ranks):
    """[R, M, L]: the row of (source s, token t) in local expert l, or -1 (from recv_src)."""
    L, RM = recv_src.shape
    rows = jnp.broadcast_to(jnp.arange(RM, dtype=jnp.int32)[None], (L, RM))
    target = jnp.where(recv_src >= 0, recv_src, RM)                             # RM: dropped
    s2r = jnp.full((L, RM), -1, jnp.int32).at[jnp.arange(L)[:, None], target].set(
        rows, mode="drop")
    return s2r.T.reshape(num_ranks, RM // num_ranks, L)


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


def ll_combine_vjp(y, topk_weights, topk_idx, recv_src, g, *, num_experts, axis_name):
    """The VJP of ll_combine in y and topk_weights, given the cotangent g [T, H] of its output:
    (dy [L, R*M, H] in y's dtype, dw [T, K] in topk_weights' dtype). Both backends use it."""
    w, idx = topk_weights, topk_idx
    R, _ = axis_info(axis_name)
    src_to_row = ll_src_to_row(recv_src, R)
    _, M, L = src_to_row.shape
    T, K = idx.shape
    clean, _ = sanitize(idx, num_experts)
    valid = clean >= 0
    g = jnp.pad(g.astype(jnp.float32), ((0, M - T), (0, 0)))                   # [M, H]
    # per (rank q, token t, local expert l): summed weight of the slots naming that expert
    onehot = (clean[:, :, None] == jnp.arange(R * L)[None, None, :]) & valid[:, :, None]
    wsum = jnp.einsum("tk,tke->te", jnp.where(valid, w, 0.0).astype(jnp.float32),
                      onehot.astype(jnp.float32))
    wsum = jnp.pad(wsum, ((0, M - T), (0, 0))).reshape(M, R, L).transpose(1, 0, 2)  # [R, M, L]
    sent = src_to_row >= 0                                                      # [R(s), M, L]
    got_w = a2a(wsum, axis_name)                                               # [R(s), M, L]
    got_g = a2a(jnp.broadcast_to(g[None], (R,) + g.shape), axis_name)          # [R(s), M, H]
    # dy[l, row] = wsum * g_src[t]
    rows = jnp.where(sent, src_to_row, R * M)
    coef = got_w[..., None] * got_g[:, :, None, :]                              # [R, M, L, H]
    dy = jnp.zeros(y.shape, jnp.float32)
    lidx = jnp.broadcast_to(jnp.arange(L)[None, None, :], sent.shape)
    dy = dy.at[lidx, rows].add(jnp.where(sent[..., None], coef, 0.0), mode="drop")
    # dw[t, k] = <g[t], y_q[l][row(t, k)]>
    yrows = y[jnp.arange(L)[None, None, :], jnp.where(sent, src_to_row, 0)].astype(jnp.float32)
    dots = jnp.where(sent, jnp.einsum("smlh,smh->sml", yrows, got_g), 0.0)      # [R(s), M, L]
    back = a2a(dots, axis_name)                                                # [R(q), M, L]
    q = jnp.where(valid, clean // L, 0)
    l = jnp.where(valid, clean % L, 0)
    dw = jnp.where(valid, back[q, jnp.arange(T)[:, None], l], 0.0)
    return dy.astype(y.dtype), dw.astype(w.dtype)
