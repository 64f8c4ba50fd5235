"""Low-latency dispatch / combine (decode): arguments, shape rules, custom VJPs.

Receive layout is expert-major [L, R * M, H] (M = max_tokens_per_rank, static), rows of
expert l valid up to recv_count[l], in any order; FP8 is quantised online (128-column groups).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_ep import _checks, _ffi, reference as ref
from jax_ep import runtime


class LowLatencyHandle(NamedTuple):
    recv_src: jax.Array     # [L, R*M] int32: src_rank * M + src_token, -1 past recv_count
    src_to_row: jax.Array   # [R, M, L] int32: row of (source s, token t) in expert l here, or -1
    num_invalid: jax.Array  # [] int32


class LowLatencyResult(NamedTuple):
    recv_x: Any             # [L, R*M, H] bf16, or (fp8 [L, R*M, H], scales [L, R*M, H // 128])
    recv_count: jax.Array   # [L] int32
    handle: LowLatencyHandle


def _dispatch_core(x, idx, cfg):
    num_experts, M, use_fp8, round_scale, axis_name, backend = cfg
    if backend == "reference":
        rx, cnt, src, s2r, inv = ref.ll_dispatch(
            x, idx, num_experts=num_experts, max_tokens_per_rank=M, use_fp8=use_fp8,
            round_scale=round_scale, axis_name=axis_name)
        return rx, cnt, LowLatencyHandle(src, s2r, inv)
    R, _ = ref.axis_info(axis_name)
    T, H = x.shape
    L = num_experts // R
    G = H // ref.FP8_GROUP if use_fp8 else 0
    staging = H + 4 * G if use_fp8 else 2 * H
    outs = _ffi.call(
        "jax_ep_ll_dispatch", [x, idx.astype(jnp.int32)],
        [((L, R * M, H), jnp.float8_e4m3fn if use_fp8 else jnp.bfloat16),
         ((L, R * M, G), jnp.float32), ((L,), jnp.int32), ((L, R * M), jnp.int32),
         ((R, M, L), jnp.int32), ((2,), jnp.int32), ((M, staging), jnp.uint8)],
        axis_name=axis_name, num_experts=num_experts, max_tokens=M, use_fp8=bool(use_fp8),
        round_scale=bool(round_scale), num_blocks=runtime.num_blocks())
    rx, rs, cnt, src, s2r, stats, _ = outs
    return ((rx, rs) if use_fp8 else rx), cnt, LowLatencyHandle(src, s2r, stats[0])


def _combine_core(y, idx, w, src_to_row, cfg):
    num_experts, axis_name, backend = cfg
    if backend == "reference":
        return ref.ll_combine(y, idx, w, src_to_row, num_experts=num_experts,
                              axis_name=axis_name)
    T = idx.shape[0]
    (out,) = _ffi.call("jax_ep_ll_combine",
                       [y, idx.astype(jnp.int32), w.astype(jnp.float32), src_to_row],
                       [((T, y.shape[-1]), jnp.bfloat16)], axis_name=axis_name,
                       num_experts=num_experts, num_blocks=runtime.num_blocks())
    return out


# dispatch (bf16): its transpose is a combine with unit weight on each (token, expert) once.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dispatch_diff(x, idx, cfg):
    return _dispatch_core(x, idx, cfg)


def _dispatch_fwd(x, idx, cfg):
    out = _dispatch_diff(x, idx, cfg)
    return out, (idx, out[2].src_to_row)


def _dispatch_bwd(cfg, res, g):
    idx, src_to_row = res
    num_experts, _, _, _, axis_name, backend = cfg
    g_rx = g[0]
    clean, _ = ref.sanitize(idx, num_experts)
    unit = ref.first_occurrence(clean).astype(jnp.float32)
    dx = _combine_core(g_rx.astype(jnp.bfloat16), idx, unit, src_to_row,
                       (num_experts, axis_name, backend))
    return dx, None


_dispatch_diff.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _dispatch_fp8(x, idx, cfg):
    return _dispatch_core(x, idx, cfg)


@_dispatch_fp8.defjvp
def _dispatch_fp8_jvp(cfg, primals, tangents):
    raise TypeError("jax_ep.low_latency_dispatch(use_fp8=True) is forward only (quantisation has "
                    "no useful gradient); use use_fp8=False to differentiate in x")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine_diff(y, w, idx, src_to_row, cfg):
    return _combine_core(y, idx, w, src_to_row, cfg)


def _combine_fwd(y, w, idx, src_to_row, cfg):
    return _combine_core(y, idx, w, src_to_row, cfg), (y, w, idx, src_to_row)


def _combine_bwd(cfg, res, g):
    """Pure-JAX collectives on the handle (both backends): decode rarely needs this path."""
    y, w, idx, src_to_row = res
    num_experts, axis_name, _ = cfg
    R, r = ref.axis_info(axis_name)
    _, M, L = src_to_row.shape
    T, K = idx.shape
    clean, _ = ref.sanitize(idx, num_experts)
    valid = clean >= 0
    g = jnp.pad(g.astype(jnp.float32), ((0, M - T), (0, 0)))                   # [M, H]
    # per (rank q, token t, local expert l): summed weight of the slots naming that expert
    onehot = (clean[:, :, None] == jnp.arange(R * L)[None, None, :]) & valid[:, :, None]
    wsum = jnp.einsum("tk,tke->te", jnp.where(valid, w, 0.0).astype(jnp.float32),
                      onehot.astype(jnp.float32))
    wsum = jnp.pad(wsum, ((0, M - T), (0, 0))).reshape(M, R, L).transpose(1, 0, 2)  # [R, M, L]
    sent = src_to_row >= 0                                                      # [R(s), M, L]
    got_w = ref._a2a(wsum, axis_name)                                           # [R(s), M, L]
    got_g = ref._a2a(jnp.broadcast_to(g[None], (R,) + g.shape), axis_name)      # [R(s), M, H]
    # dy[l, row] = wsum * g_src[t]
    rows = jnp.where(sent, src_to_row, R * M)
    coef = got_w[..., None] * got_g[:, :, None, :]                              # [R, M, L, H]
    dy = jnp.zeros(y.shape, jnp.float32)
    lidx = jnp.broadcast_to(jnp.arange(L)[None, None, :], sent.shape)
    dy = dy.at[lidx, rows].add(jnp.where(sent[..., None], coef, 0.0), mode="drop")
    # dw[t, k] = <g[t], y_q[l][row(t, k)]>
    yrows = y[jnp.arange(L)[None, None, :], jnp.where(sent, src_to_row, 0)].astype(jnp.float32)
    dots = jnp.where(sent, jnp.einsum("smlh,smh->sml", yrows, got_g), 0.0)      # [R(s), M, L]
    back = ref._a2a(dots, axis_name)                                            # [R(q), M, L]
    q = jnp.where(valid, clean // L, 0)
    l = jnp.where(valid, clean % L, 0)
    dw = jnp.where(valid, back[q, jnp.arange(T)[:, None], l], 0.0)
    return dy.astype(y.dtype), dw.astype(w.dtype), None, None


_combine_diff.defvjp(_combine_fwd, _combine_bwd)


def low_latency_dispatch(x, topk_idx, *, num_experts, max_tokens_per_rank, axis_name="ep",
                         use_fp8=True, round_scale=False, backend="auto",
                         check=None) -> LowLatencyResult:
    """Decode dispatch into the expert-major [L, R * M, H] layout (see API.md)."""
    _checks.expect_rank("x", x, 2, "[T, H]")
    _checks.expect_dtype("x", x, (jnp.bfloat16,))
    T, H = x.shape
    M = _checks.static_int("max_tokens_per_rank", max_tokens_per_rank, 1)
    if T > M:
        raise ValueError(f"x: T={T} tokens is more than max_tokens_per_rank={M}")
    if use_fp8 and H % ref.FP8_GROUP:
        raise ValueError(f"x: hidden size H={H} must be a multiple of 128 with use_fp8=True")
    _checks.topk("topk_idx", topk_idx, T)
    be = _checks.resolve_backend(backend)
    R, _ = ref.axis_info(axis_name)
    _checks.experts_per_rank(num_experts, R)
    cfg = (int(num_experts), M, bool(use_fp8), bool(round_scale), axis_name, be)
    idx = _checks.int32_ids(topk_idx, num_experts)
    fn = _dispatch_fp8 if use_fp8 else _dispatch_diff
    rx, cnt, handle = fn(x, idx, cfg)
    if runtime.check_enabled(check):
        def raise_if(n, total):
            if int(total):
                raise RuntimeError(f"jax_ep.low_latency_dispatch(check=True): {int(n)} expert "
                                   f"ids outside [-1, E) on this rank ({int(total)} over all "
                                   "shards)")
        jax.debug.callback(raise_if, handle.num_invalid,
                           _checks.sum_over_shards(handle.num_invalid, axis_name))
    return LowLatencyResult(rx, cnt, handle)


def low_latency_combine(y, topk_idx, topk_weights, handle: LowLatencyHandle, *, axis_name="ep",
                        backend="auto", check=None):
    """Weighted sum of the expert outputs of each token: [T, H] bfloat16 (see API.md)."""
    del check
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle: expected the LowLatencyHandle of a low_latency_dispatch, got "
                        f"{type(handle).__name__}")
    R_h, M, L = handle.src_to_row.shape
    _checks.expect_rank("y", y, 3, "[L, R * M, H]")
    _checks.expect_dtype("y", y, (jnp.bfloat16,))
    if tuple(y.shape[:2]) != (L, R_h * M):
        raise ValueError(f"y: shape {tuple(y.shape)}, expected ({L}, {R_h * M}, H) like recv_x")
    _checks.expect_rank("topk_idx", topk_idx, 2, "[T, K]")
    _checks.expect_dtype("topk_idx", topk_idx, (jnp.int32, jnp.int64))
    _checks.weights("topk_weights", topk_weights, topk_idx.shape)
    if topk_idx.shape[0] > M:
        raise ValueError(f"topk_idx: T={topk_idx.shape[0]} is more than max_tokens_per_rank={M}")
    be = _checks.resolve_backend(backend)
    R, _ = ref.axis_info(axis_name)
    if R != R_h:
        raise ValueError(f"handle: made for an EP group of {R_h} ranks, but axis "
                         f"{axis_name!r} has {R}")
    cfg = (L * R, axis_name, be)
    return _combine_diff(y, topk_weights, _checks.int32_ids(topk_idx, L * R),
                         handle.src_to_row, cfg)
