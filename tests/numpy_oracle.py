"""An independent NumPy implementation of API.md (the tests' oracle). Does not import jax_ep.

Every function takes per-rank lists (index = rank on the EP axis) of NumPy arrays and returns
per-rank lists. All arithmetic is float32 NumPy.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
FP8_MAX = np.float32(448.0)
GROUP = 128
AMAX_MIN = np.float32(1e-4)


def sanitize(idx, num_experts):
    """-> (int64 ids with out-of-range ids set to -1, number of such ids)."""
    idx = np.asarray(idx).astype(np.int64)
    bad = (idx < -1) | (idx >= num_experts)
    return np.where(bad, -1, idx), int(bad.sum())


# ---------------------------------------------------------------------------------------------
# layout (no communication)
# ---------------------------------------------------------------------------------------------

def layout(idx, num_experts, num_ranks):
    """-> tokens_per_rank [R], tokens_per_expert [E], is_token_in_rank [T, R], num_invalid."""
    clean, bad = sanitize(idx, num_experts)
    T = clean.shape[0]
    L = num_experts // num_ranks
    in_rank = np.zeros((T, num_ranks), bool)
    per_expert = np.zeros(num_experts, np.int64)
    for t in range(T):
        experts = {int(e) for e in clean[t] if e >= 0}
        for e in experts:
            per_expert[e] += 1
            in_rank[t, e // L] = True
    return in_rank.sum(0), per_expert, in_rank, bad


# ---------------------------------------------------------------------------------------------
# high-throughput mode
# ---------------------------------------------------------------------------------------------

def ht_dispatch(xs, idxs, ws, num_experts, capacity=None):
    """xs[s]: a [T, ...] array or a tuple of them (moved together, e.g. (x_fp8, scales)).

    Returns, per receiving rank, a dict with recv_x (array or tuple like xs[s]), recv_topk_idx,
    recv_topk_weights (None when ws is None), recv_count, recv_tokens_per_expert, recv_src,
    num_dropped, num_invalid.
    """
    R = len(idxs)
    T = np.asarray(idxs[0]).shape[0]
    K = np.asarray(idxs[0]).shape[1]
    L = num_experts // R
    C = R * T if capacity is None else capacity
    cleans, invalid = zip(*[sanitize(i, num_experts) for i in idxs])
    tup = isinstance(xs[0], tuple)
    payloads = [tuple(np.asarray(a) for a in x) if tup else (np.asarray(x),) for x in xs]
    out = []
    for r in range(R):
        # (s, t) in source-rank order, then token order
        srcs = [(s, t) for s in range(R) for t in range(T)
                if any(e >= 0 and e // L == r for e in cleans[s][t])]
        # Short of capacity: deal the C rows one per source per round, starting after r.
        n = [sum(1 for s2, _ in srcs if s2 == s) for s in range(R)]
        quota, left = [0] * R, min(C, len(srcs))
        while left > 0:
            for s in [(r + 1 + i) % R for i in range(R)]:
                if left > 0 and quota[s] < n[s]:
                    quota[s] += 1
                    left -= 1
        kept = [st for s in range(R) for st in [p for p in srcs if p[0] == s][:quota[s]]]
        recv = []
        for p, a in enumerate(payloads[0]):
            buf = np.zeros((C,) + a.shape[1:], a.dtype)
            for j, (s, t) in enumerate(kept):
                buf[j] = payloads[s][p][t]
            recv.append(buf)
        ridx = np.full((C, K), -1, np.int32)
        rw = np.zeros((C, K), np.float32)
        rsrc = np.full((C,), -1, np.int32)
        for j, (s, t) in enumerate(kept):
            rsrc[j] = s * T + t
            for k in range(K):
                e = cleans[s][t][k]
                if e >= 0 and e // L == r:
                    ridx[j, k] = e % L
                    if ws is not None:
                        rw[j, k] = np.float32(ws[s][t][k])
        per_expert = np.array([sum(1 for j in range(len(kept)) if l in ridx[j]) for l in range(L)],
                              np.int32)
        out.append(dict(
            recv_x=tuple(recv) if tup else recv[0], recv_topk_idx=ridx,
            recv_topk_weights=rw if ws is not None else None, recv_count=len(kept),
            recv_tokens_per_expert=per_expert, recv_src=rsrc,
            num_dropped=len(srcs) - len(kept), num_invalid=invalid[r]))
    return out


def ht_combine(ys, recv_srcs, num_tokens):
    """out_s[t] = sum over ranks q (in order) with recv_src_q[row] == s*T + t of y_q[row].

    Float32 accumulation; returned as float32 (cast to y's dtype at the call site).
    """
    R = len(ys)
    T = num_tokens
    H = np.asarray(ys[0]).shape[1:]
    outs = [np.zeros((T,) + H, np.float32) for _ in range(R)]
    for q in range(R):
        y = np.asarray(ys[q]).astype(np.float32)
        for j, src in enumerate(np.asarray(recv_srcs[q])):
            if src >= 0:
                outs[src // T][src % T] += y[j]
    return outs


def expert_dispatch(xs, idxs, ws, num_experts, alignment=1, capacity=None):
    """The expert-major layout (dispatch(layout="expert")), per receiving rank a dict with
    recv_x, recv_weights, expert_sizes, expert_offsets, recv_tokens_per_expert, recv_count,
    num_dropped, num_invalid, row_src [C] (s * T + t of each row's token, -1 on padding), and
    for the combine: row_of [C_tok, K], recv_src, pair_w.

    A short capacity drops in two stages: the transfer receives at most min(C, R * T) tokens
    (ht_dispatch's fair shares), then the kept tokens' (token, expert) pairs whose row lands at
    or past C are dropped. num_dropped: the tokens of the first stage plus the pairs of the
    second."""
    R = len(idxs)
    T, K = np.asarray(idxs[0]).shape
    L = num_experts // R
    C = R * T * min(K, L) + L * (alignment - 1) if capacity is None else capacity
    ranks = ht_dispatch(xs, idxs, ws, num_experts, min(R * T, C))
    out = []
    for d in ranks:
        ridx = d["recv_topk_idx"]
        Ct = ridx.shape[0]
        # without weights each (row, expert) pair weighs 1: its first slot
        w = d["recv_topk_weights"] if ws is not None else np.array(
            [[float(ridx[c, k] >= 0 and ridx[c, k] not in ridx[c, :k]) for k in range(K)]
             for c in range(Ct)], np.float32).reshape(Ct, K)
        tup = isinstance(d["recv_x"], tuple)
        parts = d["recv_x"] if tup else (d["recv_x"],)
        recv = [np.zeros((C,) + a.shape[1:], a.dtype) for a in parts]
        recv_w = np.zeros(C, np.float32)
        row_src = np.full(C, -1, np.int64)
        row_of = np.full((Ct, K), -1, np.int64)
        offsets, sizes, held = [], [], []
        pos = 0
        for e in range(L):
            # one pair per (row, expert): a row naming e in two slots is held once, with the
            # slots' weights summed
            pairs = [c for c in range(Ct) if e in ridx[c]]
            offsets.append(min(pos, C))   # a segment dropped whole starts at the end
            for i, c in enumerate(pairs):
                if pos + i < C:
                    slots = [k for k in range(K) if ridx[c, k] == e]
                    row_of[c, slots] = pos + i
                    for a, b in zip(recv, parts):
                        a[pos + i] = b[c]
                    recv_w[pos + i] = sum(w[c, k] for k in slots)
                    row_src[pos + i] = d["recv_src"][c]
            held.append(max(0, min(len(pairs), C - pos)))
            padded = -(-len(pairs) // alignment) * alignment
            sizes.append(max(0, min(padded, C - pos)))
            pos += padded
        total = sum(len(set(int(e) for e in row if e >= 0)) for row in ridx)
        out.append(dict(
            recv_x=tuple(recv) if tup else recv[0],
            recv_weights=recv_w if ws is not None else None,
            expert_sizes=np.array(sizes, np.int32), expert_offsets=np.array(offsets, np.int32),
            recv_tokens_per_expert=np.array(held, np.int32), recv_count=sum(sizes),
            num_dropped=d["num_dropped"] + total - sum(held), num_invalid=d["num_invalid"],
            row_src=row_src, row_of=row_of, recv_src=d["recv_src"], pair_w=w))
    return out


def expert_combine(ys, disp, num_tokens):
    """Each rank sums its rows of a token weighted by their routing weights (float32, rounded
    once to y's dtype), then the ranks' sums are added (ht_combine)."""
    rows = []
    for y, d in zip(ys, disp):
        y = np.asarray(y)
        yf = y.astype(np.float32)
        Ct, K = d["row_of"].shape
        acc = np.zeros((Ct,) + y.shape[1:], np.float32)
        for c in range(Ct):
            for k in range(K):
                j = d["row_of"][c, k]
                if j >= 0:
                    acc[c] += d["pair_w"][c, k] * yf[j]
        rows.append(acc.astype(y.dtype))
    return ht_combine(rows, [d["recv_src"] for d in disp], num_tokens)


# ---------------------------------------------------------------------------------------------
# FP8 (per 128-column group)
# ---------------------------------------------------------------------------------------------

def round_up_pow2(s):
    """Smallest power of two >= s (float32, positive), on the float32 bits."""
    bits = np.asarray(s, np.float32).view(np.uint32)
    exp = (bits >> np.uint32(23)) & np.uint32(0xFF)
    exp = exp + ((bits & np.uint32(0x7FFFFF)) != 0).astype(np.uint32)
    return (exp << np.uint32(23)).astype(np.uint32).view(np.float32)


def quantize_fp8(x, round_scale=False):
    """x [..., H] -> (float8_e4m3fn [..., H], float32 scales [..., H // 128])."""
    x = np.asarray(x).astype(np.float32)
    *lead, H = x.shape
    g = x.reshape(*lead, H // GROUP, GROUP)
    raw = np.abs(g).max(-1)
    bad = ~np.isfinite(raw)               # NaN or inf: the whole group is NaN, scale NaN
    amax = np.maximum(np.where(bad, 1.0, raw), AMAX_MIN).astype(np.float32)
    if round_scale:
        scale = round_up_pow2((amax * np.float32(1.0 / 448.0)).astype(np.float32))
        inv = (np.float32(1.0) / scale).astype(np.float32)
    else:
        scale = (amax * np.float32(1.0 / 448.0)).astype(np.float32)  # as docs/ffi.md
        inv = (FP8_MAX / amax).astype(np.float32)
    q = np.clip((g * inv[..., None]).astype(np.float32), -FP8_MAX, FP8_MAX).astype(FP8)
    q = np.where(bad[..., None], np.uint8(0x7F).view(FP8), q)
    return q.reshape(*lead, H), np.where(bad, np.float32(np.nan), scale).astype(np.float32)


def dequantize_fp8(q, scales):
    q = np.asarray(q).astype(np.float32)
    *lead, H = q.shape
    return (q.reshape(*lead, H // GROUP, GROUP) * np.asarray(scales, np.float32)[..., None]
            ).reshape(*lead, H)


# ---------------------------------------------------------------------------------------------
# low-latency mode
# ---------------------------------------------------------------------------------------------

def ll_dispatch(xs, idxs, num_experts, max_tokens, use_fp8=False, round_scale=False):
    """Per receiving rank r: {"sets": [L] dicts src -> row content, "num_invalid": int}.

    src = s * M + t. Row content: the bf16 row (as float32), or (fp8 row, scales row) with FP8.
    A token naming one expert in several slots is received once.
    """
    R = len(idxs)
    L = num_experts // R
    M = max_tokens
    cleans, invalid = zip(*[sanitize(i, num_experts) for i in idxs])
    rows = []
    for s in range(R):
        x = np.asarray(xs[s])
        rows.append(quantize_fp8(x, round_scale) if use_fp8 else (x,))
    out = []
    for r in range(R):
        sets = [dict() for _ in range(L)]
        for s in range(R):
            for t in range(cleans[s].shape[0]):
                for e in cleans[s][t]:
                    if e >= 0 and e // L == r:
                        content = tuple(a[t] for a in rows[s])
                        sets[e % L][s * M + t] = content if use_fp8 else content[0]
        out.append(dict(sets=sets, num_invalid=invalid[r]))
    return out


def ll_combine(ys, idxs, ws, recv_srcs, recv_counts, num_experts, max_tokens):
    """out_s[t] = sum_k w[t, k] * y_q[l][row of (s, t) in expert l on q], float32, k order.

    Rows are located through each receiver's recv_src (rows [0, recv_count[l])), so this works
    with any row order. Returned as float32.
    """
    R = len(idxs)
    L = num_experts // R
    M = max_tokens
    where = []  # where[q][l]: src -> row
    for q in range(R):
        src = np.asarray(recv_srcs[q])
        cnt = np.asarray(recv_counts[q])
        where.append([{int(src[l, j]): j for j in range(int(cnt[l]))} for l in range(L)])
    outs = []
    for s in range(R):
        clean, _ = sanitize(idxs[s], num_experts)
        T, K = clean.shape
        H = np.asarray(ys[0]).shape[-1]
        out = np.zeros((T, H), np.float32)
        for t in range(T):
            for k in range(K):
                e = int(clean[t, k])
                if e < 0:
                    continue
                q, l = e // L, e % L
                row = where[q][l][s * M + t]
                out[t] += np.float32(ws[s][t][k]) * np.asarray(ys[q][l][row]).astype(np.float32)
        outs.append(out)
    return outs


def ll_src_rows(idxs, recv_src, rank, num_experts, max_tokens):
    """[R*M, K] src_rows of `rank` (API: LowLatencyHandle.src_rows) from every rank's topk_idx
    and this rank's recv_src [L, R*M] (whose row order the backend chose)."""
    R = len(idxs)
    L = num_experts // R
    M = max_tokens
    K = np.asarray(idxs[0]).shape[1]
    recv_src = np.asarray(recv_src)
    row_of = {(l, int(v)): j for l in range(L) for j, v in enumerate(recv_src[l]) if v >= 0}
    out = np.full((R * M, K), -1, np.int64)
    for s in range(R):
        clean, _ = sanitize(idxs[s], num_experts)
        for t in range(clean.shape[0]):
            for k in range(K):
                e = clean[t, k]
                if e >= 0 and e // L == rank:
                    out[s * M + t, k] = (e % L) * R * M + row_of[(e % L, s * M + t)]
    return out


# ---------------------------------------------------------------------------------------------
# grouped GEMMs (no communication): float64 loops over the groups
# ---------------------------------------------------------------------------------------------

def group_rows(sizes, M):
    """[(start, stop)] of each group's rows: sizes clipped at 0, rows clipped at M."""
    out, start = [], 0
    for s in np.asarray(sizes).astype(np.int64):
        s = max(int(s), 0)
        out.append((min(start, M), min(start + s, M)))
        start += s
    return out


def grouped_matmul(lhs, rhs, sizes):
    """lhs [M, K], rhs [G, K, N] -> float64 [M, N]; rows outside every group are zero."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    M, N = lhs.shape[0], rhs.shape[2]
    out = np.zeros((M, N))
    for g, (a, b) in enumerate(group_rows(sizes, M)):
        out[a:b] = lhs[a:b] @ rhs[g]
    return out


def grouped_matmul_grads(lhs, rhs, sizes, dout):
    """-> (d lhs [M, K], d rhs [G, K, N]) of sum(out * dout), float64."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    dout = np.asarray(dout, np.float64)
    dl, dr = np.zeros_like(lhs), np.zeros_like(rhs)
    for g, (a, b) in enumerate(group_rows(sizes, lhs.shape[0])):
        dl[a:b] = dout[a:b] @ rhs[g].T
        dr[g] = lhs[a:b].T @ dout[a:b]
    return dl, dr


def grouped_matmul_masked(lhs, rhs, counts):
    """lhs [G, C, K], rhs [G, K, N] -> float64 [G, C, N], rows past counts[g] zero."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    G, C, _ = lhs.shape
    out = np.zeros((G, C, rhs.shape[2]))
    for g in range(G):
        c = min(max(int(counts[g]), 0), C)
        out[g, :c] = lhs[g, :c] @ rhs[g]
    return out


def dequantize_weights(data, scales):
    """FP8 weights (data [G, N, K], scales [G, K/128, N/128]) -> float64 [G, K, N]."""
    w = np.swapaxes(np.asarray(data).astype(np.float64), 1, 2)
    s = np.repeat(np.repeat(np.asarray(scales, np.float64), GROUP, axis=1), GROUP, axis=2)
    return w * s


def dequantize_rows(q, scales):
    """FP8 activations (q [..., K], scales [..., K/128]) -> float64."""
    return np.asarray(q).astype(np.float64) * np.repeat(np.asarray(scales, np.float64), GROUP,
                                                        axis=-1)
