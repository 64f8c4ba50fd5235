"""Parts of moe_ffn that bench_moe.py (one GPU) and bench_moe_ranks.py (R GPUs) time, each a
per-shard function for the harness's scans."""
from __future__ import annotations

import jax_ep
from jax_ep import fused as _fused, moe as _moe
from jax_ep._common import axis_info


def _rows(x, idx, num_experts, backend, capacity):
    """capacity, or by default the rows of the fused moe_ffn's first pass (its moe_capacity),
    not an expert-major dispatch's worst case: the parts then compute the layer's rows."""
    if capacity is not None:
        return capacity
    return jax_ep.moe_capacity(x.shape[0], num_experts=num_experts, num_topk=idx.shape[1],
                               num_ranks=axis_info("ep")[0], fused=True, backend=backend)


def fused_first_half_only(num_experts, backend, capacity=None):
    """The layer with only its first half fused: the fused dispatch + gate/up GEMM, then the
    unfused down GEMM and combine (the fused GEMM + combine's own effect, by difference)."""
    def layer(x, idx, w, wgu, wd):
        res, h = _fused.dispatch_matmul(x, idx, w, wgu, num_experts=num_experts,
                                        backend=backend,
                                        capacity=_rows(x, idx, num_experts, backend, capacity))
        y = jax_ep.grouped_matmul(_moe.swiglu(h).astype(wd.dtype), wd, res.expert_sizes,
                                  backend=backend)
        return jax_ep.combine(y, res.handle, backend=backend)
    return layer


def first_half(fused, num_experts, backend, capacity=None):
    """Dispatch + gate/up GEMM alone (x, idx, w, wgu): fused, or unfused with the fused path's
    segment alignment (so both compute the same rows). capacity: the expert-major rows (None:
    those of the fused layer's first pass)."""
    if fused:
        def half(x, idx, w, wgu):
            return _fused.dispatch_matmul(
                x, idx, w, wgu, num_experts=num_experts, backend=backend,
                capacity=_rows(x, idx, num_experts, backend, capacity))[1]
        return half
    align = jax_ep.runtime.extension().fused_block_rows if backend == "cuda" else 1

    def half(x, idx, w, wgu):
        res = jax_ep.dispatch(x, idx, w, num_experts=num_experts, layout="expert",
                              expert_alignment=align, backend=backend,
                              capacity=_rows(x, idx, num_experts, backend, capacity))
        return jax_ep.grouped_matmul(res.recv_x, wgu, res.expert_sizes, backend=backend)
    return half
