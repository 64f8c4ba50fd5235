// High-throughput (training / prefill) dispatch, gather and combine over peer memory (pull
// design, one process). Launchers called by csrc/ffi/high_throughput.cc; see docs/kernels.md.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ht_sizes.h"
#include "transport/pull.cuh"

namespace jax_ep {
namespace ht {

// Indices of the addresses the dispatch publishes in its slot (gather / combine publish one
// address at index 0).
enum : int {
  kPtrX = 0,
  kPtrScales = 1,
  kPtrTopkIdx = 2,
  kPtrTopkWeights = 3,
  kNumDispatchPtrs = 4
};

// Dispatch layout kernel: grid = R x nch blocks (block (s, c): tokens [c*chunk, (c+1)*chunk)
// of source s), at most one block per SM (co-resident: it has one grid barrier).
constexpr int kLayoutThreads = 256;  // tokens per sub-chunk (one thread per token)
constexpr int kLayoutMinChunk = 32;  // tokens; chunks are multiples of 32
// topk_idx / topk_weights of a sub-chunk are staged in shared memory when they fit this
// (K <= 16; larger K reads them from the peer directly). Static + dynamic stay under 48 KiB.
constexpr int kLayoutSmemBytes = 32 * 1024;
constexpr int kCopyThreads = 512;  // row copy (dispatch / gather) and combine: grid = num_blocks

// Chunking of the layout kernel for R ranks, T tokens, at most max_blocks blocks (the SM count).
struct LayoutPlan {
  int chunk;              // tokens per block (multiple of kLayoutMinChunk)
  int nch;                // chunks per source rank; grid = R * nch
  int64_t scratch_words;  // int32 words of scratch the kernel uses (<= ht_scratch_words)
};
LayoutPlan plan_layout(int R, int T, int max_blocks);

struct DispatchArgs {
  PeerSlots ps;
  int64_t timeout_ns;
  int num_blocks;
  // own operands (published for the peers)
  const uint8_t* x;           // [T, Hb]
  const float* x_scales;      // [T, G] (may be null when G == 0)
  const int32_t* topk_idx;    // [T, K]
  const float* topk_weights;  // [T, K]
  int T, K, E, L, C, G;
  int64_t Hb;
  // results
  uint8_t* recv_x;                  // [C, Hb]
  float* recv_scales;               // [C, G]
  int32_t* recv_topk_idx;           // [C, K]
  float* recv_topk_weights;         // [C, K]
  int32_t* recv_src;                // [C]
  int32_t* send_rows;               // [T, R]
  int32_t* recv_tokens_per_expert;  // [L]
  int32_t* stats;                   // [4]
  int32_t* scratch;                 // [ht_scratch_words(R, T)]
  LayoutPlan plan;                  // plan_layout(R, T, #SMs), set by the handler
};

struct GatherArgs {
  PeerSlots ps;
  int64_t timeout_ns;
  int num_blocks;
  const uint8_t* x;         // [T, Hb] own, published
  const int32_t* recv_src;  // [C]
  const int32_t* stats;     // [4]
  int T, C;
  int64_t Hb;
  uint8_t* recv_x;  // [C, Hb]
};

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct CombineArgs {
  PeerSlots ps;
  int64_t timeout_ns;
  int num_blocks;
  DType dtype;
  const void* y;             // [C, H] own, published
  const int32_t* send_rows;  // [T, R]
  int T, C;
  int64_t H;
  void* out;  // [T, H]
};

// Enqueue on `stream`; launch errors are left for cudaGetLastError().
void launch_dispatch(const DispatchArgs& a, cudaStream_t stream);
void launch_gather(const GatherArgs& a, cudaStream_t stream);
void launch_combine(const CombineArgs& a, cudaStream_t stream);

}  // namespace ht
}  // namespace jax_ep
