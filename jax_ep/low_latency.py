"""Low-latency dispatch / combine (decode): arguments, shape rules, custom VJPs.

Receive layout is expert-major [L, R * M, H] (M = max_tokens_per_rank, static), rows of
expert l valid up to recv_count[l], in any order; FP8 is quantised online (128-column groups).

The CUDA kernels push rows into a receive buffer owned by the op's call site (double-buffered,
no barrier between calls). Each op is one kernel; `low_latency_split` runs the same kernels in
two halves: `*_send` writes to the peers without waiting for their receive (the combine send
waits for the peers to reach their own send: their weights), `*_recv` waits for the peers' rows
and delivers the outputs, so XLA can schedule other work in between.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_ep import _checks, _ffi, reference as ref
from jax_ep._common import FP8_GROUP, axis_info, first_occurrence, ll_combine_vjp, sanitize
from jax_ep import config, remat, runtime


class LowLatencyHandle(NamedTuple):
    """What `low_latency_combine` needs from its `low_latency_dispatch`. A pytree of arrays:
    fine across jit, scan and remat."""
    recv_src: jax.Array     # [L, R*M] int32: src_rank * M + src_token, -1 past recv_count
    recv_slot: jax.Array    # [L, R*M] int32: first top-k slot of the source token naming the
    #                         row's expert (where combine sends the output back), -1 past count
    recv_count: jax.Array   # [L] int32
    num_invalid: jax.Array  # [] int32
    src_rows: jax.Array     # [R*M, K] int32: for slot k of token t of rank s (row s*M + t), the
    #                         flat row l*R*M + j of recv_x holding it when slot k names local
    #                         expert l, else -1 (the combine pre-reduces with it)
    topk_idx: Any = None    # [T, K] int32: this rank's dispatched expert ids; the combine reads
    #                         the rows they name, and a slot whose topk_idx differs weighs 0


class LowLatencyResult(NamedTuple):
    """What `low_latency_dispatch` (and `low_latency_dispatch_recv`) return: the received rows
    in the expert-major layout and the `handle` for `low_latency_combine`."""
    recv_x: Any             # [L, R*M, H] bf16, or (fp8 [L, R*M, H], scales [L, R*M, H // 128])
    recv_count: jax.Array   # [L] int32
    handle: LowLatencyHandle


# Receive-buffer sizes: defined once, in C++ beside the layouts they measure
# (csrc/kernels/ll_sizes.h), and asked for here.
def _dispatch_buffer_bytes(R, M, K, H, L, use_fp8):
    return runtime.extension().ll_dispatch_buffer_bytes(R, M, K, H, L, bool(use_fp8))


def _combine_buffer_bytes(R, M, K, H):
    return runtime.extension().ll_combine_buffer_bytes(R, M, K, H)


def _ll_attrs(*, num_experts, M, K, H, use_fp8, round_scale, buffer_bytes):
    # prereduce / diag: settings that change the kernels, fixed at lowering (jax_ep/config.py)
    return dict(num_experts=int(num_experts), max_tokens=int(M), num_topk=int(K), hidden=int(H),
                use_fp8=bool(use_fp8), round_scale=bool(round_scale),
                buffer_bytes=int(buffer_bytes), prereduce=config.flag("JAX_EP_LL_PREREDUCE"),
                diag=config.flag("JAX_EP_LL_DIAG"))


def _combine_attrs(num_experts, R, M, K, H):
    return _ll_attrs(num_experts=num_experts, M=M, K=K, H=H, use_fp8=False, round_scale=False,
                     buffer_bytes=_combine_buffer_bytes(R, M, K, H))


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------

class _DispatchConfig(NamedTuple):
    """The static settings of one low-latency dispatch."""
    num_experts: int
    max_tokens: int   # M, max_tokens_per_rank
    use_fp8: bool
    round_scale: bool
    axis_name: str
    backend: str      # "cuda" or "reference"


class _CombineConfig(NamedTuple):
    """The static settings of one low-latency combine."""
    num_experts: int
    max_tokens: int
    axis_name: str
    backend: str


def _dispatch_cuda_args(cfg, K, H):
    num_experts, M, use_fp8, round_scale, axis_name, _ = cfg
    R, _ = axis_info(axis_name)
    L = num_experts // R
    G = H // FP8_GROUP if use_fp8 else 0
    recv_types = [((L, R * M, H), jnp.float8_e4m3fn if use_fp8 else jnp.bfloat16),
                  ((L, R * M, G), jnp.float32), ((L,), jnp.int32), ((L, R * M), jnp.int32),
                  ((L, R * M), jnp.int32), ((R * M, K), jnp.int32)]
    attrs = _ll_attrs(num_experts=num_experts, M=M, K=K, H=H, use_fp8=use_fp8,
                      round_scale=round_scale,
                      buffer_bytes=_dispatch_buffer_bytes(R, M, K, H, L, use_fp8))
    return recv_types, attrs


def _dispatch_result(recv_outs, stats, use_fp8):
    rx, rs, cnt, src, slot, rows = recv_outs
    return ((rx, rs) if use_fp8 else rx), cnt, LowLatencyHandle(src, slot, cnt, stats[0], rows)


def _dispatch_core(x, idx, cfg):
    num_experts, M, use_fp8, round_scale, axis_name, backend = cfg
    if backend == "reference":
        rx, cnt, src, slot, inv, rows = ref.ll_dispatch(
            x, idx, num_experts=num_experts, max_tokens_per_rank=M, use_fp8=use_fp8,
            round_scale=round_scale, axis_name=axis_name)
        return rx, cnt, LowLatencyHandle(src, slot, cnt, inv, rows)
    recv_types, attrs = _dispatch_cuda_args(cfg, idx.shape[1], x.shape[1])
    outs = _ffi.call("jax_ep_ll_dispatch", [x, idx], recv_types + [((2,), jnp.int32)],
                     axis_name=axis_name, **attrs)
    return _dispatch_result(outs[:6], outs[6], use_fp8)


def _matching_weights(w, idx, didx):
    """w where topk_idx names the dispatch's expert (didx), else 0: the rows the combine reads
    are the dispatch's, and a slot the caller changed contributes nothing (docs/API.md)."""
    return jnp.where(idx == didx, w, jnp.zeros_like(w))


