"""DeepGEMM (deepseek-ai/DeepGEMM, a PyTorch library) as a same-run FP8 baseline of bench_gemm.py.

Optional: needs torch and a DeepGEMM checkout, prepared by benchmarks/deepgemm.sh (which pins the
commit, a version whose kernels compile with the CUDA toolkit at run time). DeepGEMM multiplies
the very operands jax_ep quantised: the FP8 values and scales go over DLPack, and only their
layout changes (DeepGEMM reads the activation scales M-major). Its contiguous layout needs every
group's rows to be a multiple of 128, and its masked layout leaves rows past the counts as they
were (jax_ep's `zero_padding=False`).

DeepGEMM is timed the way harness.time_slope times jax_ep: the slope between n_short and n_long
calls (here back-to-back launches on torch's stream), over interleaved pairs of runs.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp


def load(path):
    """(torch, deep_gemm) from a checkout at path, or None after saying why."""
    if not path:
        return None
    if not os.path.isdir(os.path.join(path, "deep_gemm", "include", "cute")):
        print(f"  DeepGEMM: {path}/deep_gemm/include/cute missing (benchmarks/deepgemm.sh links "
              "CUTLASS's headers there)")
        return None
    try:
        # DeepGEMM's tests import NVRTC before torch (torch ships an older one)
        import cuda.bindings.nvrtc  # noqa: F401
        import torch
        sys.path.insert(0, path)
        import deep_gemm
    except Exception as e:  # noqa: BLE001
        print(f"  DeepGEMM not available: {type(e).__name__}: {e}")
        return None
    return torch, deep_gemm


def to_torch(torch, x):
    """A JAX array as a torch tensor on the same device (FP8 through a uint8 view)."""
    if x.dtype == jnp.float8_e4m3fn:
        u = jax.lax.bitcast_convert_type(x, jnp.uint8)
        return torch.from_dlpack(u).view(torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def _rhs(torch, dg, wq):
    """Fp8Weights (data [G, N, K], scales [G, K/128, N/128]) in DeepGEMM's rhs layout."""
    data, scales = wq
    return (to_torch(torch, data).contiguous(),
            to_torch(torch, jnp.swapaxes(scales, 1, 2)).contiguous())


def contiguous(mods, aq, wq, group_sizes):
    """A no-argument function running DeepGEMM's contiguous grouped GEMM on (aq, wq), and its
    output tensor; None when a group's size is not a multiple of 128."""
    torch, dg = mods
    sizes = np.array(group_sizes)  # a writable copy (torch.as_tensor warns on a read-only one)
    if np.any(sizes % dg.get_m_alignment_for_contiguous_layout()):
        return None
    q, s = aq
    lhs = (to_torch(torch, q), dg.get_col_major_tma_aligned_tensor(to_torch(torch, s)))
    rhs = _rhs(torch, dg, wq)
    m_indices = torch.repeat_interleave(
        torch.arange(len(sizes), device="cuda", dtype=torch.int32),
        torch.as_tensor(sizes, device="cuda", dtype=torch.int64)).to(torch.int32)
    out = torch.empty((q.shape[0], rhs[0].shape[1]), device="cuda", dtype=torch.bfloat16)

    def run():
        dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs, rhs, out, m_indices)
    run()
    torch.cuda.synchronize()
    return run, out


def masked(mods, xq, wq, counts):
    """DeepGEMM's masked grouped GEMM on (xq [G, C, K] FP8 tuple, wq, counts): (run, out)."""
    torch, dg = mods
    q, s = xq
    lhs = (to_torch(torch, q), dg.get_col_major_tma_aligned_tensor(to_torch(torch, s)))
    rhs = _rhs(torch, dg, wq)
    c = np.array(counts)
    masked_m = torch.as_tensor(c, device="cuda", dtype=torch.int32)
    expected_m = max(1, int(np.ceil(c.mean())))
    out = torch.zeros((q.shape[0], q.shape[1], rhs[0].shape[1]), device="cuda",
                      dtype=torch.bfloat16)

    def run():
        dg.m_grouped_gemm_fp8_fp8_bf16_nt_masked(lhs, rhs, out, masked_m, expected_m)
    run()
    torch.cuda.synchronize()
    return run, out


def time_slope(mods, run, n_short=2, n_long=8, reps=5):
    """(median, min, max) seconds per call: the slope between n_short and n_long back-to-back
    calls, over `reps` interleaved pairs, after two warm-ups of each."""
    torch = mods[0]

    def calls(n):
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    for _ in range(2):
        calls(n_short)
        calls(n_long)
    slopes = []
    for _ in range(reps):
        a = calls(n_short)
        b = calls(n_long)
        slopes.append((b - a) / (n_long - n_short))
    return float(np.median(slopes)), float(np.min(slopes)), float(np.max(slopes))
