// Every XLA FFI handler of the extension. Operands, results and attributes of each are
// documented in docs/ffi.md; the Python side that builds the calls is jax_ep/_ffi.py.
#pragma once
#include "xla/ffi/api/ffi.h"

// layout.cc: local layout count (tokens per rank / per expert, token-in-rank mask).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLayout);
// high_throughput.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtCombine);
// low_latency.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineRecv);
// grouped_gemm.cc: grouped GEMMs of the experts (no communication).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpGroupedGemm);
