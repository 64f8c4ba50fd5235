// jax_ep_expert_positions: the expert-major rows of a rank's (row, local expert) pairs, a stable
// counting sort by expert (no communication). See docs/ffi.md.
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
                               ffi::Result<ffi::Buffer<ffi::S32>> offsets, int64_t num_experts,
                               int64_t capacity, int64_t alignment) {
  using jax_ep::op_error;
  if (num_experts < 1 || num_experts > jax_ep::kMaxPositionExperts)
    return op_error(kOp, "num_experts must be in [1, " +
                             std::to_string(jax_ep::kMaxPositionExperts) + "], got " +
                             std::to_string(num_experts));
  if (capacity < 1 || capacity > jax_ep::kMaxPositionRows)
    return op_error(kOp, "capacity must be in [1, " + std::to_string(jax_ep::kMaxPositionRows) +
                             "], got " + std::to_string(capacity));
  if (alignment < 1 || alignment > jax_ep::kInt32Max)
    return op_error(kOp, "alignment must be in [1, 2^31), got " + std::to_string(alignment));
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_rank(kOp, "key", key.dimensions(), 1, "[P]"));
  const int64_t P = key.dimensions()[0];
  if (P > jax_ep::kInt32Max)
    return op_error(kOp, "key has " + std::to_string(P) + " pairs; at most 2^31 - 1");
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_dims(kOp, "pos", pos->dimensions(), {P}));
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_dims(kOp, "src", src->dimensions(), {capacity}));
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_dims(kOp, "counts", counts->dimensions(), {num_experts}));
  JAX_EP_RETURN_IF_ERROR(
      jax_ep::expect_dims(kOp, "offsets", offsets->dimensions(), {num_experts}));
  const size_t smem = jax_ep::positions::smem_bytes(capacity);
  if (cudaFuncSetAttribute(jax_ep::positions::positions_kernel,
                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)) != cudaSuccess)
    return jax_ep::cuda_error("jax_ep_expert_positions shared memory attribute");
  jax_ep::positions::positions_kernel<<<1, jax_ep::positions::kThreads, smem, stream>>>(
      key.typed_data(), P, static_cast<int>(num_experts), capacity, static_cast<int>(alignment),
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
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("alignment"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
