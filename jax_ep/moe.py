"""`moe_ffn`: a whole expert-parallel MoE feed-forward layer, per shard inside `shard_map`.

dispatch -> expert-major rows -> grouped GEMM (gate and up) -> silu(gate) * up -> grouped GEMM
(down) -> weighted sum per token -> combine. Each token crosses the links once per destination
rank; each (token, local expert) pair is computed once (no expert evaluates rows that are not
routed to it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import _checks, grouped_gemm
from jax_ep._common import axis_info, quantize_fp8
from jax_ep.fused import dispatch_matmul, matmul_combine
from jax_ep.high_throughput import combine, dispatch
from jax_ep.low_latency import low_latency_combine, low_latency_dispatch

MODES = ("high_throughput", "low_latency")


def _weights(name, w, L, shape_tail, fp8_ok):
    if isinstance(w, grouped_gemm.Fp8Weights):
        if not fp8_ok:
            raise TypeError(f"{name}: FP8 weights need use_fp8=True")
        return w
    _checks.expect_rank(name, w, 3, f"[L, {shape_tail}]")
    _checks.expect_dtype(name, w, _checks.FLOAT_DTYPES)
    if w.shape[0] != L:
        raise ValueError(f"{name}: has {w.shape[0]} experts, expected L = num_experts // R = {L}")
    return w


def swiglu(h):
    """silu(gate) * up of h = [gate | up] along the last axis, in float32."""
    I = h.shape[-1] // 2
    h = h.astype(jnp.float32)
    return jax.nn.silu(h[..., :I]) * h[..., I:]


def moe_ffn(x, topk_idx, topk_weights, w_gate_up, w_down, *, num_experts, axis_name="ep",
            mode="high_throughput", capacity=None, use_fp8=False, max_tokens_per_rank=None,
            fused=False, fused_copy_blocks=0, fused_combine_blocks=0, backend="auto"):
    """One MoE feed-forward layer, per shard inside `jax.shard_map` over `axis_name`.

    `out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`, e the
    expert of slot k (slots of -1 contribute nothing), with this rank's experts applied here
    and the others on their ranks.

    Args:
      x: `[T, H]` float32 / bfloat16 / float16 (bfloat16 in low-latency mode).
      topk_idx: `[T, K]` int32 expert ids (-1: unused slot), e.g. from `jax_ep.routing`.
      topk_weights: `[T, K]` float32 / bfloat16 / float16 router weights.
      w_gate_up: `[L, H, 2I]` this rank's experts' gate (first I columns) and up projections,
        L = num_experts // R; `Fp8Weights` of it with use_fp8.
      w_down: `[L, I, H]` the down projections (bfloat16 in FP8 mode).
      num_experts: E, a multiple of R.
      mode: "high_throughput" (training, prefill: `dispatch` / `combine`, `grouped_matmul`) or
        "low_latency" (decoding: `low_latency_dispatch` / `low_latency_combine`,
        `grouped_matmul_masked`; needs max_tokens_per_rank).
      capacity: high-throughput (token, expert) rows of the expert-major dispatch (default
        R * T * min(K, L), nothing dropped); rows past it are dropped.
      use_fp8: dispatch FP8 activations into the FP8 GEMM of w_gate_up (an `Fp8Weights`);
        forward only.
      max_tokens_per_rank: low-latency mode, M of `low_latency_dispatch` (static, the same on
        every rank); default T, this shard's tokens (at least 1).
      fused: high-throughput mode, bfloat16: the dispatch and the first grouped GEMM in one
        launch, each expert tile starting as soon as its rows have arrived
        (docs/kernels.md#fused-gather-gemm), and the second grouped GEMM and the combine in
        another, each token summed as soon as its rows are computed
        (docs/kernels.md#fused-gemm-combine; per-process groups run this half unfused). Same
        results as fused=False up to float32 accumulation order; the backward runs the
        unfused ops. Expert segments start at multiples of 128 rows (the default capacity
        adds L * 127 rows for it).
      fused_copy_blocks: with fused=True, how many of the first launch's blocks (one per SM)
        pull rows before they join the others on the tiles; 0: automatic (an eighth of the
        SMs).
      fused_combine_blocks: with fused=True, how many of the second launch's blocks only
        combine (the others compute tiles, then combine); 0: automatic (one).
      backend: "auto", "reference" or "cuda" for every op of the layer.

    Returns:
      `[T, H]` in x's dtype. Differentiable in x, topk_weights, w_gate_up and w_down (not with
      use_fp8).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {MODES}")
    use_fp8 = _checks.flag("use_fp8", use_fp8)
    fused = _checks.flag("fused", fused)
    fused_copy_blocks = _checks.static_int("fused_copy_blocks", fused_copy_blocks, 0)
    fused_combine_blocks = _checks.static_int("fused_combine_blocks", fused_combine_blocks, 0)
    if fused and (mode != "high_throughput" or use_fp8):
        raise ValueError("fused=True: the fused dispatch + grouped GEMM is high-throughput mode "
                         "in bfloat16 (use_fp8=False)")
    _checks.expect_rank("x", x, 2, "[T, H]")
    _checks.expect_dtype("x", x, _checks.FLOAT_DTYPES)
    if mode == "low_latency" and jnp.dtype(x.dtype) != jnp.bfloat16:
        raise TypeError(f"x: dtype {jnp.dtype(x.dtype).name}; mode='low_latency' takes bfloat16 "
                        "(x, w_gate_up and w_down)")
    T, H = x.shape
    R, _ = axis_info(axis_name)
    L = _checks.experts_per_rank(num_experts, R)
    w_gate_up = _weights("w_gate_up", w_gate_up, L, "H, 2I", use_fp8)
    _weights("w_down", w_down, L, "I, H", False)
    if isinstance(w_gate_up, grouped_gemm.Fp8Weights):
        gu_shape = (L, w_gate_up.data.shape[2], w_gate_up.data.shape[1])
    else:
        gu_shape = tuple(w_gate_up.shape)
    if use_fp8 and not isinstance(w_gate_up, grouped_gemm.Fp8Weights):
        raise TypeError("w_gate_up: use_fp8=True takes FP8 weights "
                        "(jax_ep.quantize_fp8_weights(w_gate_up))")
    if gu_shape[1] != H or gu_shape[2] % 2:
        raise ValueError(f"w_gate_up: shape {gu_shape}, expected [L, H={H}, 2I]")
    I = gu_shape[2] // 2
    if fused and I == 0:
        raise ValueError(f"w_gate_up: shape {gu_shape}; fused=True needs 2I > 0")
    if tuple(w_down.shape[1:]) != (I, H):
        raise ValueError(f"w_down: shape {tuple(w_down.shape)}, expected [L, I={I}, H={H}]")
    want = jnp.dtype(jnp.bfloat16) if use_fp8 or mode == "low_latency" else jnp.dtype(x.dtype)
    for name, w in (("w_gate_up", None if use_fp8 else w_gate_up), ("w_down", w_down)):
        if w is not None and jnp.dtype(w.dtype) != want:
            raise TypeError(f"{name}: dtype {jnp.dtype(w.dtype).name}, expected {want.name} "
                            "(x's dtype; bfloat16 in low-latency and FP8 modes)")
    if mode == "low_latency":
        M = max(T, 1) if max_tokens_per_rank is None else max_tokens_per_rank
        return _moe_low_latency(x, topk_idx, topk_weights, w_gate_up, w_down, num_experts,
                                axis_name, use_fp8, M, backend)
    if max_tokens_per_rank is not None:
        raise ValueError("max_tokens_per_rank is a low-latency setting (mode='low_latency')")
    if fused:
        res, h = dispatch_matmul(x, topk_idx, topk_weights, w_gate_up, num_experts=num_experts,
                                 axis_name=axis_name, capacity=capacity, backend=backend,
                                 copy_blocks=fused_copy_blocks)
        a = swiglu(h).astype(w_down.dtype)
        return matmul_combine(a, w_down, res, axis_name=axis_name, backend=backend,
                              combine_blocks=fused_combine_blocks)
    else:
        xin = quantize_fp8(x) if use_fp8 else x
        res = dispatch(xin, topk_idx, topk_weights, num_experts=num_experts,
                       axis_name=axis_name, capacity=capacity, layout="expert", backend=backend)
        h = grouped_gemm.grouped_matmul(res.recv_x, w_gate_up, res.expert_sizes,
                                        backend=backend)
    a = swiglu(h).astype(w_down.dtype)
    y = grouped_gemm.grouped_matmul(a, w_down, res.expert_sizes, backend=backend)
    # combine weights each (token, expert) row and sums per token
    return combine(y.astype(x.dtype), res.handle, axis_name=axis_name, backend=backend)


def _moe_low_latency(x, topk_idx, topk_weights, w_gate_up, w_down, num_experts, axis_name,
                     use_fp8, max_tokens_per_rank, backend):
    res = low_latency_dispatch(x, topk_idx, num_experts=num_experts,
                               max_tokens_per_rank=max_tokens_per_rank, axis_name=axis_name,
                               use_fp8=use_fp8, backend=backend)
    h = grouped_gemm.grouped_matmul_masked(res.recv_x, w_gate_up, res.recv_count,
                                           zero_padding=False, backend=backend)
    a = swiglu(h).astype(w_down.dtype)
    # rows past the counts are never read by the combine: neither GEMM writes zeros there
    y = grouped_gemm.grouped_matmul_masked(a, w_down, res.recv_count, zero_padding=False,
                                           backend=backend)
    return low_latency_combine(y.astype(jnp.bfloat16), topk_idx, topk_weights, res.handle,
                               axis_name=axis_name, backend=backend)
