// Low-latency (decode) dispatch / combine over peer memory: one kernel per op, pull design.
// Kernels in low_latency.cu; handlers in ffi/low_latency.cc; contract in docs/ffi.md; how they
// work in docs/kernels.md ("Low-latency kernels").
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "transport/peer.cuh"

namespace jax_ep {
namespace ll {

constexpr int kDispatchThreads = 256;      // generic dispatch kernel (K > 32): 8 warps
constexpr int kFastDispatchThreads = 512;  // fast dispatch kernel (K <= 32): 16 warps
constexpr int kFastMaxK = 32;              // the fast kernel keeps one top-k slot per lane
constexpr int kCombineThreads = 256;  // combine: 2 x 16-byte columns per thread, 512 per block
constexpr int kPushBlocks = 4;  // blocks that push this rank's addresses to the peers

struct DispatchParams {
  PeerSlots ps;
  const void* x;          // [T, H] bf16
  const int32_t* topk_idx;  // [T, K]
  void* recv_x;           // [L, R*M, H] bf16, or e4m3 with use_fp8
  float* recv_scales;     // [L, R*M, G]
  int32_t* recv_count;    // [L]
  int32_t* recv_src;      // [L, R*M]
  int32_t* src_to_row;    // [R, M, L]
  int32_t* stats;         // [2]
  uint8_t* staging;       // [M, S] bytes; under use_fp8 laid out as [M*H e4m3 | M*G f32]
  int T, H, K, E, L, M, G;
  int use_fp8, round_scale;
  int64_t timeout_ns;
};

struct CombineParams {
  PeerSlots ps;
  const void* y;            // [L, R*M, H] bf16
  const int32_t* topk_idx;  // [T, K]
  const float* topk_weights;  // [T, K]
  const int32_t* src_to_row;  // [R, M, L]
  void* out;                // [T, H] bf16
  int T, H, K, E, L, M;
  int64_t timeout_ns;
};

// Grid of the dispatch kernel: one CTA per SM, every SM (LL is latency-bound; the grid stays
// co-resident, which the kernels' in-grid waits need). `num_blocks` is not used. 0 on a CUDA error.
int dispatch_grid(int device, int K);
cudaError_t launch_dispatch(const DispatchParams& p, int grid, cudaStream_t stream);
cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream);

}  // namespace ll
}  // namespace jax_ep
