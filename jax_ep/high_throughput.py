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

from jax_ep import _checks, _ffi, reference as ref, remat, runtime
from jax_ep._common import FP8_GROUP, as_bytes, axis_info, inclusive_count, sanitize
from jax_ep.expert_layout import (ExpertDispatchHandle, ExpertDispatchResult, reduce_rows,
                                  take_rows as el_take_rows, to_expert_major)


class DispatchHandle(NamedTuple):
    """What combine (and the VJPs) need. A pytree of arrays: fine across jit, scan, remat."""
    recv_src: jax.Array     # [C] int32: src_rank * T + src_token, -1 on padding rows
    send_rows: jax.Array    # [T, R] int32: row of own token t on rank q, -1 if not there
    recv_count: jax.Array   # [] int32
    num_dropped: jax.Array  # [] int32: tokens not received here because capacity was too small
    num_invalid: jax.Array  # [] int32: own expert ids outside [-1, E)


class DispatchResult(NamedTuple):
    """What `dispatch` returns (layout="rank"): the received rows and the `handle` for
    `combine`. Fields as in `dispatch`'s Returns."""
    recv_x: Any                          # [C, H] (or (fp8 [C, H], scales [C, H // 128]))
    recv_topk_idx: jax.Array             # [C, K] int32 local expert ids, -1 elsewhere
    recv_topk_weights: Optional[jax.Array]  # [C, K] float32, or None
    recv_count: jax.Array                # [] int32
    recv_tokens_per_expert: jax.Array    # [L] int32
    handle: DispatchHandle


LAYOUTS = ("rank", "expert")


# ---------------------------------------------------------------------------------------------
# Backend cores (no autodiff here)
# ---------------------------------------------------------------------------------------------

def _to_bytes(a):
    b = as_bytes(a)
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
    R, _ = axis_info(axis_name)
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
    if g_rx.ndim == 2 and g_rx.shape[1] == 0:   # zero-width rows (a routing alone): no launch
        dx = _ffi.varying([jnp.zeros((handle.send_rows.shape[0], 0), g_rx.dtype), g_rx],
                          cfg.axis_name)[0]
    else:
        dx = _combine_diff(g_rx, handle, cfg)
    # recv_topk_weights[j, k] copies w[src, k] where the expert lives here, else is 0.
    g_rw = jnp.where(ridx >= 0, g_rw.astype(jnp.float32), 0.0)
    dw = _combine_diff(g_rw, handle, cfg)
    return dx, dw, None


_dispatch_diff.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _received_weights(w, recv_src, send_rows, mine):
    """[C, K]: w [T, K] of each received token (recv_src) where mine, else 0 (one rank)."""
    return jnp.where(mine, w[jnp.maximum(recv_src, 0)], 0.0)


def _received_weights_fwd(w, recv_src, send_rows, mine):
    return _received_weights(w, recv_src, send_rows, mine), (send_rows, mine)


def _received_weights_bwd(res, g):
    # each token is received at most once: the transpose of the gather is the gather by the
    # tokens' rows (as the dispatch's rule, a combine), not a scatter-add
    send_rows, mine = res
    return (el_take_rows(jnp.where(mine, g, 0.0), send_rows[:, 0]), None, None, None)


_received_weights.defvjp(_received_weights_fwd, _received_weights_bwd)


