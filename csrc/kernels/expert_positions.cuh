// The expert-major rows of a rank's (row, local expert) pairs (jax_ep_expert_positions): a
// stable counting sort of the pairs by expert, in one block. No communication. Defines a
// __global__ kernel: include it from csrc/ffi/expert_positions.cc only (one translation unit).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"
#include "testing/mutations.h"

namespace jax_ep {
namespace positions {

constexpr int kWarps = 32;
constexpr int kThreads = kWarps * 32;
constexpr int kAhead = 8;  // keys each lane loads before it uses the first (loads in flight)
constexpr unsigned int kFull = 0xffffffffu;
static_assert(kMaxPositionExperts < 512, "a key and the no-pair value fit kKeyBits");
constexpr int kKeyBits = 9;  // bits of a lane's value in `peers`: an expert, or 511 for none

// The lanes of the warp holding the same value v (< 2^kKeyBits) as this one: one ballot per bit
// (a few cycles each, where __match_any_sync took most of the kernel's time).
__device__ __forceinline__ unsigned int peers_of(int v) {
  unsigned int peers = kFull;
#pragma unroll
  for (int b = 0; b < kKeyBits; ++b) {
    const unsigned int set = __ballot_sync(kFull, (v >> b) & 1);
    peers &= ((v >> b) & 1) ? set : ~set;
  }
  return peers;
}

// Bytes of the kernel's dynamic shared memory for `capacity` rows: `src` is built there (a
// scatter of one SM's stores to global memory took most of the kernel's time) and copied out.
inline size_t smem_bytes(int64_t capacity) { return sizeof(int32_t) * capacity; }

// key[p] in [0, L): the expert of pair p; any other value: no pair there. The pairs of expert e
// take the rows offsets[e], offsets[e] + 1, ... in pair order, offsets[e] the sum of the earlier
// experts' counts each rounded up to a multiple of A. Writes pos[p] (that row, or `capacity`
// for no pair or a row at or past capacity), src[j] = p for every row j < capacity a pair took
// (-1 elsewhere), counts[e] (every pair of e, kept or not) and offsets[e]. capacity is at most
// kMaxPositionRows.
// Warp w takes the pairs [w * S, min((w + 1) * S, P)), S = ceil(P / 32): the warps' slices in
// warp order and each warp's pairs in lane order are the pairs' order, so a pair's row is its
// expert's offset, plus the pairs of the expert in the earlier warps' slices, plus those before
// it in its own.
__global__ void __launch_bounds__(kThreads, 1)
    positions_kernel(const int32_t* __restrict__ key, int64_t P, int L, int64_t capacity, int A,
                     int32_t* __restrict__ pos, int32_t* __restrict__ src,
                     int32_t* __restrict__ counts, int32_t* __restrict__ offsets) {
  // per warp and expert: first its count, then (after step 2) the pairs of the earlier warps,
  // then (step 3) also those of its own already placed
  __shared__ int before[kWarps][kMaxPositionExperts];
  __shared__ long long start[kMaxPositionExperts];  // each expert's first row
  extern __shared__ int32_t rows[];                 // [capacity]: src, built here
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < kWarps * L; i += kThreads) before[i / L][i % L] = 0;
  for (int64_t j = tid; j < capacity; j += kThreads) rows[j] = -1;
  __syncthreads();
  const int64_t S = (P + kWarps - 1) / kWarps;
  const int64_t lo = min(P, warp * S), hi = min(P, lo + S);
  const unsigned int lower = (1u << lane) - 1u;
  // 1. each warp counts its slice's pairs of each expert (a group of lanes naming one expert:
  // its first lane adds them)
  for (int64_t base = lo; base < hi; base += 32 * kAhead) {
    int k[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t p = base + u * 32 + lane;
      k[u] = p < hi ? __ldg(key + p) : -1;
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const bool pair = k[u] >= 0 && k[u] < L;
      const unsigned int peers = peers_of(pair ? k[u] : 511);
      if (pair && (peers & lower) == 0u) before[warp][k[u]] += __popc(peers);
    }
  }
  __syncthreads();
  // 2. per expert: each warp's count -> the pairs of the earlier warps; the expert's total
  for (int e = tid; e < L; e += kThreads) {
    int run = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int c = before[w][e];
      before[w][e] = run;
      run += c;
    }
    counts[e] = run;
    start[e] = (static_cast<long long>(run) + A - 1) / A * A;  // rounded up, scanned below
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
        offsets[e] = static_cast<int32_t>(carry + incl - v);
      }
      carry += __shfl_sync(kFull, incl, 31);
    }
  }
  __syncthreads();
  // 3. each warp places its pairs in order, 32 at a time: the lanes naming one expert take its
  // next rows in lane order, and the group's first lane moves the warp's count past them
  for (int64_t base = lo; base < hi; base += 32 * kAhead) {
    int k[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t p = base + u * 32 + lane;
      k[u] = p < hi ? __ldg(key + p) : -1;
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t p = base + u * 32 + lane;
      const bool pair = p < hi && k[u] >= 0 && k[u] < L;
      const int e = pair ? k[u] : -1;
      const unsigned int peers = peers_of(pair ? e : 511);
      long long row = capacity;
      // (the planted bug counts the group's lanes above this one instead of below)
      const unsigned int ahead = JAX_EP_PLANTED(kPositionsUnstable) ? peers & ~lower & ~(1u << lane)
                                                                     : peers & lower;
      if (pair) row = start[e] + before[warp][e] + __popc(ahead);
      __syncwarp();
      if (pair && (peers & lower) == 0u) before[warp][e] += __popc(peers);
      __syncwarp();
      if (row > capacity) row = capacity;
      if (p < hi) pos[p] = static_cast<int32_t>(row);
      if (row < capacity) rows[row] = static_cast<int32_t>(p);
    }
  }
  __syncthreads();
  for (int64_t j = tid; j < capacity; j += kThreads) src[j] = rows[j];
}

}  // namespace positions
}  // namespace jax_ep
