// jax_ep_layout: local layout count of this rank's topk_idx (no communication). See docs/ffi.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "ffi/group.h"
#include "ffi/handlers.h"
#include "kernels/layout.cuh"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jax_ep::dims_str;

namespace {

ffi::Error LayoutImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                      ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_rank,
                      ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                      ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_invalid, int64_t num_experts,
                      int64_t num_ranks) {
  auto bad = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_ep_layout: " + m);
  };
  if (num_ranks < 1 || num_ranks > jax_ep::kMaxLayoutRanks)
    return bad("num_ranks must be in [1, " + std::to_string(jax_ep::kMaxLayoutRanks) + "]");
  if (num_experts < num_ranks || num_experts % num_ranks != 0)
    return bad("num_experts (" + std::to_string(num_experts) +
               ") must be a positive multiple of num_ranks (" + std::to_string(num_ranks) + ")");
  if (num_experts > (1 << 30)) return bad("num_experts too large");
  const auto di = topk_idx.dimensions();
  if (di.size() != 2) return bad("topk_idx must be [T, K], got " + dims_str(di));
  const int64_t T = di[0], K = di[1];
  if (T > (1 << 30) || K > (1 << 20) || T * num_ranks > (int64_t{1} << 31) - 1)
    return bad("topk_idx too large");
  const auto dr = tokens_per_rank->dimensions();
  if (dr.size() != 1 || dr[0] != num_ranks)
    return bad("tokens_per_rank must be [R=" + std::to_string(num_ranks) + "], got " +
               dims_str(dr));
  const auto de = tokens_per_expert->dimensions();
  if (de.size() != 1 || de[0] != num_experts)
    return bad("tokens_per_expert must be [E=" + std::to_string(num_experts) + "], got " +
               dims_str(de));
  const auto dm = is_token_in_rank->dimensions();
  if (dm.size() != 2 || dm[0] != T || dm[1] != num_ranks)
    return bad("is_token_in_rank must be [T, R], got " + dims_str(dm));
  if (num_invalid->element_count() != 1) return bad("num_invalid must be a scalar");

  const int E = static_cast<int>(num_experts), R = static_cast<int>(num_ranks);
  const int nz = E + R + 1;
  jax_ep::layout::zero_kernel<<<std::min((nz + 255) / 256, 1024), 256, 0, stream>>>(
      tokens_per_rank->typed_data(), R, tokens_per_expert->typed_data(), E,
      num_invalid->typed_data());
  if (T > 0) {
    const bool use_smem = nz <= jax_ep::layout::kMaxSmemCounters;
    const size_t smem = use_smem ? sizeof(int) * nz : 0;
    const int threads = jax_ep::layout::kThreads;
    const int blocks = static_cast<int>(std::min<int64_t>((T + threads - 1) / threads, 1024));
    jax_ep::layout::count_kernel<<<blocks, threads, smem, stream>>>(
        topk_idx.typed_data(), static_cast<int>(T), static_cast<int>(K), E, R, use_smem,
        tokens_per_rank->typed_data(), tokens_per_expert->typed_data(),
        is_token_in_rank->typed_data(), num_invalid->typed_data());
  }
  return jax_ep::cuda_error("jax_ep_layout launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLayout, LayoutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_idx [T, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens_per_rank [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens_per_expert [E]
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // is_token_in_rank [T, R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // num_invalid []
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