def routing_one_rank(w, idx, cfg):
    """(recv_topk_idx, recv_topk_weights, handle) of a dispatch of zero-width rows over a group
    of one rank, in XLA ops instead of a launch: the same arrays as `_dispatch_diff`'s, every
    token with an expert received in token order up to cfg.capacity (the reference's
    `ht_layout` with R = 1). Differentiable in w (float32 [T, K])."""
    T, K = idx.shape
    C = cfg.capacity
    clean, num_invalid = sanitize(idx, cfg.num_experts)
    if T == 0:      # nothing sent: every row is padding
        none = jnp.zeros((), jnp.int32)
        handle = DispatchHandle(jnp.full((C,), -1, jnp.int32), jnp.zeros((0, 1), jnp.int32),
                                none, none, num_invalid)
        return jnp.full((C, K), -1, jnp.int32), jnp.zeros((C, K), jnp.float32), handle
    sent = jnp.any(clean >= 0, axis=1)                                         # [T]
    row = inclusive_count(sent) - 1
    kept = sent & (row < C)
    tokens = jnp.arange(T, dtype=jnp.int32)
    # (the tokens not kept go past the end, each to its own index, and are dropped)
    recv_src = jnp.full((C,), -1, jnp.int32).at[jnp.where(kept, row, C + tokens)].set(
        tokens, mode="drop", unique_indices=True)
    send_rows = jnp.where(kept, row, -1)[:, None]
    ids = clean[jnp.maximum(recv_src, 0)]
    mine = (recv_src >= 0)[:, None] & (ids >= 0)
    ridx = jnp.where(mine, ids, -1)
    rw = _received_weights(w, recv_src, send_rows, mine)
    sent_count = row[-1] + 1
    recv_count = jnp.minimum(sent_count, C).astype(jnp.int32)
    handle = DispatchHandle(recv_src, send_rows, recv_count, sent_count - recv_count,
                            num_invalid)
    return ridx, rw, handle


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


def _routing_checks(T, H, topk_idx, topk_weights):
    """The token side of a dispatch: hidden size, top-k ids and weights."""
    _checks.hidden("x", H)
    _checks.topk("topk_idx", topk_idx, T)
    if topk_weights is not None:
        _checks.weights("topk_weights", topk_weights, topk_idx.shape)


def _group_checks(num_experts, axis_name, T):
    """The EP group of a dispatch: (R, L)."""
    R, _ = axis_info(axis_name)
    _checks.group_size(R, axis_name)
    L = _checks.experts_per_rank(num_experts, R)
    if R * T > _checks.INT32_LIMIT:
        raise ValueError(f"x: R * T = {R * T} tokens in the EP group; row ids are int32, so it "
                         f"must be < 2^31")
    return R, L


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