def _combine_core(y, idx, w, didx, handle_arrays, cfg):
    num_experts, M, axis_name, backend = cfg
    src, slot, cnt, rows = handle_arrays
    if backend == "reference":
        return ref.ll_combine(y, didx, _matching_weights(w, idx, didx), src,
                              num_experts=num_experts, axis_name=axis_name)
    R, _ = axis_info(axis_name)
    T, K = idx.shape
    H = y.shape[-1]
    attrs = _combine_attrs(num_experts, R, M, K, H)
    (out,) = _ffi.call("jax_ep_ll_combine",
                       [y, src, slot, cnt, rows, idx, w.astype(jnp.float32), didx],
                       [((T, H), jnp.bfloat16)], axis_name=axis_name, **attrs)
    return out


# dispatch (bf16): its transpose is a combine with unit weight on each (token, expert) once.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dispatch_diff(x, idx, cfg):
    return _dispatch_core(x, idx, cfg)


def _dispatch_fwd(x, idx, cfg):
    # Named: under jax.checkpoint(policy=jax_ep.remat_policy) outputs and residuals are saved.
    out = remat.named(_dispatch_diff(x, idx, cfg), remat.DISPATCH)
    h = out[2]
    return out, (idx, (h.recv_src, h.recv_slot, h.recv_count, h.src_rows))


def _dispatch_bwd(cfg, res, g):
    idx, handle_arrays = res
    g_rx = g[0]
    clean, _ = sanitize(idx, cfg.num_experts)
    unit = first_occurrence(clean).astype(jnp.float32)
    # the differentiable combine (not its core): the backward can itself be differentiated
    dx = _combine_diff(g_rx.astype(jnp.bfloat16), unit, idx, idx, *handle_arrays,
                       _CombineConfig(cfg.num_experts, cfg.max_tokens, cfg.axis_name,
                                      cfg.backend))
    return dx, None


_dispatch_diff.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _dispatch_fp8(x, idx, cfg):
    return _dispatch_core(x, idx, cfg)


@_dispatch_fp8.defjvp
def _dispatch_fp8_jvp(cfg, primals, tangents):
    raise TypeError("jax_ep.low_latency_dispatch(use_fp8=True) is forward only (quantisation has "
                    "no useful gradient); use use_fp8=False to differentiate in x")


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _combine_diff(y, w, idx, didx, src, slot, cnt, rows, cfg):
    return _combine_core(y, idx, w, didx, (src, slot, cnt, rows), cfg)


def _combine_fwd(y, w, idx, didx, src, slot, cnt, rows, cfg):
    out = remat.named(_combine_diff(y, w, idx, didx, src, slot, cnt, rows, cfg), remat.COMBINE)
    return out, (y, w, idx, didx, src)


