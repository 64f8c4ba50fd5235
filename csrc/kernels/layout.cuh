// Local layout count (jax_ep_layout): per-rank / per-expert token counts and the token-in-rank
// mask of this rank's own topk_idx. No communication. Defines __global__ kernels: include it
// from csrc/ffi/layout.cc only (one translation unit).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/warp.h"
#include "kernels/expert_ids.cuh"

namespace jax_ep {

namespace layout {

constexpr int kThreads = 256;
// Experts + ranks + 1 counters fit shared memory up to this many ints; beyond, global atomics.
constexpr int kMaxSmemCounters = 12 * 1024;

__global__ void zero_kernel(int32_t* tokens_per_rank, int num_ranks, int32_t* tokens_per_expert,
                            int num_experts, int32_t* num_invalid) {
  const int n = num_experts + num_ranks + 1;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    if (i < num_experts)
      tokens_per_expert[i] = 0;
    else if (i < num_experts + num_ranks)
      tokens_per_rank[i - num_experts] = 0;
    else
      *num_invalid = 0;
  }
}

// One thread per token (grid-stride). Counters are aggregated in shared memory, then added to
// the (zeroed) global results with one atomic per non-zero counter per block.
__global__ void __launch_bounds__(kThreads)
    count_kernel(const int32_t* __restrict__ topk_idx, int num_tokens, int top_k, int num_experts,
                 int num_ranks, bool use_smem, int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                 bool* is_token_in_rank, int32_t* num_invalid) {
  extern __shared__ int s_counters[];  // [num_experts] experts, [num_ranks] ranks, [1] invalid
  const int local_experts = num_experts / num_ranks;
  int* s_expert = s_counters;
  int* s_rank = s_counters + num_experts;
  int* s_invalid = s_counters + num_experts + num_ranks;
  if (use_smem) {
    for (int i = threadIdx.x; i < num_experts + num_ranks + 1; i += blockDim.x) s_counters[i] = 0;
    __syncthreads();
  }
  int32_t* c_expert = use_smem ? s_expert : tokens_per_expert;
  int32_t* c_rank = use_smem ? s_rank : tokens_per_rank;

  int invalid = 0;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
    const int32_t* row = topk_idx + static_cast<int64_t>(t) * top_k;
    uint64_t mask = 0;
    for (int k = 0; k < top_k; ++k) {
      const int raw = __ldg(row + k);
      if (expert_id_invalid(raw, num_experts)) ++invalid;
      const int v = sanitize_expert_id(raw, num_experts);
      if (v < 0) continue;
      mask |= 1ull << (v / local_experts);
      bool dup = false;
      for (int k2 = 0; k2 < k; ++k2) dup |= sanitize_expert_id(__ldg(row + k2), num_experts) == v;
      if (!dup) atomicAdd(&c_expert[v], 1);
    }
    bool* in_rank = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
    for (int q = 0; q < num_ranks; ++q) {
      const bool b = (mask >> q) & 1ull;
      in_rank[q] = b;
      if (b) atomicAdd(&c_rank[q], 1);
    }
  }
  // Invalid ids: warp reduction, one atomic per warp.
  for (int o = 16; o > 0; o >>= 1) invalid += __shfl_xor_sync(kFull, invalid, o);
  if ((threadIdx.x & 31) == 0 && invalid != 0)
    atomicAdd(use_smem ? s_invalid : num_invalid, invalid);
  if (use_smem) {
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
      if (s_expert[i] != 0) atomicAdd(&tokens_per_expert[i], s_expert[i]);
    for (int i = threadIdx.x; i < num_ranks; i += blockDim.x)
      if (s_rank[i] != 0) atomicAdd(&tokens_per_rank[i], s_rank[i]);
    if (threadIdx.x == 0 && *s_invalid != 0) atomicAdd(num_invalid, *s_invalid);
  }
}

}  // namespace layout
}  // namespace jax_ep
