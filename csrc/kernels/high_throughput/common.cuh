// Device pieces shared by the high-throughput kernels (kernels/high_throughput/) and the
// fused gather + grouped GEMM (kernels/fused/gather_gemm.cu): read-only loads of peer operands,
// the publish-and-wait step of the pull protocol for one block, and the warp-wide row copy.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "common/warp.h"
#include "testing/mutations.h"
#include "transport/pull.cuh"

namespace jax_ep {
namespace ht {

// int4 loads in flight per lane (row copy): a 14 KiB row (bf16, H = 7168) takes 2 rounds of
// loads-then-stores per warp, a 7 KiB FP8 row 1.
constexpr int kCopyUnroll = 16;

// 8 floats rounded to bfloat16 (to nearest even), packed in one int4.
__device__ __forceinline__ int4 pack_bf16x8(const float* a) {
  int4 r;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);
  return r;
}

// The two bfloat16 of a 32-bit word (the lower half first) as floats, exactly: a bfloat16 is the
// upper half of its float, so one shift and one mask (__bfloat1622float2 spends three
// instructions on the two, which the combines' sums run once per element).
__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t u) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}

// The 4 words of a 16-byte vector (8 bfloat16, two per word, the lower half first).
struct Words4 {
  uint32_t w[4];
};
__device__ __forceinline__ Words4 words(int4 v) {
  return {{static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
           static_cast<uint32_t>(v.w)}};
}

// acc[0..8) += the 8 bfloat16 of v, in float32 (the high-throughput combine's sum over ranks, and
// the fused GEMM + combine's).
__device__ __forceinline__ void add_bf16x8(float* acc, int4 v) {
  const Words4 h = words(v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = bf16x2_to_float2(h.w[i]);
    acc[2 * i] = __fadd_rn(acc[2 * i], f.x);
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], f.y);
  }
}

// Read-only loads of peer XLA operands (never written while an op runs).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// Rows a peer writes during the running kernel (no .nc: the read-only path may not see them),
// L1 bypassed.
__device__ __forceinline__ int4 ld_cg_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ int ld_nc_s32(const int32_t* p) {
  int v;
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float ld_nc_f32(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Steps 1-2 of the protocol for one block: thread 0 publishes (every block does it: the values
// are identical, and no block then depends on another block having been scheduled), then lanes
// of warp 0 wait for all peers' ready flags in parallel (one lane per peer). False (in every
// thread of the block) when a wait gave up, now or before (device_failed, loaded by thread 0
// only: a load by every thread of the grid queues on one L2 line, ~5 us): the block must end
// without reading any peer's memory or any index a failed kernel may have left unwritten.
__device__ __forceinline__ bool publish_and_wait(const PeerSlots& ps, const void* const* ptrs,
                                                 int n, unsigned long long e, int64_t timeout_ns,
                                                 const char* phase) {
  __shared__ bool ok;
  if (threadIdx.x < 32) {
    // A failed device publishes nothing (the publication's fence waits for this load anyway).
    bool good = true;
    if (threadIdx.x == 0) {
      good = !device_failed(ps);
      if (good) publish(ps, ptrs, n, e);
    }
    __syncwarp();  // orders the publication before the lanes' loads of the ready flags
    good = __shfl_sync(kFull, good, 0);
    if constexpr (JAX_EP_PLANTED(kHtStaleAddresses)) e = e > 1 ? e - 1 : e;
    if (good && static_cast<int>(threadIdx.x) < ps.num_ranks && !is_remote(ps, threadIdx.x) &&
        !wait_flag_geq(ps, &ps.slot[threadIdx.x]->ready, e, timeout_ns, threadIdx.x, phase))
      good = false;
    good = __all_sync(kFull, good);
    if (threadIdx.x == 0) ok = good;
  }
  __syncthreads();
  return ok;
}

// ------------------------------------------------------------------------------------------
// Row copy (dispatch kernel 2, and gather): one warp per destination row, grid-stride.
// ------------------------------------------------------------------------------------------
// A warp copies row src (nbytes) to dst, and to the nd rows copies[0..nd) of `rows` (nbytes
// each; the fused gather writes a token's other rows on the rank from one read).
__device__ __forceinline__ void copy_row_to(uint8_t* __restrict__ dst,
                                            const uint8_t* __restrict__ src, int64_t nbytes,
                                            bool vec, int lane, uint8_t* rows, const int* copies,
                                            int nd) {
  if (vec) {
    const int64_t n = nbytes >> 4;
    const int4* p = reinterpret_cast<const int4*>(src);
    for (int64_t base = lane; base < n; base += 32 * kCopyUnroll) {
      int4 v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u)
        if (base + u * 32 < n) v[u] = ld_nc_v4(p + base + u * 32);
      for (int q = -1; q < nd; ++q) {
        int4* d = reinterpret_cast<int4*>(q < 0 ? dst : rows + copies[q] * nbytes);
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
          if (base + u * 32 < n) d[base + u * 32] = v[u];
      }
    }
  } else {
    for (int64_t i = lane; i < nbytes; i += 32) {
      const uint8_t b = __ldg(src + i);
      dst[i] = b;
      for (int q = 0; q < nd; ++q) rows[copies[q] * nbytes + i] = b;
    }
  }
}
__device__ __forceinline__ void copy_row(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src,
                                         int64_t nbytes, bool vec, int lane) {
  copy_row_to(dst, src, nbytes, vec, lane, nullptr, nullptr, 0);
}
__device__ __forceinline__ void zero_row(uint8_t* dst, int64_t nbytes, bool vec, int lane) {
  if (vec) {
    int4* d = reinterpret_cast<int4*>(dst);
    const int4 z = make_int4(0, 0, 0, 0);
    for (int64_t i = lane; i < (nbytes >> 4); i += 32) d[i] = z;
  } else {
    for (int64_t i = lane; i < nbytes; i += 32) dst[i] = 0;
  }
}

}  // namespace ht
}  // namespace jax_ep
