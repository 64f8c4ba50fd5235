// jax_ep_expert_positions: the expert-major rows of a rank's (row, local expert) pairs, a stable
// counting sort by expert in two kernels over many blocks (no communication). See docs/ffi.md.
#include <cuda_runtime.h>

#include <string>

#include "ffi/common.h"
#include "kernels/expert_positions.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr const char* kOp = "jax_ep_expert_positions";

ffi::Error ExpertPositionsImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> key,
                               ffi::Result<ffi::Buffer<ffi::S32>> pos,
                               ffi::Result<ffi::Buffer<ffi::S32>> src,
                               ffi::Result<ffi::Buffer<ffi::S32>> counts,
                               ffi::Result<ffi::Buffer<ffi::S32>> offsets,
                               ffi::Result<ffi::Buffer<ffi::S32>> block_counts, int64_t num_experts,
                               int64_t capacity, int64_t alignment) {
  using jax_ep::op_error;
  if (num_experts < 1 || num_experts > jax_ep::kMaxPositionExperts)
    return op_error(kOp, "num_experts must be in [1, " +
                             std::to_string(jax_ep::kMaxPositionExperts) + "], got " +
                             std::to_string(num_experts));
  if (capacity < 1 || capacity > jax_ep::kInt32Max)
    return op_error(kOp, "capacity must be in [1, 2^31), got " + std::to_string(capacity));
  if (alignment < 1 || alignment > jax_ep::kInt32Max)
    return op_error(kOp, "alignment must be in [1, 2^31), got " + std::to_string(alignment));
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_rank(kOp, "key", key.dimensions(), 1, "[P]"));
  const int64_t P = key.dimensions()[0];
  if (P < 1 || P > jax_ep::kInt32Max)  // (with no pair the results would stay unwritten)
    return op_error(kOp, "key has " + std::to_string(P) + " pairs; expected 1 to 2^31 - 1");
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_dims(kOp, "pos", pos->dimensions(), {P}));
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_dims(kOp, "src", src->dimensions(), {capacity}));
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_dims(kOp, "counts", counts->dimensions(), {num_experts}));
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_dims(kOp, "offsets", offsets->dimensions(), {num_experts}));
  // one block per slice of the pairs (jax_ep._C.position_slice_pairs)
  const int64_t blocks = (P + jax_ep::kPositionSlicePairs - 1) / jax_ep::kPositionSlicePairs;
  JAX_EP_RETURN_IF_ERROR(
      jax_ep::expect_dims(kOp, "block_counts", block_counts->dimensions(), {blocks, num_experts}));
  namespace pk = jax_ep::positions;
  const int L = static_cast<int>(num_experts);
  pk::count_kernel<<<static_cast<unsigned int>(blocks), pk::kThreads, 0, stream>>>(
      key.typed_data(), P, L, capacity, src->typed_data(), block_counts->typed_data());
  pk::place_kernel<<<static_cast<unsigned int>(blocks), pk::kThreads, 0, stream>>>(
      key.typed_data(), P, L, capacity, static_cast<int>(alignment), block_counts->typed_data(),
      pos->typed_data(), src->typed_data(), counts->typed_data(), offsets->typed_data());
  return jax_ep::cuda_error("jax_ep_expert_positions launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpExpertPositions, ExpertPositionsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // key [P]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // pos [P]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // src [capacity]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // counts [L]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // offsets [L]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // block_counts [B, L]
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("alignment"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
