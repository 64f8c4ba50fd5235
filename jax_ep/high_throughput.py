"""High-throughput dispatch / combine (training, prefill): arguments, shape rules, custom VJPs.

dispatch = layout + gather of rows (x, FP8 scales, expert ids, weights) to the ranks that hold
their experts, once per rank; combine = gather-and-sum back. With D the linear map x -> recv_x,
combine is D^T, so each is the other's VJP.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _checks, _ffi, reference as ref
from jax_ep import grouped_gemm, remat, runtime


class DispatchHandle(NamedTuple):
    """What combine (and the VJPs) need. A pytree of arrays: fine across jit, scan, remat."""
    recv_src: jax.Array     # [C] int32: src_rank * T + src_token, -1 on padding rows
    send_rows: jax.Array    # [T, R] int32: row of own token t on rank q, -1 if not there
    recv_count: jax.Array   # [] int32
    num_dropped: jax.Array  # [] int32: tokens not received here because capacity was too small
    num_invalid: jax.Array  # [] int32: own expert ids outside [-1, E)


class DispatchResult(NamedTuple):
    recv_x: Any                          # [C, H] (or (fp8 [C, H], scales [C, H // 128]))
    recv_topk_idx: jax.Array             # [C, K] int32 local expert ids, -1 elsewhere
    recv_topk_weights: Optional[jax.Array]  # [C, K] float32, or None
    recv_count: jax.Array                # [] int32
    recv_tokens_per_expert: jax.Array    # [L] int32
    handle: DispatchHandle


class ExpertDispatchHandle(NamedTuple):
    """What combine needs after a `layout="expert"` dispatch. A pytree of arrays."""
    rank: DispatchHandle    # the rank-major receive underneath
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
    recv_x: Any                          # [capacity, H] expert-major rows (or the FP8 tuple)
    recv_weights: Optional[jax.Array]    # [capacity] float32 routing weight of each row
    expert_sizes: jax.Array              # [L] int32 segment lengths (group sizes of a GEMM)
    expert_offsets: jax.Array            # [L] int32 segment starts
    recv_tokens_per_expert: jax.Array    # [L] int32 rows holding data per expert
    recv_count: jax.Array                # [] int32 rows up to the end of the last segment
    handle: ExpertDispatchHandle


LAYOUTS = ("rank", "expert")


# ---------------------------------------------------------------------------------------------
# Backend cores (no autodiff here)
# ---------------------------------------------------------------------------------------------

def _to_bytes(a):
    b = ref.as_bytes(a)
    return b.reshape(a.shape[0], int(np.prod(b.shape[1:], dtype=np.int64)))


def _from_bytes(b, dtype, shape):
    dtype = jnp.dtype(dtype)
    b = b.reshape(*shape, dtype.itemsize)
    return jax.lax.bitcast_convert_type(b if dtype.itemsize > 1 else b[..., 0], dtype)


class _Config(NamedTuple):
    """The static settings of one dispatch and of the combine of its handle."""
    num_experts: int
    capacity: int
    axis_name: str
    backend: str      # "cuda" or "reference"


def _dispatch_core(xs, idx, w, cfg):
    """-> (recv_xs tuple, recv_topk_idx, recv_topk_weights, per_expert, handle)."""
    num_experts, capacity, axis_name, backend = cfg
    R, _ = ref.axis_info(axis_name)
    T, K = idx.shape
    L = num_experts // R
    C = capacity
    if backend == "reference":
        recv_xs, ridx, rw, per_expert, lay = ref.ht_dispatch(
            xs, idx, w, num_experts=num_experts, capacity=C, axis_name=axis_name)
        handle = DispatchHandle(lay["recv_src"], lay["send_rows"], lay["recv_count"],
                                lay["num_dropped"], lay["num_invalid"])
        return recv_xs, ridx, rw, per_expert, handle
    x = xs[0]
    scales = xs[1] if len(xs) > 1 else jnp.zeros((T, 0), jnp.float32)
    xb = _to_bytes(x)
    G = scales.shape[1]
    outs = _ffi.call(
        "jax_ep_ht_dispatch",
        [xb, scales, idx.astype(jnp.int32), w.astype(jnp.float32)],
        [((C, xb.shape[1]), jnp.uint8), ((C, G), jnp.float32), ((C, K), jnp.int32),
         ((C, K), jnp.float32), ((C,), jnp.int32), ((T, R), jnp.int32), ((L,), jnp.int32),
         ((4,), jnp.int32), ((runtime.extension().ht_scratch_words(R, T),), jnp.int32)],
        axis_name=axis_name, num_experts=num_experts, num_blocks=runtime.num_blocks())
    rxb, rscales, ridx, rw, recv_src, send_rows, per_expert, stats, _ = outs
    recv_x = _from_bytes(rxb, x.dtype, (C,) + x.shape[1:])
    recv_xs = (recv_x, rscales) if len(xs) > 1 else (recv_x,)
    handle = DispatchHandle(recv_src, send_rows, stats[0], stats[1], stats[2])
    return recv_xs, ridx, rw, per_expert, handle


def _gather_core(rows, handle, cfg):
    """Rows [T, ...] to their receivers along an existing layout: [C, ...] (combine's VJP)."""
    axis_name, backend = cfg.axis_name, cfg.backend
    if backend == "reference":
        return ref.ht_gather(rows, handle.send_rows, handle.recv_src, axis_name=axis_name)
    C = handle.recv_src.shape[0]
    rb = _to_bytes(rows)
    stats = jnp.stack([handle.recv_count, handle.num_dropped, handle.num_invalid,
                       jnp.zeros((), jnp.int32)])
    (out,) = _ffi.call("jax_ep_ht_gather", [rb, handle.recv_src, stats],
                       [((C, rb.shape[1]), jnp.uint8)], axis_name=axis_name,
                       num_blocks=runtime.num_blocks())
    return _from_bytes(out, rows.dtype, (C,) + rows.shape[1:])


def _combine_core(y, handle, cfg):
    """y [C, N] -> [T, N] in y's dtype, summed in float32 over the ranks that hold each token."""
    axis_name, backend = cfg.axis_name, cfg.backend
    T = handle.send_rows.shape[0]
    if backend == "reference":
        return ref.ht_combine(y, handle.recv_src, T, axis_name=axis_name).astype(y.dtype)
    (out,) = _ffi.call("jax_ep_ht_combine", [y, handle.send_rows],
                       [((T,) + y.shape[1:], y.dtype)], axis_name=axis_name,
                       num_blocks=runtime.num_blocks())
    return out


# ---------------------------------------------------------------------------------------------
# Differentiable wrappers: combine is dispatch's transpose and vice versa
# ---------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch_diff(x, w, idx, cfg):
    (rx,), ridx, rw, per_expert, handle = _dispatch_core((x,), idx, w, cfg)
    return rx, ridx, rw, per_expert, handle


def _dispatch_fwd(x, w, idx, cfg):
    # Named: under jax.checkpoint(policy=jax_ep.remat_policy) outputs and residuals are saved.
    out = remat.named(_dispatch_diff(x, w, idx, cfg), remat.DISPATCH)
    return out, (out[1], out[4])


def _dispatch_bwd(cfg, res, g):
    # The differentiable combine (not its core), so that the backward can itself be
    # differentiated (grad of grad) on every backend.
    ridx, handle = res
    g_rx, _, g_rw, _, _ = g
    dx = _combine_diff(g_rx, handle, cfg)
    # recv_topk_weights[j, k] copies w[src, k] where the expert lives here, else is 0.
    g_rw = jnp.where(ridx >= 0, g_rw.astype(jnp.float32), 0.0)
    dw = _combine_diff(g_rw, handle, cfg)
    return dx, dw, None


_dispatch_diff.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _dispatch_fp8(xs, w, idx, cfg):
    return _dispatch_core(xs, idx, w, cfg)


@_dispatch_fp8.defjvp
def _dispatch_fp8_jvp(cfg, primals, tangents):
    raise TypeError("jax_ep.dispatch: a dispatch of an FP8 tuple (x_fp8, x_scales) is not "
                    "differentiable; dispatch the bfloat16/float32 activations to get gradients")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combine_diff(y, handle, cfg):
    return _combine_core(y, handle, cfg)


def _combine_fwd(y, handle, cfg):
    # the differentiable op (not its core) in forward rules too: grad of grad differentiates them
    return remat.named(_combine_diff(y, handle, cfg), remat.COMBINE), handle


def _combine_bwd(cfg, handle, g):
    return _gather_diff(g, handle, cfg), None


_combine_diff.defvjp(_combine_fwd, _combine_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_diff(rows, handle, cfg):
    """The dispatch's row movement alone (combine's transpose), differentiable in rows."""
    return _gather_core(rows, handle, cfg)


def _gather_fwd(rows, handle, cfg):
    return _gather_diff(rows, handle, cfg), handle


def _gather_bwd(cfg, handle, g):
    return _combine_diff(g, handle, cfg), None


_gather_diff.defvjp(_gather_fwd, _gather_bwd)


# ---------------------------------------------------------------------------------------------
# The expert-major layout: a receiver-side move of the received rows (no communication). Both
# moves are gathers, and so are their transposes (autodiff of a gather would scatter-add).
# ---------------------------------------------------------------------------------------------

def _take_rows(a, rows):
    """a[rows] with zeros where rows is -1."""
    n = a.shape[0]
    if n == 0:      # nothing received (T = 0): every row is padding
        return _ffi.varying([jnp.zeros(rows.shape + a.shape[1:], a.dtype), a, rows])[0]
    return a.at[jnp.where(rows >= 0, rows, n)].get(mode="fill", fill_value=0)


def _pair_weights(w, row_of):
    """[C, K]: for each slot, the summed weight of the slots sharing its row (0 without one)."""
    same = (row_of[:, :, None] == row_of[:, None, :]) & (row_of[:, :, None] >= 0)
    return jnp.sum(jnp.where(same, w.astype(jnp.float32)[:, None, :], 0.0), axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def expand_rows(x, src, row_first, K):
    """[C, H] received rows -> [capacity, H] expert-major rows (row j holds x[src[j] // K]).
    row_first: row_of on the first slot of each pair, -1 on the others."""
    return _take_rows(x, jnp.where(src >= 0, src // K, -1))


def _expand_rows_fwd(x, src, row_first, K):
    return expand_rows(x, src, row_first, K), (src, row_first)


def _expand_rows_bwd(K, res, g):
    src, row_first = res
    C = row_first.shape[0]
    dx = jnp.sum(_take_rows(g, row_first.reshape(C * K)).reshape(C, K, *g.shape[1:])
                 .astype(jnp.float32), axis=1)
    return dx.astype(g.dtype), None, None


expand_rows.defvjp(_expand_rows_fwd, _expand_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def reduce_rows(y, w, src, row_of, K):
    """[capacity, H] expert-major rows, [C, K] weights -> [C, H] float32: row c is
    sum_k w[c, k] * y[row_of[c, k]] over the slots with a row."""
    C = w.shape[0]
    # a product and a sum (not an einsum, which XLA would make a batched dot of the gathered
    # rows): one fusion that reads each row of y once
    yg = _take_rows(y, row_of.reshape(C * K)).reshape(C, K, y.shape[-1]).astype(jnp.float32)
    return jnp.sum(yg * w.astype(jnp.float32)[:, :, None], axis=1)


def _reduce_rows_fwd(y, w, src, row_of, K):
    return reduce_rows(y, w, src, row_of, K), (y, w, src, row_of)


def _reduce_rows_bwd(K, res, g):
    y, w, src, row_of = res
    C = w.shape[0]
    wj = _take_rows(_pair_weights(w, row_of).reshape(C * K), src)
    dy = (_take_rows(g, jnp.where(src >= 0, src // K, -1)) * wj[:, None]).astype(y.dtype)
    yg = _take_rows(y, row_of.reshape(C * K)).reshape(C, K, y.shape[-1]).astype(jnp.float32)
    dw = jnp.sum(g[:, None, :] * yg, axis=-1)
    return dy, dw.astype(w.dtype), None, None


reduce_rows.defvjp(_reduce_rows_fwd, _reduce_rows_bwd)


def _expert_plan(ridx, rw, handle, L, capacity, alignment, has_weights):
    """Where a rank-major receive's rows go in the expert-major layout, without moving them:
    (layout dict of ref.expert_layout, the rows' weights or None, the ExpertDispatchHandle)."""
    C, K = ridx.shape
    lay = ref.expert_layout(ridx, num_local_experts=L, capacity=capacity, alignment=alignment)
    src, row_of = lay["src"], lay["row_of"]
    # without weights each (token, expert) pair weighs 1, however many slots name it
    w = rw if has_weights else ref.first_occurrence(ridx).astype(jnp.float32)
    we = _take_rows(_pair_weights(w, row_of).reshape(C * K), src)
    ehandle = ExpertDispatchHandle(handle, row_of, src, w,
                                   handle.num_dropped + lay["num_dropped"])
    return lay, (we if has_weights else None), ehandle


def _to_expert_major(recv_x, ridx, rw, handle, L, capacity, alignment, has_weights):
    """A rank-major receive -> ExpertDispatchResult."""
    K = ridx.shape[1]
    lay, we, ehandle = _expert_plan(ridx, rw, handle, L, capacity, alignment, has_weights)
    src = lay["src"]
    if isinstance(recv_x, tuple):    # FP8: forward only
        rows = jnp.where(src >= 0, src // K, -1)
        xe = tuple(_take_rows(a, rows) for a in recv_x)
    else:
        xe = expand_rows(recv_x, src, jnp.where(ref.first_occurrence(ridx), lay["row_of"], -1), K)
    return ExpertDispatchResult(xe, we, lay["expert_sizes"], lay["expert_offsets"], lay["counts"],
                                lay["recv_count"], ehandle)


def _routing_checks(T, H, topk_idx, topk_weights):
    """The token side of a dispatch: hidden size, top-k ids and weights."""
    _checks.hidden("x", H)
    _checks.topk("topk_idx", topk_idx, T)
    if topk_weights is not None:
        _checks.weights("topk_weights", topk_weights, topk_idx.shape)


def _group_checks(num_experts, axis_name, T):
    """The EP group of a dispatch: (R, L)."""
    R, _ = ref.axis_info(axis_name)
    _checks.group_size(R, axis_name)
    L = _checks.experts_per_rank(num_experts, R)
    if R * T > _checks.INT32_LIMIT:
        raise ValueError(f"x: R * T = {R * T} tokens in the EP group; row ids are int32, so it "
                         f"must be < 2^31")
    return R, L


# ---------------------------------------------------------------------------------------------
# Fused dispatch + first grouped GEMM (moe_ffn(fused=True), docs/kernels.md#fused-gather-gemm):
# the routing moves no rows (a rank-major dispatch of zero-width rows); one kernel then pulls
# each expert-major row from its token's rank and multiplies every expert segment by the
# expert's weights as its rows arrive.
# ---------------------------------------------------------------------------------------------

class _FusedConfig(NamedTuple):
    cfg: _Config      # the routing dispatch's (its combine returns the rows' cotangents)
    K: int
    copy_blocks: int  # blocks that pull rows (0: the kernel's automatic share)


def _dedup_plan(rows_src, row_of, ridx, recv_src, T, axis_name, max_dups):
    """Each token of another rank crosses the link once: (rows_src with -2 on the rows that are
    copies of an earlier row of the same token, rows_dups [C, D]: the copies of each token's
    first row (its lowest expert's), -1 padded, D = min(K - 1, max_dups), the kernel's limit
    `jax_ep._C.fused_max_dups`). D = 0 (nothing deduplicated) with one rank or one row per
    token."""
    C = rows_src.shape[0]
    R, rank = ref.axis_info(axis_name)
    D = min(row_of.shape[1] - 1, max_dups)
    if R == 1 or D <= 0:
        return rows_src, jnp.zeros((C, 0), jnp.int32)
    valid = (row_of >= 0) & ref.first_occurrence(ridx)        # the token's distinct rows
    first = jnp.min(jnp.where(valid, row_of, C), axis=1)      # [Cr] its lowest row
    remote = (recv_src >= 0) & (recv_src // T != rank)
    copies = valid & (row_of != first[:, None]) & remote[:, None]
    dups = -jnp.sort(-jnp.where(copies, row_of, -1), axis=1)[:, :D]   # highest D copies first
    # only the copies listed are skipped where they lie (a token with more than D copies reads
    # the rest itself)
    listed = copies & (row_of >= dups[:, D - 1:D])
    rows_dups = jnp.full((C, D), -1, jnp.int32).at[
        jnp.where(jnp.any(copies, axis=1), first, C)].set(dups.astype(jnp.int32), mode="drop")
    rows_src = rows_src.at[jnp.where(listed, row_of, C).reshape(-1)].set(-2, mode="drop")
    return rows_src, rows_dups


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _gather_matmul(x, w, rows_src, rows_dups, sizes, counts, src, row_first, handle, fcfg):
    """(xe, h): xe[j] = the token of rows_src[j] (zero where -1; where -2, that of the row whose
    rows_dups name j), h = grouped_matmul(xe, w, sizes), in one launch. counts: the rows of
    each segment that hold data (the rest is padding up to the row block)."""
    del counts, src, row_first, handle
    C, H, N = rows_src.shape[0], x.shape[1], w.shape[2]
    words = runtime.extension().fused_counter_words(C)
    xe, h, _ = _ffi.call("jax_ep_ht_gather_gemm", [x, rows_src, rows_dups, sizes, w],
                         [((C, H), x.dtype), ((C, N), x.dtype), ((words,), jnp.int32)],
                         axis_name=fcfg.cfg.axis_name, num_blocks=runtime.num_blocks(),
                         copy_blocks=fcfg.copy_blocks)
    return xe, h


def _gather_matmul_fwd(x, w, rows_src, rows_dups, sizes, counts, src, row_first, handle, fcfg):
    # Named like dispatch's outputs: under jax.checkpoint(policy=jax_ep.remat_policy) the
    # backward reuses them instead of running the kernel again.
    xe, h = remat.named(_gather_matmul(x, w, rows_src, rows_dups, sizes, counts, src, row_first,
                                       handle, fcfg),
                        remat.DISPATCH)
    return (xe, h), (xe, w, sizes, counts, src, row_first, handle)


def _gather_matmul_bwd(fcfg, res, g):
    xe, w, sizes, counts, src, row_first, handle = res
    g_xe, g_h = g
    # the weight gradient skips each segment's padding rows (zeros in xe)
    gmm = functools.partial(grouped_gemm._padded_segments_matmul, sizes=sizes, counts=counts)
    _, vjp = jax.vjp(gmm, xe, w)
    d_xe, d_w = vjp(g_h.astype(xe.dtype))
    d_xe = (d_xe.astype(jnp.float32) + g_xe.astype(jnp.float32)).astype(xe.dtype)
    d_rows = _expand_rows_bwd(fcfg.K, (src, row_first), d_xe)[0]
    dx = _combine_diff(d_rows, handle, fcfg.cfg)
    return dx, d_w, None, None, None, None, None, None, None


_gather_matmul.defvjp(_gather_matmul_fwd, _gather_matmul_bwd)


def dispatch_matmul(x, topk_idx, topk_weights, w, *, num_experts, axis_name="ep", capacity=None,
                    backend="auto", copy_blocks=0):
    """`dispatch(layout="expert")` fused with `grouped_matmul(recv_x, w, expert_sizes)`.

    Returns (ExpertDispatchResult, h [capacity, N]). On the CUDA backend x and w are bfloat16
    and the segments start at multiples of the kernel's row block (`expert_alignment` of
    `jax_ep._C.fused_block_rows`); the reference backend runs the two ops unfused (segments
    unaligned). Differentiable in x, topk_weights and w. copy_blocks: blocks of the launch that
    pull rows (0: automatic, docs/kernels.md#fused-gather-gemm).
    """
    _checks.expect_rank("x", x, 2, "[T, H]")
    T, H = x.shape
    be = _checks.resolve_backend(backend, empty=T == 0)
    if be == "reference":
        res = dispatch(x, topk_idx, topk_weights, num_experts=num_experts, axis_name=axis_name,
                       capacity=capacity, layout="expert", backend=be)
        return res, grouped_gemm.grouped_matmul(res.recv_x, w, res.expert_sizes, backend=be)
    for name, a in (("x", x), ("w_gate_up", w)):
        if jnp.dtype(a.dtype) != jnp.bfloat16:
            raise TypeError(f"{name}: the fused dispatch + grouped GEMM takes bfloat16, got "
                            f"{jnp.dtype(a.dtype).name} (fused=False takes every dtype)")
    _routing_checks(T, H, topk_idx, topk_weights)
    R, L = _group_checks(num_experts, axis_name, T)
    K = topk_idx.shape[1]
    A = runtime.extension().fused_block_rows
    worst = R * T * min(K, L) + L * (A - 1)
    capacity = worst if capacity is None else _checks.static_int("capacity", capacity, 1)
    if max(R * T * K, capacity) > _checks.INT32_LIMIT:
        raise ValueError(f"capacity={capacity}, R * T * K = {R * T * K}: rows are indexed in "
                         "int32, so each must be < 2^31")
    copy_blocks = _checks.static_int("copy_blocks", copy_blocks, 0)
    cfg = _Config(int(num_experts), min(R * T, capacity), axis_name, be)
    idx = _checks.int32_ids(topk_idx, num_experts)
    wts = (jnp.zeros(topk_idx.shape, jnp.float32) if topk_weights is None
           else topk_weights.astype(jnp.float32))
    x, wts = _ffi.varying([x, wts, idx], axis_name)[:2]
    # the routing alone: a dispatch of zero-width rows (differentiable in the weights)
    _, ridx, rw, _, handle = _dispatch_diff(jnp.zeros((T, 0), x.dtype), wts, idx, cfg)
    lay, we, ehandle = _expert_plan(ridx, rw, handle, L, capacity, A, topk_weights is not None)
    src = lay["src"]
    rows_src = jnp.where(src >= 0, handle.recv_src[jnp.maximum(src, 0) // K], -1)
    row_first = jnp.where(ref.first_occurrence(ridx), lay["row_of"], -1)
    rows_src, rows_dups = _dedup_plan(rows_src, lay["row_of"], ridx, handle.recv_src, T,
                                      axis_name, runtime.extension().fused_max_dups)
    xe, h = _gather_matmul(x, w, rows_src, rows_dups, lay["expert_sizes"], lay["counts"], src,
                           row_first, handle, _FusedConfig(cfg, K, copy_blocks))
    return ExpertDispatchResult(xe, we, lay["expert_sizes"], lay["expert_offsets"],
                                lay["counts"], lay["recv_count"], ehandle), h


# ---------------------------------------------------------------------------------------------
# Fused second grouped GEMM + combine (moe_ffn(fused=True), docs/kernels.md#fused-gemm-combine):
# one kernel multiplies each expert segment by the expert's weights and sums every token's
# rows on its own rank, a token starting once the row blocks of its rows are computed on every
# rank. The same arithmetic as grouped_matmul followed by combine(handle).
# ---------------------------------------------------------------------------------------------

class _CombineConfig(NamedTuple):
    cfg: _Config         # the combine's (axis, backend)
    K: int
    combine_blocks: int  # blocks that only combine (0: the kernel's automatic share)


def _gemm_combine_call(a, w, weights, sizes, row_of, rank, ccfg):
    """(ye, out): ye = grouped_matmul(a, w, sizes), out = its combine, in one launch."""
    C, N = a.shape[0], w.shape[2]
    T = rank.send_rows.shape[0]
    words = runtime.extension().fused_counter_words(C)
    ye, out, _ = _ffi.call("jax_ep_ht_gemm_combine",
                           [a, sizes, w, row_of, weights, rank.send_rows],
                           [((C, N), a.dtype), ((T, N), a.dtype), ((words,), jnp.int32)],
                           axis_name=ccfg.cfg.axis_name, num_blocks=runtime.num_blocks(),
                           combine_blocks=ccfg.combine_blocks)
    return ye, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _matmul_combine(a, w, weights, sizes, counts, row_of, src, rank, ccfg):
    """combine(grouped_matmul(a, w, sizes), handle) in one launch: [T, N] in a's dtype.
    counts: the rows of each segment that hold data (the backward's weight gradient)."""
    del counts, src
    return _gemm_combine_call(a, w, weights, sizes, row_of, rank, ccfg)[1]


def _matmul_combine_fwd(a, w, weights, sizes, counts, row_of, src, rank, ccfg):
    # Named like combine's outputs (the backward's ye too: see _gather_matmul_fwd).
    ye, out = remat.named(_gemm_combine_call(a, w, weights, sizes, row_of, rank, ccfg),
                          remat.COMBINE)
    return out, (a, w, ye, weights, sizes, counts, row_of, src, rank)


def _matmul_combine_bwd(ccfg, res, g):
    # The unfused ops' backward, rule by rule: combine's (a gather), the pre-reduction's (on
    # the kernel's GEMM rows ye), the GEMM's (its forward, unused, is dropped by XLA).
    a, w, ye, weights, sizes, counts, row_of, src, rank = res
    g_rows = _gather_diff(g, rank, ccfg.cfg).astype(jnp.float32)
    d_ye, d_weights, _, _ = _reduce_rows_bwd(ccfg.K, (ye, weights, src, row_of), g_rows)
    gmm = functools.partial(grouped_gemm._padded_segments_matmul, sizes=sizes, counts=counts)
    _, vjp = jax.vjp(gmm, a, w)
    d_a, d_w = vjp(d_ye)
    return d_a, d_w, d_weights, None, None, None, None, None


_matmul_combine.defvjp(_matmul_combine_fwd, _matmul_combine_bwd)


def matmul_combine(a, w, res, *, axis_name="ep", backend="auto", combine_blocks=0):
    """`combine(grouped_matmul(a, w, res.expert_sizes), res.handle)` fused in one launch.

    a: `[capacity, I]` expert-major rows of the `ExpertDispatchResult` res of `dispatch_matmul`
    (on the CUDA backend bfloat16, one process over the group's GPUs; its segments start at
    multiples of `jax_ep._C.fused_block_rows` rows, which the kernel relies on: a result of
    `dispatch(layout="expert")` needs that `expert_alignment`); w: `[L, I, N]`. Returns
    `[T, N]` in a's dtype. Elsewhere (the reference backend, per-process groups) it runs the
    two ops.
    Differentiable in a, w and the routing weights. combine_blocks: blocks of the launch that
    only combine (0: automatic, docs/kernels.md#fused-gemm-combine).
    """
    if not isinstance(res, ExpertDispatchResult):
        raise TypeError(f"res: expected the ExpertDispatchResult of dispatch_matmul, got "
                        f"{type(res).__name__}")
    handle = res.handle
    rank = handle.rank
    combine_blocks = _checks.static_int("combine_blocks", combine_blocks, 0)
    _checks.expect_rank("a", a, 2, "[capacity, I]")
    if a.shape[0] != handle.src.shape[0]:
        raise ValueError(f"a: has {a.shape[0]} rows, expected capacity={handle.src.shape[0]} "
                         "(one per expert-major row of the dispatch)")
    be = _checks.resolve_backend(backend, empty=rank.send_rows.shape[0] == 0)
    if be == "reference" or runtime.per_process():
        y = grouped_gemm.grouped_matmul(a, w, res.expert_sizes, backend=be)
        return combine(y, handle, axis_name=axis_name, backend=be)
    for name, v in (("a", a), ("w_down", w)):
        if jnp.dtype(v.dtype) != jnp.bfloat16:
            raise TypeError(f"{name}: the fused grouped GEMM + combine takes bfloat16, got "
                            f"{jnp.dtype(v.dtype).name}")
    K = handle.row_of.shape[1]
    cfg = _Config(0, rank.recv_src.shape[0], axis_name, be)
    a, weights = _ffi.varying([a, handle.weights, rank.recv_src], axis_name)[:2]
    return _matmul_combine(a, w, weights, res.expert_sizes, res.recv_tokens_per_expert,
                           handle.row_of, handle.src, rank, _CombineConfig(cfg, K, combine_blocks))


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------

def _check_counts(check, res, axis_name):
    """res, gated by check=True's host check of its invalid ids and dropped rows."""
    if not runtime.check_enabled(check):
        return res
    handle = res.handle
    what = ("tokens or (token, expert) rows" if isinstance(handle, ExpertDispatchHandle)
            else "tokens")

    def message(v, t):
        return (f"jax_ep.dispatch(check=True): {v[0]} expert ids outside [-1, E) and {v[1]} "
                f"{what} dropped for lack of capacity on this rank ({t[0]} and {t[1]} over all "
                "shards)")

    return _checks.checked_result(res, "dispatch", {"num_invalid": handle.num_invalid,
                                                    "num_dropped": handle.num_dropped},
                                  axis_name, message)


def recommended_capacity(tokens_per_rank, *, num_experts, num_topk, num_ranks,
                         capacity_factor=1.25, multiple=8) -> int:
    """A `capacity` for `dispatch` from the expected load.

    The rows a rank receives on average when each of the `num_ranks * tokens_per_rank` tokens
    picks `num_topk` distinct experts uniformly (a token reaches a rank when one of its experts
    is there: probability 1 - C(E - L, K) / C(E, K) with L = E / R experts per rank), times
    `capacity_factor`, rounded up to a multiple of `multiple`, at most the worst case `R * T`
    (which never drops) and at least 1. Skewed routers need a larger factor: `handle.num_dropped`
    counts what did not fit, and drops are shared fairly across the sources (docs/API.md).
    """
    T = _checks.static_int("tokens_per_rank", tokens_per_rank, 0)
    R = _checks.static_int("num_ranks", num_ranks, 1)
    E = _checks.static_int("num_experts", num_experts, 1)
    K = _checks.static_int("num_topk", num_topk, 1)
    A = _checks.static_int("multiple", multiple, 1)
    if E % R:
        raise ValueError(f"num_experts={E} must be divisible by num_ranks={R}")
    if K > E:
        raise ValueError(f"num_topk={K} is more than num_experts={E}")
    f = capacity_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
        raise ValueError(f"capacity_factor must be a finite number above 0, got {f!r}")
    L = E // R
    miss = 1.0
    for i in range(K):  # probability that none of the K distinct experts is on a given rank
        miss *= max(E - L - i, 0) / (E - i)
    rows = math.ceil(R * T * (1.0 - miss) * f)
    rows = -(-rows // A) * A
    return int(max(1, min(rows, R * T)))


def dispatch(x, topk_idx, topk_weights=None, *, num_experts, axis_name="ep", capacity=None,
             layout="rank", expert_alignment=1, backend="auto", check=None):
    """Send each token once to every rank that holds one of its top-k experts.

    Runs per shard inside `jax.shard_map` over `axis_name` (R ranks on that axis; expert e lives
    on rank e // L, L = num_experts // R, as local expert e % L).

    Args:
      x: `[T, H]` float32, bfloat16 or float16; or an FP8 tuple `(x_fp8 [T, H] float8_e4m3fn,
        x_scales [T, H // 128] float32)` (value = fp8 * scale per row and 128 columns).
        T = 0 is allowed (every shard empty).
      topk_idx: `[T, K]` int32 (int64 accepted) expert ids; -1 marks an unused slot, ids
        outside [-1, E) count in `handle.num_invalid` and act as -1.
      topk_weights: `[T, K]` float32, bfloat16 or float16 (computed in float32), or None.
      num_experts: E, a multiple of R.
      axis_name: the EP axis of the enclosing shard_map.
      capacity: rows of the receive buffer (static, below 2^31). Default R * T, the worst
        case: nothing is ever dropped. Tokens past it are dropped and counted in
        `handle.num_dropped`. With layout="expert": rows of the expert-major buffer, default
        R * T * min(K, L) + L * (expert_alignment - 1), the worst case.
      layout: "rank" (one row per received token, by source rank) or "expert" (one row per
        (token, local expert) pair, grouped by expert: `ExpertDispatchResult`).
      expert_alignment: with layout="expert", every expert's segment starts at a multiple of
        it (static int >= 1).
      backend: "auto" (CUDA kernels on GPUs, else the reference), "reference" or "cuda".
      check: True raises when ids were invalid or tokens dropped (default: JAX_EP_CHECK).

    Returns:
      DispatchResult: `recv_x` `[capacity, H]` (same dtype or FP8 tuple as x; every token
      with an expert here once, rows [0, recv_count) ordered by source rank then token, zeros
      after); `recv_topk_idx` `[capacity, K]` local expert ids (-1 for other ranks' experts and
      padding); `recv_topk_weights` `[capacity, K]` float32 (0 where the id is -1; None without
      topk_weights); `recv_count` `[]`; `recv_tokens_per_expert` `[L]`; `handle` for `combine`.
      With layout="expert", an ExpertDispatchResult: `recv_x` `[capacity, H]` with expert e's
      rows at `[expert_offsets[e], expert_offsets[e] + recv_tokens_per_expert[e])` (source
      rank, then token), zeros elsewhere; `recv_weights` `[capacity]` float32 (None without
      topk_weights); `expert_sizes` `[L]` (segment lengths with alignment padding: the
      `group_sizes` of `grouped_matmul` over recv_x); `recv_count`; `handle` for `combine`.

    Differentiable in x (its cotangent is `combine` of recv_x's; with layout="expert" the
    unweighted sum of its rows' cotangents) and topk_weights; an FP8 dispatch is forward-only.
    The contract in full: docs/API.md.
    """
    fp8 = isinstance(x, (tuple, list))
    if fp8:
        if len(x) != 2:
            raise ValueError("x: an FP8 input is a tuple (x_fp8 [T, H], x_scales [T, H // 128])")
        xq, xs = x
        _checks.expect_rank("x[0] (x_fp8)", xq, 2, "[T, H]")
        _checks.expect_dtype("x[0] (x_fp8)", xq, (jnp.float8_e4m3fn,))
        T, H = xq.shape
        if H % ref.FP8_GROUP:
            raise ValueError(f"x[0] (x_fp8): hidden size H={H} must be a multiple of 128 for FP8")
        _checks.expect_rank("x[1] (x_scales)", xs, 2, "[T, H // 128]")
        _checks.expect_dtype("x[1] (x_scales)", xs, (jnp.float32,))
        if tuple(xs.shape) != (T, H // ref.FP8_GROUP):
            raise ValueError(f"x[1] (x_scales): shape {tuple(xs.shape)}, expected "
                             f"{(T, H // ref.FP8_GROUP)}")
    else:
        _checks.expect_rank("x", x, 2, "[T, H]")
        _checks.expect_dtype("x", x, _checks.FLOAT_DTYPES)
        T, H = x.shape
    _routing_checks(T, H, topk_idx, topk_weights)
    _checks.flag("check", check, allow_none=True)
    be = _checks.resolve_backend(backend, empty=T == 0)
    R, _ = _group_checks(num_experts, axis_name, T)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")
    A = _checks.static_int("expert_alignment", expert_alignment, 1)
    if layout == "rank" and A != 1:
        raise ValueError(f"expert_alignment={A} applies to layout='expert' only (the rank-major "
                         "layout has no expert segments)")
    K, L = topk_idx.shape[1], num_experts // R
    # a received token has at most min(K, L) pairs here (one per distinct local expert)
    worst = R * T if layout == "rank" else R * T * min(K, L) + L * (A - 1)
    if layout == "expert" and max(R * T * K, L * A) > _checks.INT32_LIMIT:
        raise ValueError(f"expert_alignment={A}: R * T * K = {R * T * K} (token, slot) pairs and "
                         f"L * expert_alignment = {L * A} rows are indexed in int32, so each "
                         "must be < 2^31")
    capacity = worst if capacity is None else _checks.static_int("capacity", capacity, 1)
    if capacity > _checks.INT32_LIMIT:
        raise ValueError(f"capacity={capacity}: rows are indexed in int32, so it must be < 2^31 "
                         f"(at most {worst} rows can arrive)")
    # Expert-major: every received token has at least one pair here, so min(R * T, capacity)
    # received rows drop nothing whenever all pairs fit.
    cfg = _Config(int(num_experts), capacity if layout == "rank" else min(R * T, capacity),
                  axis_name, be)
    idx = _checks.int32_ids(topk_idx, num_experts)
    w = (jnp.zeros(topk_idx.shape, jnp.float32) if topk_weights is None
         else topk_weights.astype(jnp.float32))
    if fp8:
        recv_xs, ridx, rw, per_expert, handle = _dispatch_fp8(tuple(x), w, idx, cfg)
        recv_x = tuple(recv_xs)
    else:
        # Differentiable inputs varying along every axis the call varies along: a replicated
        # x or w (a constant, or None's zeros) then gets its cotangent summed over the shards by
        # the transpose of that cast, and the custom VJP's output types match its inputs.
        x, w = _ffi.varying([x, w, idx], axis_name)[:2]
        recv_x, ridx, rw, per_expert, handle = _dispatch_diff(x, w, idx, cfg)
    if layout == "expert":
        res = _to_expert_major(recv_x, ridx, rw, handle, L, capacity, A,
                               topk_weights is not None)
        return _check_counts(check, res, axis_name)
    return _check_counts(check, DispatchResult(recv_x, ridx, None if topk_weights is None else rw,
                                               handle.recv_count, per_expert, handle), axis_name)


def combine(y, handle, *, axis_name="ep", backend="auto", check=None):
    """Send expert outputs back to their tokens and sum them: the transpose of `dispatch`.

    Args:
      y: `[capacity, H]` float32, bfloat16 or float16, one row per `recv_x` row of the dispatch
        (typically the weighted sum of the local experts' outputs; with layout="expert", one
        row per (token, expert) row, unweighted).
      handle: the dispatch's `handle` (a DispatchHandle or an ExpertDispatchHandle).
      axis_name, backend: as for `dispatch`. `check` is accepted and has no effect.

    Returns:
      `[T, H]` in y's dtype: for each token, the sum over the ranks that received it of their
      row, accumulated in float32; a token sent nowhere gives 0. After a layout="expert"
      dispatch each rank first sums its rows of the token weighted by their routing weights
      (1 per pair without topk_weights), in float32, rounded once to y's dtype.
      Differentiable in y (its cotangent is the dispatch of out's, weighted for the expert
      layout) and, for the expert layout, in the routing weights of the dispatch.
    """
    del check  # combine cannot drop or see invalid ids; accepted for uniformity
    expert = isinstance(handle, ExpertDispatchHandle)
    if not isinstance(handle, (DispatchHandle, ExpertDispatchHandle)):
        raise TypeError(f"handle: expected the handle of a dispatch (DispatchHandle or "
                        f"ExpertDispatchHandle), got {type(handle).__name__}")
    rank = handle.rank if expert else handle
    _checks.expect_rank("y", y, 2, "[capacity, H]")
    _checks.expect_dtype("y", y, _checks.FLOAT_DTYPES)
    C = (handle.src if expert else rank.recv_src).shape[0]
    if y.shape[0] != C:
        raise ValueError(f"y: has {y.shape[0]} rows, expected capacity={C} (one per recv_x row "
                         "of the dispatch)")
    be = _checks.resolve_backend(backend, empty=rank.send_rows.shape[0] == 0)
    R, _ = ref.axis_info(axis_name)
    if rank.send_rows.shape[1] != R:
        raise ValueError(f"handle: made for an EP group of {rank.send_rows.shape[1]} ranks, "
                         f"but axis {axis_name!r} has {R}")
    cfg = _Config(0, rank.recv_src.shape[0], axis_name, be)
    if expert:
        y, w = _ffi.varying([y, handle.weights, rank.recv_src], axis_name)[:2]
        y = reduce_rows(y, w, handle.src, handle.row_of, handle.row_of.shape[1]).astype(y.dtype)
    else:
        (y,) = _ffi.varying([y, rank.recv_src], axis_name)[:1]
    return _combine_diff(y, rank, cfg)
