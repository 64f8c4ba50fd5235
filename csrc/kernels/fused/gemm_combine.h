// The fused grouped GEMM + combine of the high-throughput MoE layer (kernels/fused/gemm_combine.cu,
// docs/kernels.md#fused-gemm-combine): one launch multiplies each expert's rows by that expert's
// weights and sums every token's output rows: on each rank the rows of each received token, as
// soon as their row blocks are computed there, then on the token's own rank the ranks' sums.
// Host declarations only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/fused/sizes.h"
#include "transport/peer.cuh"

namespace jax_ep {
namespace fused {

struct GemmCombineArgs {
  PeerSlots ps;
  int64_t timeout_ns;
  const void* a;             // [C, I] expert-major rows
  const int32_t* sizes;      // [L] segment lengths, multiples of kBlockM (the last clipped to C)
  const void* w;             // [L, I, N], or [L, N, I] with w_k_major (ye = a @ w[l]^T)
  const int32_t* row_of;     // [Cr, K] the expert-major row of each received slot, or -1
  const float* weights;      // [Cr, K] the slot's routing weight
  const int32_t* send_rows;  // [T, R] the received row of each own token on each rank, or -1
  int T, C, Cr, K, L;
  int64_t I, N;
  void* ye;               // [C, N] published: a @ w per segment, rows past the last segment
                          // unwritten; over several ranks the row of each received row's first
                          // slot here then holds that received row's weighted sum of its slots'
                          // rows, rounded to bfloat16 (with one rank the sums go straight into
                          // out and ye keeps every product)
  void* out;              // [T, N] per token: the sum over ranks of the rank's weighted sum of rows
                          // (with the addend: that sum rounded to bfloat16, plus the token's
                          // addend row, in float32, rounded again)
  const void* addend;     // [T, N] bfloat16 added to out when *addend_on, or null (none); may
                          // be out itself (each element is read before it is written)
  const bool* addend_on;  // [] whether the addend is read (else it may hold anything); or null
  int32_t* counters;      // [combine_counter_words(C, Cr, N)] zeroed before the launch (published)
  bool w_k_major;         // w is [L, N, I] (I contiguous)
  int combine_blocks;     // blocks that only combine; the others compute tiles, then combine too
  int gemm_blocks;
};

// Enqueue on `stream` (bfloat16 operands, shapes checked by the handler; CUTLASS builds only); an
// error message, empty on success. In the one-GPU multi-rank mode's dry run it checks the residency
// and launches nothing.
std::string launch(const GemmCombineArgs& a, cudaStream_t stream);

}  // namespace fused
}  // namespace jax_ep
