// The expert-major rows of a rank's (row, local expert) pairs (jax_ep_expert_positions): a
// stable counting sort of the pairs by expert over many blocks, in two kernels. No
// communication. Defines __global__ kernels: include it from csrc/ffi/expert_positions.cc only
// (one translation unit).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"
#include "common/warp.h"
#include "testing/mutations.h"

namespace jax_ep {
namespace positions {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpPairs = kPositionSlicePairs / kWarps;  // pairs of one warp's slice
constexpr int kSteps = kWarpPairs / 32;                   // 32 pairs a step
static_assert(kWarpPairs % 32 == 0, "a warp's slice is whole steps");
constexpr int kKeyBits = 11;                // bits of a lane's value in peers_of
constexpr int kNone = (1 << kKeyBits) - 1;  // the value of a lane without a pair
static_assert(kMaxPositionExperts < kNone, "an expert id and kNone fit kKeyBits");

// The lanes of the warp holding the same value v (< 2^kKeyBits) as this one: one ballot per bit.
__device__ __forceinline__ unsigned int peers_of(int v) {
  unsigned int peers = kFull;
#pragma unroll
  for (int b = 0; b < kKeyBits; ++b) {
    const unsigned int set = __ballot_sync(kFull, (v >> b) & 1);
    peers &= ((v >> b) & 1) ? set : ~set;
  }
  return peers;
}

// The keys of a warp's slice, kSteps values per lane (lane l, step u: pair base + u * 32 + l);
// kNone past P and for keys outside [0, L).
__device__ __forceinline__ void load_keys(const int32_t* __restrict__ key, int64_t P, int L,
                                          int64_t base, int lane, int (&k)[kSteps]) {
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int64_t p = base + u * 32 + lane;
    const int v = p < P ? __ldg(key + p) : -1;
    k[u] = v >= 0 && v < L ? v : kNone;
  }
}

// cnt[e] += the warp's pairs of each expert e (the first lane of each group adds the group).
__device__ __forceinline__ void count_warp(const int (&k)[kSteps], int lane, int* cnt) {
  const unsigned int lower = (1u << lane) - 1u;
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const unsigned int peers = peers_of(k[u]);
    if (k[u] != kNone && (peers & lower) == 0u) cnt[k[u]] += __popc(peers);
    __syncwarp();
  }
}

// Kernel 1, one block per slice of kPositionSlicePairs pairs: block_counts[b, e] = the pairs of
// expert e in slice b; every block also fills its share of src with -1.
__global__ void __launch_bounds__(kThreads)
    count_kernel(const int32_t* __restrict__ key, int64_t P, int L, int64_t capacity,
                 int32_t* __restrict__ src, int32_t* __restrict__ block_counts) {
  __shared__ int cnt[kWarps][kMaxPositionExperts];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(kThreads) + tid; j < capacity;
       j += static_cast<int64_t>(gridDim.x) * kThreads)
    src[j] = -1;
  for (int i = tid; i < kWarps * L; i += kThreads) cnt[i / L][i % L] = 0;
  __syncthreads();
  int k[kSteps];
  load_keys(key, P, L, blockIdx.x * static_cast<int64_t>(kPositionSlicePairs) + warp * kWarpPairs,
            lane, k);
  count_warp(k, lane, cnt[warp]);
  __syncthreads();
  for (int e = tid; e < L; e += kThreads) {
    int s = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += cnt[w][e];
    block_counts[blockIdx.x * static_cast<int64_t>(L) + e] = s;
  }
}

// Kernel 2, one block per slice: each pair's row. The pairs of expert e take the rows
// offsets[e], offsets[e] + 1, ... in pair order (slices in block order, a slice's warps in warp
// order, a warp's steps in order, a step's lanes in lane order), offsets[e] the sum of the
// earlier experts' counts each rounded up to a multiple of A. Writes pos[p] (that row, or
// `capacity` for no pair or a row at or past capacity), src[row] = p for a row below capacity,
// and (block 0) counts[e] (every pair of e, kept or not) and offsets[e].
__global__ void __launch_bounds__(kThreads)
    place_kernel(const int32_t* __restrict__ key, int64_t P, int L, int64_t capacity, int A,
                 const int32_t* __restrict__ block_counts, int32_t* __restrict__ pos,
                 int32_t* __restrict__ src, int32_t* __restrict__ counts,
                 int32_t* __restrict__ offsets) {
  // per warp and expert: its count, then the pairs before the warp's next step
  __shared__ int base[kWarps][kMaxPositionExperts];
  __shared__ long long start[kMaxPositionExperts];  // an expert's first row, then its slice's
  __shared__ int earlier[kMaxPositionExperts];      // pairs of each expert in earlier slices
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int b = blockIdx.x, nb = gridDim.x;
  for (int i = tid; i < kWarps * L; i += kThreads) base[i / L][i % L] = 0;
  for (int e = tid; e < L; e += kThreads) {
    int before = 0, total = 0;
    for (int c = 0; c < nb; ++c) {
      const int n = block_counts[c * static_cast<int64_t>(L) + e];
      if (c < b) before += n;
      total += n;
    }
    earlier[e] = before;
    start[e] = (static_cast<long long>(total) + A - 1) / A * A;  // rounded up, scanned below
    if (b == 0) counts[e] = total;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the rounded counts, 32 experts at a time
    long long carry = 0;
    for (int e0 = 0; e0 < L; e0 += 32) {
      const int e = e0 + lane;
      const long long v = e < L ? start[e] : 0;
      long long incl = v;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const long long t = __shfl_up_sync(kFull, incl, d);
        if (lane >= d) incl += t;
      }
      if (e < L) {
        start[e] = carry + incl - v;
        if (b == 0) offsets[e] = static_cast<int32_t>(carry + incl - v);
      }
      carry += __shfl_sync(kFull, incl, 31);
    }
  }
  int k[kSteps];
  const int64_t slice = b * static_cast<int64_t>(kPositionSlicePairs) + warp * kWarpPairs;
  load_keys(key, P, L, slice, lane, k);
  count_warp(k, lane, base[warp]);
  __syncthreads();
  for (int e = tid; e < L; e += kThreads) {  // each warp's count -> the pairs before the warp
    int run = earlier[e];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = base[w][e];
      base[w][e] = run;
      run += c;
    }
  }
  __syncthreads();
  const unsigned int lower = (1u << lane) - 1u;
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int64_t p = slice + u * 32 + lane;
    const int e = k[u];
    const unsigned int peers = peers_of(e);
    // (the planted bug counts the group's lanes above this one instead of below)
    const unsigned int ahead =
        JAX_EP_PLANTED(kPositionsUnstable) ? peers & ~lower & ~(1u << lane) : peers & lower;
    long long row = capacity;
    if (e != kNone) row = start[e] + base[warp][e] + __popc(ahead);
    __syncwarp();
    if (e != kNone && (peers & lower) == 0u) base[warp][e] += __popc(peers);
    __syncwarp();
    if (row > capacity) row = capacity;
    if (p < P) pos[p] = static_cast<int32_t>(row);
    if (row < capacity) src[row] = static_cast<int32_t>(p);
  }
}

}  // namespace positions
}  // namespace jax_ep
