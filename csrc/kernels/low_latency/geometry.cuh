// Low-latency buffer geometry on the device: where a row, its header and tags, the count
// block and the weights sit in a receive buffer (the host side, sizes and offsets:
// kernels/low_latency.cuh and geometry.cu).
#pragma once
#include "kernels/low_latency/common.cuh"

namespace jax_ep {
namespace ll {
namespace {

// Dispatch row header: int tags[kDispatchTags], uint64 pos[K], int ids[K] (low_latency.cuh).
static_assert(kMaxParts == kDispatchTags, "every part of a dispatch row releases its own tags");
static_assert(kDispatchTags % 2 == 0, "the pos words are 8-byte aligned");
__device__ __forceinline__ unsigned long long* hdr_pos(int* hdr) {
  return reinterpret_cast<unsigned long long*>(hdr + kDispatchTags);
}
__device__ __forceinline__ const unsigned long long* hdr_pos(const int* hdr) {
  return reinterpret_cast<const unsigned long long*>(hdr + kDispatchTags);
}
__device__ __forceinline__ int* hdr_ids(int* hdr, int K) { return hdr + kDispatchTags + 2 * K; }
__device__ __forceinline__ const int* hdr_ids(const int* hdr, int K) {
  return hdr + kDispatchTags + 2 * K;
}

// Row t of sender s's area in a dispatch buffer (parity par), and the area's count block.
__device__ __forceinline__ uint8_t* dispatch_row(uint8_t* buf, const DispatchParams& p, int par,
                                                 int s, int t) {
  return buf + ((int64_t)par * p.ps.num_ranks + s) * p.area_bytes + (int64_t)t * p.row_bytes;
}
__device__ __forceinline__ unsigned long long* dispatch_counts(uint8_t* buf,
                                                               const DispatchParams& p, int par,
                                                               int s) {
  return reinterpret_cast<unsigned long long*>(
      buf + ((int64_t)par * p.ps.num_ranks + s) * p.area_bytes + (int64_t)p.M * p.row_bytes);
}

// Row (t, k) of parity par in a combine buffer, the tag of its column part, s's weights and their
// flag. A tag holds the epoch (low 32 bits) of the call whose part is in place, written by the
// expert rank after the part (release): the source reduces a token as soon as its rows are in,
// while other rows are still on their way.
__device__ __forceinline__ uint8_t* combine_row(uint8_t* buf, const CombineParams& p, int par,
                                                int t, int k) {
  return buf + (((int64_t)par * p.M + t) * p.K + k) * combine_row_bytes(p.H);
}
__device__ __forceinline__ int* combine_tag(uint8_t* buf, const CombineParams& p, int par, int t,
                                            int k, int part) {
  return reinterpret_cast<int*>(buf + combine_tags_offset(p.M, p.K, p.H)) +
         (((int64_t)par * p.M + t) * p.K + k) * kCombineParts + part;
}
__device__ __forceinline__ float* combine_weights(uint8_t* buf, const CombineParams& p, int par,
                                                  int s) {
  return reinterpret_cast<float*>(buf + combine_weights_offset(p.M, p.K, p.H)) +
         ((int64_t)par * p.ps.num_ranks + s) * p.M * p.K;
}
__device__ __forceinline__ int* combine_wflag(uint8_t* buf, const CombineParams& p, int par,
                                              int s) {
  return reinterpret_cast<int*>(buf + combine_wflags_offset(p.ps.num_ranks, p.M, p.K, p.H)) +
         par * p.ps.num_ranks + s;
}

}  // namespace
}  // namespace ll
}  // namespace jax_ep