def recommended_capacity(tokens_per_rank: int, *, num_experts: int, num_topk: int,
                         num_ranks: int, capacity_factor: float = 1.25, multiple: int = 8,
                         ) -> int:
    """A `capacity` for `dispatch` (layout="rank") from the expected load.

    The rows a rank receives on average when each of the `num_ranks * tokens_per_rank` tokens
    picks `num_topk` distinct experts uniformly (a token reaches a rank when one of its experts
    is there: probability 1 - C(E - L, K) / C(E, K) with L = E / R experts per rank), times
    `capacity_factor`, rounded up to a multiple of `multiple`, at most the worst case `R * T`
    (which never drops) and at least 1. Skewed routers need a larger factor: `handle.num_dropped`
    counts what did not fit, and drops are shared fairly across the sources
    (docs/API.md#high-throughput-mode-training-prefill).

    Args:
      tokens_per_rank: T, the tokens each rank dispatches.
      num_experts: E, a multiple of num_ranks. num_topk: K, at most E.
      num_ranks: R, the ranks of the EP group.
      capacity_factor: the margin over the mean load (a finite number above 0).
      multiple: round the result up to a multiple of it.

    Returns:
      The capacity, a Python int in [1, R * T].
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
    f = _checks.capacity_factor(capacity_factor)
    L = E // R
    miss = 1.0
    for i in range(K):  # probability that none of the K distinct experts is on a given rank
        miss *= max(E - L - i, 0) / (E - i)
    rows = math.ceil(R * T * (1.0 - miss) * f)
    rows = -(-rows // A) * A
    return int(max(1, min(rows, R * T)))


def dispatch(x: jax.Array | tuple[jax.Array, jax.Array], topk_idx: jax.Array,
             topk_weights: jax.Array | None = None, *, num_experts: int, axis_name: str = "ep",
             capacity: int | None = None, layout: str = "rank", expert_alignment: int = 1,
             backend: str = "auto", check: bool | None = None,
             ) -> DispatchResult | ExpertDispatchResult:
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
        case: nothing is ever dropped. Tokens past it are dropped, fairly across the sources,
        and counted in `handle.num_dropped`. With layout="expert": rows of the expert-major
        buffer, default R * T * min(K, L) + L * (expert_alignment - 1), the worst case; what a
        smaller one drops: docs/API.md#expert-major-layout.
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
      With layout="expert", an ExpertDispatchResult: `recv_x` `[capacity, H]`, one row per
      (token, local expert) pair in expert segments; `recv_weights` `[capacity]` float32 (None
      without topk_weights); `expert_sizes` `[L]` (the `group_sizes` of `grouped_matmul` over
      recv_x); `expert_offsets`, `recv_tokens_per_expert`, `recv_count`; `handle` for `combine`.

    Differentiable in x and topk_weights; an FP8 dispatch is forward-only. The contract in
    full: docs/API.md#high-throughput-mode-training-prefill (layout="rank") and
    docs/API.md#expert-major-layout (layout="expert").
    """
    fp8 = isinstance(x, (tuple, list))
    if fp8:
        if len(x) != 2:
            raise ValueError("x: an FP8 input is a tuple (x_fp8 [T, H], x_scales [T, H // 128])")
        xq, xs = x
        _checks.expect_rank("x[0] (x_fp8)", xq, 2, "[T, H]")
        _checks.expect_dtype("x[0] (x_fp8)", xq, (jnp.float8_e4m3fn,))
        T, H = xq.shape
        if H % FP8_GROUP:
            raise ValueError(f"x[0] (x_fp8): hidden size H={H} must be a multiple of 128 for FP8")
        _checks.expect_rank("x[1] (x_scales)", xs, 2, "[T, H // 128]")
        _checks.expect_dtype("x[1] (x_scales)", xs, (jnp.float32,))
        if tuple(xs.shape) != (T, H // FP8_GROUP):
            raise ValueError(f"x[1] (x_scales): shape {tuple(xs.shape)}, expected "
                             f"{(T, H // FP8_GROUP)}")
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
        res = to_expert_major(recv_x, ridx, rw, handle, L, capacity, A,
                               topk_weights is not None,
                               runtime.poison_int() if be == "cuda" else None, be)
        return _check_counts(check, res, axis_name)
    return _check_counts(check, DispatchResult(recv_x, ridx, None if topk_weights is None else rw,
                                               handle.recv_count, per_expert, handle), axis_name)


def combine(y: jax.Array, handle: DispatchHandle | ExpertDispatchHandle, *,
            axis_name: str = "ep", backend: str = "auto", check: bool | None = None,
            ) -> jax.Array:
    """Send expert outputs back to their tokens and sum them: the transpose of `dispatch`.

    Args:
      y: `[capacity, H]` float32, bfloat16 or float16, one row per `recv_x` row of the dispatch
        (typically the weighted sum of the local experts' outputs; with layout="expert", one
        row per (token, expert) row, unweighted).
      handle: the dispatch's `handle` (a DispatchHandle or an ExpertDispatchHandle).
      axis_name, backend: as for `dispatch`.
      check: accepted for uniformity, no effect (a combine neither drops nor sees ids).

    Returns:
      `[T, H]` in y's dtype: for each token, the sum over the ranks that received it of their
      row, accumulated in float32; a token sent nowhere gives 0. After a layout="expert"
      dispatch each rank first sums its rows of the token weighted by their routing weights.
      Differentiable in y (its cotangent is the dispatch of out's, weighted for the expert
      layout) and, for the expert layout, in the routing weights of the dispatch.

    The contract in full: docs/API.md#high-throughput-mode-training-prefill and
    docs/API.md#expert-major-layout.
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
    R, _ = axis_info(axis_name)
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
