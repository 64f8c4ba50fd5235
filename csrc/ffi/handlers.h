// Every XLA FFI handler of the extension. Operands, results and attributes of each are
// documented in docs/ffi.md; the Python side that builds the calls is jax_ep/_ffi.py. Each
// communication handler X has a twin XVr (target name + "_vr"): the same body over R virtual
// ranks on one device, every operand and result stacked along a leading axis of R
// (ffi/virtual_ranks.h).
#pragma once
#include "xla/ffi/api/ffi.h"

// layout.cc: local layout count (tokens per rank / per expert, token-in-rank mask).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLayout);
// expert_positions.cc: the expert-major rows of a rank's (row, local expert) pairs.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpExpertPositions);
// high_throughput.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtDispatchVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtGatherVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtGatherGemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtGatherGemmVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtGemmCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtGemmCombineVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpHtCombineVr);
// low_latency.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchSendVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchRecvVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineSendVr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineRecvVr);
// unwritten.cc: a result nothing writes (a loop carry's first value).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpUnwritten);
// grouped_gemm.cc: grouped GEMMs of the experts (no communication).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpGroupedGemm);
