// The fused gather + grouped GEMM of the high-throughput MoE layer (kernels/fused/gather_gemm.cu,
// docs/kernels.md#fused-gather-gemm): one launch pulls every expert-major row from the rank that
// holds its token and multiplies each expert's rows by that expert's weights, a GEMM tile starting
// as soon as the rows of its row block have arrived. Host declarations only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/fused/sizes.h"
#include "transport/peer.cuh"

namespace jax_ep {
namespace fused {

struct GatherGemmArgs {
  PeerSlots ps;
  int64_t timeout_ns;
  const void* x;             // [T, H] own tokens, published for the peers
  const int32_t* rows_src;   // [C] source of each expert-major row: s * T + t, -1 (zero row) or
                             // -2 (a copy, written by its token's first row: rows_dups)
  const int32_t* rows_dups;  // [C, D] a first row's copies on this rank (-1: none), D <= kMaxDups
  const int32_t* sizes;      // [L] segment lengths, multiples of kBlockM (the last clipped to C)
  const void* w;             // [L, H, N], or [L, N, H] with w_k_major (h = xe @ w[l]^T)
  int T, C, L, D;
  int64_t H, N;
  void* xe;           // [C, H] the expert-major rows (past the last segment: not written)
  void* h;            // [C, N] xe @ w per segment; not written past the last segment. With act: its
                      // columns paired (tiles.cuh, paired_b_layout: per 256 columns, 128 of the
                      // gate projection's, then the same 128 of the up projection's); nullptr
                      // (with act only): not written
  void* act;          // nullptr, or [C, N / 2] silu(gate) * up of h (N a multiple of kBlockN),
                      // computed in the tiles' epilogue; not written past the last segment
  int32_t* counters;  // [counter_words(C)] zeroed before the launch: rows arrived per block, then
                      // the queues (sizes.h)
  bool w_k_major;     // w is [L, N, H] (H contiguous; not with act)
  int copy_blocks;    // blocks that pull rows before they compute tiles
  int gemm_blocks;    // blocks that only compute tiles
};

// Enqueue on `stream` (bfloat16 operands, shapes checked by the handler; CUTLASS builds only); an
// error message, empty on success. In the one-GPU multi-rank mode's dry run it checks the residency
// and launches nothing.
std::string launch(const GatherGemmArgs& a, cudaStream_t stream);

}  // namespace fused
}  // namespace jax_ep