def _combine_bwd(cfg, res, g):
    """Pure-JAX collectives on the handle (both backends): decode rarely needs this path."""
    y, w, idx, didx, recv_src = res
    dy, dw = ll_combine_vjp(y, _matching_weights(w, idx, didx), didx, recv_src, g,
                            num_experts=cfg.num_experts, axis_name=cfg.axis_name)
    return dy, _matching_weights(dw, idx, didx), None, None, None, None, None, None


_combine_diff.defvjp(_combine_fwd, _combine_bwd)


# ----------------------------------------------------------------------------------------------
# argument checks shared by the fused and the split ops
# ----------------------------------------------------------------------------------------------

def _dispatch_cfg(x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8,
                  round_scale, backend):
    _checks.expect_rank("x", x, 2, "[T, H]")
    _checks.expect_dtype("x", x, (jnp.bfloat16,))
    T, H = x.shape
    _checks.hidden("x", H)
    use_fp8 = _checks.flag("use_fp8", use_fp8)
    round_scale = _checks.flag("round_scale", round_scale)
    M = _checks.static_int("max_tokens_per_rank", max_tokens_per_rank, 1)
    if T > M:
        raise ValueError(f"x: T={T} tokens is more than max_tokens_per_rank={M}")
    if use_fp8 and H % FP8_GROUP:
        raise ValueError(f"x: hidden size H={H} must be a multiple of 128 with use_fp8=True")
    _checks.topk("topk_idx", topk_idx, T)
    be = _checks.resolve_backend(backend, empty=T == 0)
    R, _ = axis_info(axis_name)
    _checks.group_size(R, axis_name)
    _checks.experts_per_rank(num_experts, R)
    _checks.low_latency_experts(num_experts, R)
    cfg = _DispatchConfig(int(num_experts), M, bool(use_fp8), bool(round_scale), axis_name, be)
    return cfg, _checks.int32_ids(topk_idx, num_experts)


def _combine_cfg(y, topk_idx, topk_weights, handle, axis_name, backend):
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle: expected the LowLatencyHandle of a low_latency_dispatch, got "
                        f"{type(handle).__name__}")
    _checks.expect_rank("y", y, 3, "[L, R * M, H]")
    _checks.expect_dtype("y", y, (jnp.bfloat16,))
    L, RM = handle.recv_src.shape
    if tuple(y.shape[:2]) != (L, RM):
        raise ValueError(f"y: shape {tuple(y.shape)}, expected ({L}, {RM}, H) like recv_x")
    _checks.topk("topk_idx", topk_idx)
    _checks.weights("topk_weights", topk_weights, topk_idx.shape)
    be = _checks.resolve_backend(backend, empty=topk_idx.shape[0] == 0)
    R, _ = axis_info(axis_name)
    if RM % R:
        raise ValueError(f"handle: made for an EP group whose size divides {RM}, but axis "
                         f"{axis_name!r} has {R} ranks")
    M = RM // R
    K = topk_idx.shape[1]
    if tuple(handle.src_rows.shape) != (RM, K):
        raise ValueError(f"handle: src_rows has shape {tuple(handle.src_rows.shape)}, expected "
                         f"({RM}, {K}) for topk_idx of {K} slots (the dispatch's handle?)")
    if topk_idx.shape[0] > M:
        raise ValueError(f"topk_idx: T={topk_idx.shape[0]} is more than max_tokens_per_rank={M}")
    if handle.topk_idx is None:
        raise TypeError("handle: its topk_idx is None; pass the handle low_latency_dispatch "
                        "returned (the combine reads the rows its topk_idx names)")
    if tuple(handle.topk_idx.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_idx: shape {tuple(topk_idx.shape)}, but the dispatch's was "
                         f"{tuple(handle.topk_idx.shape)} (the handle's topk_idx)")
    cfg = _CombineConfig(L * R, M, axis_name, be)
    return cfg, _checks.int32_ids(topk_idx, L * R)


def _check_same_ids(out, idx, didx, num_experts, axis_name, check, what):
    """out, gated by check=True's host check that topk_idx names the dispatch's experts."""
    if not runtime.check_enabled(check):
        return out

    def valid(v):
        return (v >= 0) & (v < num_experts)

    n = jnp.sum(((idx != didx) & (valid(idx) | valid(didx))).astype(jnp.int32))

    def message(v, t):
        return (f"jax_ep.{what}(check=True): {v[0]} slots of topk_idx on this rank ({t[0]} over "
                "all shards) name another expert than the dispatch did; they contributed nothing")
    return _checks.checked_result(out, what, {"changed_slots": n}, axis_name, message)


