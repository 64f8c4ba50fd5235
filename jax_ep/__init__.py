"""jax_ep: expert-parallel (MoE) dispatch and combine for JAX, and the experts' grouped GEMMs,
as XLA FFI custom calls.

The communication ops run per shard inside `jax.shard_map` over the EP axis; the grouped GEMMs
run anywhere. Every public function's docstring gives its arguments and results; the full
contract is the project's docs/API.md.
"""
from jax_ep.high_throughput import (DispatchHandle, DispatchResult, combine, dispatch,
                                    recommended_capacity)
from jax_ep.expert_layout import ExpertDispatchHandle, ExpertDispatchResult
from jax_ep.low_latency import (LowLatencyHandle, LowLatencyResult, low_latency_combine,
                                low_latency_dispatch)
from jax_ep.low_latency_split import (LowLatencyPending, low_latency_combine_recv,
                                      low_latency_combine_send, low_latency_dispatch_recv,
                                      low_latency_dispatch_send)
from jax_ep._common import dequantize_fp8, quantize_fp8
from jax_ep._checks import CheckError, checked
from jax_ep._faults import PeerTimeoutError, raise_if_timed_out
from jax_ep.runtime import initialize, runtime_info, set_num_blocks
from jax_ep.layout import get_dispatch_layout
from jax_ep import routing, testing
from jax_ep.remat import remat_policy
from jax_ep.moe import moe_capacity, moe_ffn
from jax_ep.grouped_gemm import (Fp8Weights, dequantize_fp8_weights, grouped_matmul,
                                 quantize_fp8_weights)
from jax_ep.grouped_gemm_masked import grouped_matmul_masked

__all__ = [
    "dispatch", "combine", "DispatchResult", "DispatchHandle", "ExpertDispatchResult",
    "ExpertDispatchHandle", "recommended_capacity", "CheckError", "checked",
    "PeerTimeoutError", "raise_if_timed_out",
    "low_latency_dispatch", "low_latency_combine", "LowLatencyResult", "LowLatencyHandle",
    "low_latency_dispatch_send", "low_latency_dispatch_recv", "low_latency_combine_send",
    "low_latency_combine_recv", "LowLatencyPending",
    "quantize_fp8", "dequantize_fp8", "get_dispatch_layout",
    "initialize", "runtime_info", "set_num_blocks",
    "grouped_matmul", "grouped_matmul_masked", "Fp8Weights", "quantize_fp8_weights",
    "dequantize_fp8_weights", "routing", "testing", "remat_policy", "moe_ffn",
    "moe_capacity",
]
__version__ = "0.1.0"
