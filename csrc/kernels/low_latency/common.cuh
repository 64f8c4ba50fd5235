// Low-latency kernels, common part: tunables, lane and bf16 helpers, the epoch comparisons of
// the push protocol's tags and words, and the launch helpers (design: docs/kernels.md).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common/warp.h"
#include "kernels/fp8.cuh"
#include "kernels/launch.cuh"
#include "kernels/low_latency.cuh"
#include "testing/mutations.h"

namespace jax_ep {
namespace ll {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr int kMaxParts = 4;       // most warps per (token, destination) send row / received row
constexpr int kQuantUnits = 4;     // 128-column groups in flight per 8 lanes (quantisation)
constexpr int kCopyRegs = 8;       // vectors in flight per lane while copying a row
constexpr int kFastRegs = 6;       // the same in copy_row_fast (loaded with the row's words)
constexpr int kFillInts = 512;     // recv_src / recv_slot entries per fill item
constexpr int kCombineVpt = 2;     // column vectors per lane per combine item
constexpr int kCombineKb = 8;      // top-k rows loaded together in combine
constexpr int kPollSleepNs = 128;  // pause between polls of a row tag or an epoch word

__host__ __device__ inline int64_t align16(int64_t v) { return (v + 15) & ~int64_t{15}; }

// Diagnostic (JAX_EP_LL_DIAG=1, off by default): the latest %globaltimer that any caller
// reached point i, into trace[i] of our slot; the points are named in transport/trace_marks.h
// ("Phase tracer"). benchmarks/trace_phases.py --ll-only --absolute prints them.
__device__ __forceinline__ void diag_max(const PeerSlots& ps, int on, int i) {
  if (on) trace_max(ps, i);
}

// Warps per row (column parts) so that `fixed` + rows * parts items fit the grid's warps: the
// phases are chains of latencies, and a second wave of items on a warp doubles the phase.
__device__ __forceinline__ int row_parts(int fixed, int rows) {
  const int nw = static_cast<int>(gridDim.x) * kWarps;
  if (rows <= 0) return 1;
  return max(1, min(kMaxParts, (nw - fixed) / rows));
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Local expert of rank r named by a raw id, or -1 (invalid ids act as -1).
__device__ __forceinline__ int local_expert(int v, int E, int L, int r) {
  if (v < 0 || v >= E) return -1;
  const int q = v / L;
  return q == r ? v - q * L : -1;
}

// bf16 vectors <-> float
__device__ __forceinline__ float bf16_bits_to_float(unsigned int b) {
  return __uint_as_float(b << 16);
}
__device__ __forceinline__ unsigned int float_to_bf16_bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ void unpack(const unsigned short& v, float (&f)[1]) {
  f[0] = bf16_bits_to_float(v);
}
__device__ __forceinline__ void unpack(const unsigned int& v, float (&f)[2]) {
  f[0] = bf16_bits_to_float(v & 0xffffu);
  f[1] = __uint_as_float(v & 0xffff0000u);
}
__device__ __forceinline__ void unpack(const uint2& v, float (&f)[4]) {
  f[0] = bf16_bits_to_float(v.x & 0xffffu);
  f[1] = __uint_as_float(v.x & 0xffff0000u);
  f[2] = bf16_bits_to_float(v.y & 0xffffu);
  f[3] = __uint_as_float(v.y & 0xffff0000u);
}
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
  fp8::bf16x8_to_float(v, f);
}
__device__ __forceinline__ unsigned int pack2(float a, float b) {
  return float_to_bf16_bits(a) | (float_to_bf16_bits(b) << 16);
}
__device__ __forceinline__ void pack(const float (&f)[1], unsigned short* o) {
  *o = (unsigned short)float_to_bf16_bits(f[0]);
}
__device__ __forceinline__ void pack(const float (&f)[2], unsigned int* o) {
  *o = pack2(f[0], f[1]);
}
__device__ __forceinline__ void pack(const float (&f)[4], uint2* o) {
  *o = make_uint2(pack2(f[0], f[1]), pack2(f[2], f[3]));
}
__device__ __forceinline__ void pack(const float (&f)[8], uint4* o) {
  *o = make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

// Whole warp: copy `bytes` (a multiple of sizeof(V)) from src to dst, kCopyRegs vectors per
// lane in flight. src is read-only for the kernel (an XLA operand).
template <typename V>
__device__ __forceinline__ void copy_row(const uint8_t* src, uint8_t* dst, int64_t bytes,
                                         int lane) {
  const int nvec = static_cast<int>(bytes / (int64_t)sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  for (int base = 0; base < nvec; base += kCopyRegs * 32) {
    V buf[kCopyRegs];
#pragma unroll
    for (int u = 0; u < kCopyRegs; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nvec) buf[u] = __ldg(s + v);
    }
#pragma unroll
    for (int u = 0; u < kCopyRegs; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nvec) d[v] = buf[u];
    }
  }
}

// Whether 32-bit epoch tag v is older than e32 (wrap-safe). A newer one passes: XLA may run a
// split receive twice, after the row was written again for call e + 2.
__device__ __forceinline__ bool tag_older(int v, unsigned int e32) {
  if constexpr (JAX_EP_PLANTED(kLlStaleTag)) e32 -= 2;
  return static_cast<int>(static_cast<unsigned int>(v) - e32) < 0;
}
// A word that carries its epoch (pos, count, data flag): (epoch << 32) | value.
__device__ __forceinline__ unsigned long long with_epoch(unsigned long long e, unsigned int v) {
  return (e << 32) | v;
}
// Whether such a word is older than call er (wrap-safe in the epoch's low 32 bits, as the tags).
__device__ __forceinline__ bool word_older(unsigned long long w, unsigned long long er) {
  if constexpr (JAX_EP_PLANTED(kLlStaleWord)) er -= 2;
  return static_cast<int>(static_cast<unsigned int>(w >> 32) - static_cast<unsigned int>(er)) < 0;
}

// `kernel` instantiated for the vector of vw bytes (vec_bytes): uint4, uint2, unsigned int or
// unsigned short.
#define JAX_EP_LL_BY_VEC_WIDTH(kernel, vw) \
  ((vw) == 16  ? kernel<uint4>             \
   : (vw) == 8 ? kernel<uint2>             \
   : (vw) == 4 ? kernel<unsigned int>      \
               : kernel<unsigned short>)

// Widest vector (bytes) dividing every value.
int vec_bytes(std::initializer_list<uintptr_t> vals) {
  int vw = 16;
  for (uintptr_t v : vals)
    while (vw > 2 && (v & (vw - 1))) vw >>= 1;
  return vw;
}

}  // namespace
}  // namespace ll
}  // namespace jax_ep