def _check_invalid(res, axis_name, check, what):
    """res, gated by check=True's host check of its invalid expert ids."""
    if not runtime.check_enabled(check):
        return res

    def message(v, t):
        return (f"jax_ep.{what}(check=True): {v[0]} expert ids outside [-1, E) on this rank "
                f"({t[0]} over all shards)")
    return _checks.checked_result(res, what, {"num_invalid": res.handle.num_invalid}, axis_name,
                                  message)


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------

def low_latency_dispatch(x: jax.Array, topk_idx: jax.Array, *, num_experts: int,
                         max_tokens_per_rank: int, axis_name: str = "ep", use_fp8: bool = True,
                         round_scale: bool = False, backend: str = "auto",
                         check: bool | None = None) -> LowLatencyResult:
    """Decode dispatch: each token to the ranks of its experts, into the expert-major layout.

    Runs per shard inside `jax.shard_map` over `axis_name` (R ranks, L = num_experts // R local
    experts each).

    Args:
      x: `[T, H]` bfloat16 with T <= max_tokens_per_rank (T = 0 allowed); H a multiple of 128
        with use_fp8.
      topk_idx: `[T, K]` int32 (int64 accepted); -1 marks an unused slot.
      num_experts: E, a multiple of R. max_tokens_per_rank: M, static, the same on every rank.
      axis_name: the EP axis of the enclosing shard_map.
      use_fp8: quantise the rows to FP8 e4m3 on the fly (per 128 columns, amax / 448).
      round_scale: with use_fp8, round each scale up to a power of two.
      backend, check: as for `dispatch`.

    Returns:
      LowLatencyResult: `recv_x` `[L, R * M, H]` bfloat16, or `(x_fp8, scales
      [L, R * M, H // 128])` with use_fp8; rows [0, recv_count[l]) of expert l are valid, in any
      order, the rest unspecified. `recv_count` `[L]` int32. `handle` for
      `low_latency_combine` (recv_src `[L, R * M]`: src_rank * M + src_token, -1 past the count).

    Differentiable in x when use_fp8 is False. The contract in full:
    docs/API.md#low-latency-mode-decode.
    """
    _checks.flag("check", check, allow_none=True)
    cfg, idx = _dispatch_cfg(x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8,
                             round_scale, backend)
    fn = _dispatch_fp8 if use_fp8 else _dispatch_diff
    rx, cnt, handle = fn(x, idx, cfg)
    handle = handle._replace(topk_idx=idx)
    return _check_invalid(LowLatencyResult(rx, cnt, handle), axis_name, check,
                          "low_latency_dispatch")


def low_latency_combine(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                        handle: LowLatencyHandle, *, axis_name: str = "ep",
                        backend: str = "auto", check: bool | None = None) -> jax.Array:
    """Weighted sum of the expert outputs of each token: the decode combine.

    Args:
      y: `[L, R * M, H]` bfloat16, the expert outputs aligned with the dispatch's `recv_x` rows.
      topk_idx, topk_weights: the dispatch's `[T, K]` ids and their weights (float32, bfloat16
        or float16, computed in float32).
      handle: the dispatch's `handle`.
      axis_name, backend: as for `low_latency_dispatch`.
      check: True raises when topk_idx differs from the ids the dispatch sent (default:
        JAX_EP_CHECK).

    Returns:
      `[T, H]` bfloat16: `out[t] = sum_k w[t, k] * y[expert of slot k][row of (t, k)]`,
      accumulated in float32; -1 slots contribute nothing. Differentiable in y and
      topk_weights.

    The contract in full (slots that differ from the dispatch's, the CUDA kernels' 16-bit
    partial sums): docs/API.md#low-latency-mode-decode.
    """
    _checks.flag("check", check, allow_none=True)
    cfg, idx = _combine_cfg(y, topk_idx, topk_weights, handle, axis_name, backend)
    # float32 weights, and y and w varying along the call's axes: a replicated (constant) w
    # then gets its cotangent summed over the shards (see high_throughput.dispatch).
    y, w = _ffi.varying([y, topk_weights.astype(jnp.float32), idx], axis_name)[:2]
    didx = handle.topk_idx
    out = _combine_diff(y, w, idx, didx, handle.recv_src, handle.recv_slot, handle.recv_count,
                        handle.src_rows, cfg)
    return _check_same_ids(out, idx, didx, cfg.num_experts, axis_name, check,
                           "low_latency_combine")
