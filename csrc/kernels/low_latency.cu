// Low-latency dispatch / combine kernels (one kernel per op, pull over peer memory).
// Protocol: transport/peer.cuh. Contract: docs/ffi.md. Design notes: docs/kernels.md.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/fp8.cuh"
#include "kernels/low_latency.cuh"

namespace jax_ep {
namespace ll {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kDispatchWarps = kDispatchThreads / 32;
constexpr int kCopyUnroll = 16;  // 16-byte vectors in flight per lane while pulling a row
constexpr int kQuantUnits = 8;   // (row, group) units in flight per half-warp while quantising
constexpr int kCombineVpt = 2;   // column vectors per thread in combine
constexpr int kCombineKb = 8;    // top-k slots whose rows are loaded together in combine

template <int Bytes> struct VecOf;
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<4> { using type = unsigned int; };
template <> struct VecOf<2> { using type = unsigned short; };

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Local expert of this rank named by a raw id, or -1 (invalid ids act as -1).
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
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) { fp8::bf16x8_to_float(v, f); }
__device__ __forceinline__ unsigned int pack2(float a, float b) {
  return float_to_bf16_bits(a) | (float_to_bf16_bits(b) << 16);
}
__device__ __forceinline__ void pack(const float (&f)[1], unsigned short* o) {
  *o = (unsigned short)float_to_bf16_bits(f[0]);
}
__device__ __forceinline__ void pack(const float (&f)[2], unsigned int* o) { *o = pack2(f[0], f[1]); }
__device__ __forceinline__ void pack(const float (&f)[4], uint2* o) {
  *o = make_uint2(pack2(f[0], f[1]), pack2(f[2], f[3]));
}
__device__ __forceinline__ void pack(const float (&f)[8], uint4* o) {
  *o = make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

// ---------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------

// Sender side (use_fp8): quantise own rows x[t] into staging [M*H e4m3 | M*G f32 scales].
// A half-warp owns one (row, 128-column group) unit: 16 lanes x 8 bf16 (one 16-byte load each);
// each half-warp keeps kQuantUnits units' loads in flight.
__device__ __forceinline__ void quantise_own_rows(const DispatchParams& p, int lane, int warp) {
  const int units = p.T * p.G;
  const int half = lane >> 4, sub = lane & 15;
  const uint8_t* x = static_cast<const uint8_t*>(p.x);
  uint8_t* q_base = p.staging;
  float* sc_base = reinterpret_cast<float*>(p.staging + (int64_t)p.M * p.H);
  const bool round_scale = p.round_scale != 0;
  constexpr int kPerWarp = 2 * kQuantUnits;
  for (int base = (blockIdx.x * kDispatchWarps + warp) * kPerWarp; base < units;
       base += gridDim.x * kDispatchWarps * kPerWarp) {  // warp-uniform
    uint4 raw[kQuantUnits];
#pragma unroll
    for (int q = 0; q < kQuantUnits; ++q) {
      const int u = base + 2 * q + half;
      raw[q] = make_uint4(0u, 0u, 0u, 0u);
      if (u < units) {
        const int t = u / p.G, g = u - t * p.G;
        raw[q] = __ldg(reinterpret_cast<const uint4*>(
            x + ((int64_t)t * p.H + g * fp8::kGroup + sub * 8) * 2));
      }
    }
#pragma unroll
    for (int q = 0; q < kQuantUnits; ++q) {
      const int u = base + 2 * q + half;
      const int t = u / p.G, g = u - t * p.G;  // used only when u < units
      fp8::quantise_group_slice(
          raw[q], round_scale, u < units, sub,
          reinterpret_cast<uint2*>(q_base + (int64_t)t * p.H + g * fp8::kGroup + sub * 8),
          sc_base + (int64_t)t * p.G + g);
    }
  }
}

// One warp pulls one row (row_bytes, from a peer) once and stores it into every destination
// (expert le, row j) held by the lanes in `mask`.
template <typename V, int kCopyUnroll>
__device__ __forceinline__ void pull_row(const uint8_t* src, uint8_t* dst_base,
                                         int64_t row_bytes, int64_t rows_per_expert,
                                         unsigned mask, int le, int j, int lane) {
  const int nvec = static_cast<int>(row_bytes / (int64_t)sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  for (int base = 0; base < nvec; base += kCopyUnroll * 32) {
    V buf[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nvec) buf[u] = __ldcg(s + v);
    }
    for (unsigned m = mask; m != 0; m &= m - 1) {  // warp-uniform
      const int sl = __ffs(m) - 1;
      const int l = __shfl_sync(kFull, le, sl);
      const int jj = __shfl_sync(kFull, j, sl);
      V* d = reinterpret_cast<V*>(dst_base + ((int64_t)l * rows_per_expert + jj) * row_bytes);
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int v = base + u * 32 + lane;
        if (v < nvec) d[v] = buf[u];
      }
    }
  }
}

__global__ void __launch_bounds__(kDispatchThreads, 1)
    dispatch_kernel(const __grid_constant__ DispatchParams p) {
  extern __shared__ int s_counts[];  // [L]: final per-expert counts
  __shared__ const uint8_t* s_src[kMaxRanks];
  __shared__ const int32_t* s_idx[kMaxRanks];
  __shared__ int s_invalid;
  const PeerSlots& ps = p.ps;
  const int R = ps.num_ranks, r = ps.rank;
  int* counters = ps.slot[r]->counters;
  const unsigned long long epoch = call_epoch(ps);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t RM = (int64_t)R * p.M;
  unsigned int gen = 0;
  trace_mark(ps, 16);

  // 1. Sender side: quantise own rows once (FP8); peers pull the staging rows.
  if (p.use_fp8) {
    quantise_own_rows(p, lane, warp);
    grid_barrier(ps, ++gen, p.timeout_ns, "ll_dispatch: quantise");
    trace_mark(ps, 17);
  }

  // 2. Publish (every block: idempotent, no dependence on block 0 being scheduled) and wait.
  // (As wait_ready, with the R waits spread over lanes.)
  if (warp == 0) {
    if (lane == 0) {
      const void* mine[2] = {p.use_fp8 ? static_cast<const void*>(p.staging) : p.x,
                             static_cast<const void*>(p.topk_idx)};
      publish(ps, mine, 2, epoch);
    }
    __syncwarp();
    if (lane < R) {  // lane s waits for rank s (the R remote polls run in parallel)
      wait_flag_geq(&ps.slot[lane]->ready, epoch, p.timeout_ns, r, lane,
                    "ll_dispatch: wait for peers");
      s_src[lane] = peer_ptr<const uint8_t>(ps, lane, 0);
      s_idx[lane] = peer_ptr<const int32_t>(ps, lane, 1);
    }
  }
  __syncthreads();
  trace_mark(ps, 18);

  // 3. Receiver side: one warp per (source s, token t).
  const int64_t row_bytes = p.use_fp8 ? (int64_t)p.H : 2LL * p.H;
  int vw = 16;  // widest vector dividing the row size and the output base
  while (vw > 2 && ((row_bytes | (int64_t)reinterpret_cast<uintptr_t>(p.recv_x)) & (vw - 1)))
    vw >>= 1;
  uint8_t* recv_x = static_cast<uint8_t*>(p.recv_x);
  const int nitems = R * p.M;
  for (int it = blockIdx.x * kDispatchWarps + warp; it < nitems;
       it += gridDim.x * kDispatchWarps) {  // warp-uniform
    const int s = it % R, t = it / R;
    int32_t* s2r = p.src_to_row + ((int64_t)s * p.M + t) * p.L;
    for (int l = lane; l < p.L; l += 32) s2r[l] = -1;
    if (t >= p.T) continue;
    __syncwarp();  // orders the -1 stores before the row stores below (other lanes)
    const int32_t* idx = s_idx[s] + (int64_t)t * p.K;
    const uint8_t* src_row = s_src[s] + (int64_t)t * row_bytes;
    const float* src_sc =
        reinterpret_cast<const float*>(s_src[s] + (int64_t)p.M * p.H) + (int64_t)t * p.G;
    for (int kb = 0; kb < p.K; kb += 32) {  // one pass when K <= 32
      const int k = kb + lane;
      const int le = k < p.K ? local_expert(__ldcg(idx + k), p.E, p.L, r) : -1;
      const unsigned same = __match_any_sync(kFull, le);
      bool lead = le >= 0 && (same & lanemask_lt()) == 0;  // first slot naming le
      if (lead) {
        for (int k2 = 0; k2 < kb; ++k2)  // earlier passes (K > 32 only)
          if (local_expert(__ldcg(idx + k2), p.E, p.L, r) == le) {
            lead = false;
            break;
          }
      }
      const unsigned mask = __ballot_sync(kFull, lead);
      if (mask == 0) continue;
      int j = 0;
      if (lead) {
        j = atomicAdd(counters + le, 1);
        p.recv_src[(int64_t)le * RM + j] = s * p.M + t;
        s2r[le] = j;
      }
      float sc0 = 0.f, sc1 = 0.f;
      if (p.use_fp8) {
        if (lane < p.G) sc0 = __ldcg(src_sc + lane);
        if (lane + 32 < p.G) sc1 = __ldcg(src_sc + lane + 32);
      }
      switch (vw) {
        case 16:
          pull_row<uint4, kCopyUnroll>(src_row, recv_x, row_bytes, RM, mask, le, j, lane);
          break;
        case 8: pull_row<uint2, 8>(src_row, recv_x, row_bytes, RM, mask, le, j, lane); break;
        case 4: pull_row<unsigned int, 8>(src_row, recv_x, row_bytes, RM, mask, le, j, lane); break;
        default: pull_row<unsigned short, 8>(src_row, recv_x, row_bytes, RM, mask, le, j, lane);
      }
      if (p.use_fp8) {
        for (unsigned m = mask; m != 0; m &= m - 1) {
          const int sl = __ffs(m) - 1;
          const int l = __shfl_sync(kFull, le, sl);
          const int jj = __shfl_sync(kFull, j, sl);
          float* d = p.recv_scales + ((int64_t)l * RM + jj) * p.G;
          if (lane < p.G) d[lane] = sc0;
          if (lane + 32 < p.G) d[lane + 32] = sc1;
          for (int g = lane + 64; g < p.G; g += 32) d[g] = __ldcg(src_sc + g);
        }
      }
    }
  }

  // 4. All rows placed: counts are final. recv_src = -1 past the count.
  trace_mark(ps, 19);
  grid_barrier(ps, ++gen, p.timeout_ns, "ll_dispatch: receive");
  for (int l = threadIdx.x; l < p.L; l += blockDim.x)
    s_counts[l] = *reinterpret_cast<volatile int*>(counters + l);
  __syncthreads();
  const int64_t total = (int64_t)p.L * RM;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int l = static_cast<int>(i / RM);
    if (i - (int64_t)l * RM >= s_counts[l]) p.recv_src[i] = -1;
  }

  // 5. The last block (every other block has read the counters): recv_count, zero the counters,
  // stats, reset the grid barrier; then the cross-rank end barrier.
  end_barrier(ps, epoch, p.timeout_ns, "ll_dispatch: end", [&]() {
    if (threadIdx.x == 0) s_invalid = 0;
    for (int l = threadIdx.x; l < p.L; l += blockDim.x) {
      p.recv_count[l] = s_counts[l];
      counters[l] = 0;
    }
    __syncthreads();
    int c = 0;
    const int64_t n = (int64_t)p.T * p.K;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const int v = p.topk_idx[i];
      c += (v < -1 || v >= p.E) ? 1 : 0;
    }
    c = __reduce_add_sync(kFull, c);
    if (lane == 0 && c != 0) atomicAdd(&s_invalid, c);
    __syncthreads();
    if (threadIdx.x == 0) {
      p.stats[0] = s_invalid;
      p.stats[1] = 0;
      grid_barrier_reset(ps);
    }
  }, 20);
}

// ---------------------------------------------------------------------------------------------
// Fast dispatch (K <= 32): push protocol, every SM, several warps per row, no grid barrier.
// ---------------------------------------------------------------------------------------------

constexpr int kFastWarps = kFastDispatchThreads / 32;
constexpr int kHalfWarps = 2 * kFastWarps;
constexpr int kRowRegs = 8;  // vectors per lane in flight while pulling a row part

// Sender side (use_fp8): quantise own rows [t0, t1) into staging [M*H e4m3 | M*G f32 scales].
// A half-warp owns one (row, 128-column group) unit: 16 lanes x 8 bf16 (one 16-byte load each);
// all units' loads of a round are issued before any is converted. Block-uniform.
__device__ __forceinline__ void quantise_rows(const DispatchParams& p, int t0, int t1, int lane,
                                              int warp) {
  const int units = (t1 - t0) * p.G;
  const int hw = warp * 2 + (lane >> 4), sub = lane & 15;
  const uint8_t* x = static_cast<const uint8_t*>(p.x);
  uint8_t* q_base = p.staging;
  float* sc_base = reinterpret_cast<float*>(p.staging + (int64_t)p.M * p.H);
  const bool round_scale = p.round_scale != 0;
  for (int base = 0; base < units; base += kHalfWarps * kQuantUnits) {  // block-uniform
    uint4 raw[kQuantUnits];
#pragma unroll
    for (int q = 0; q < kQuantUnits; ++q) {
      const int u = base + q * kHalfWarps + hw;
      raw[q] = make_uint4(0u, 0u, 0u, 0u);
      if (u < units) {
        const int t = t0 + u / p.G, g = u % p.G;
        raw[q] = __ldg(reinterpret_cast<const uint4*>(
            x + ((int64_t)t * p.H + g * fp8::kGroup + sub * 8) * 2));
      }
    }
#pragma unroll
    for (int q = 0; q < kQuantUnits; ++q) {
      const int u = base + q * kHalfWarps + hw;
      if (base + q * kHalfWarps >= units) break;  // block-uniform: no unit of this q anywhere
      const int t = t0 + u / p.G, g = u % p.G;  // used only when u < units
      fp8::quantise_group_slice(
          raw[q], round_scale, u < units, sub,
          reinterpret_cast<uint2*>(q_base + (int64_t)t * p.H + g * fp8::kGroup + sub * 8),
          sc_base + (int64_t)t * p.G + g);
    }
  }
}

// Block b handles work items (s, t), item i = t * R + s, i in [b*n/grid, (b+1)*n/grid), n = R*T,
// in rounds of up to 16 items. Per round:
//   A: warp w indexes item w: lane k reads topk_idx_s[t][k] (one NVLink round trip for all k),
//      fills src_to_row[s][t][*] = -1, de-duplicates (first slot naming a local expert leads),
//      writes the leaders' experts to shared memory; FP8: lane 0 waits for s's chunk flag.
//   B1: all 16 warps issue the loads of their part of a row (16/n warps per item; one 16-byte
//      vector per lane per 32*16/n vectors: the whole 7 KiB FP8 row of H = 7168 in one trip).
//   B2: meanwhile the index warps take the rows: j = atomicAdd(counter[l]), recv_src, src_to_row.
//   B3: after __syncthreads, store the part to every leader's row (l, j) + the scales.
template <typename V>
__global__ void __launch_bounds__(kFastDispatchThreads, 1)
    dispatch_fast_kernel(const __grid_constant__ DispatchParams p) {
  __shared__ const uint8_t* s_src[kMaxRanks];
  __shared__ const int32_t* s_idx[kMaxRanks];
  __shared__ int s_nlead[kFastWarps];
  __shared__ int s_le[kFastWarps][kFastMaxK];
  __shared__ int s_j[kFastWarps][kFastMaxK];
  __shared__ int s_invalid;
  const PeerSlots& ps = p.ps;
  const int R = ps.num_ranks, r = ps.rank;
  int* counters = ps.slot[r]->counters;
  const unsigned long long epoch = call_epoch(ps);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t RM = (int64_t)R * p.M;
  const bool fp8 = p.use_fp8 != 0;
  const int64_t row_bytes = fp8 ? (int64_t)p.H : 2LL * p.H;
  const int nch = max(1, min(p.M, kMaxChunks));  // chunk c = tokens [c*tpc, (c+1)*tpc)
  const int tpc = max(1, (p.M + nch - 1) / nch);
  trace_mark(ps, 16);

  // 1. Push our addresses into every rank's slot (a few blocks, identical values).
  if (blockIdx.x < kPushBlocks && warp == 0 && lane < R) {
    const void* mine[2] = {fp8 ? static_cast<const void*>(p.staging) : p.x,
                           static_cast<const void*>(p.topk_idx)};
    push_publish_lane(ps, lane, mine, 2, epoch);
  }

  // 2. FP8 sender side: quantise own chunks (each token once), flag each chunk to every rank.
  //    Chunks are taken from a ticket counter, not by block index: the first resident blocks
  //    quantise everything before anyone waits, so the kernel never needs all of its blocks
  //    co-resident (XLA may run another kernel, e.g. a NCCL collective, beside it).
  if (fp8) {
    __shared__ int s_ticket;
    for (;;) {  // block-uniform
      if (threadIdx.x == 0) s_ticket = (int)atomicAdd(&ps.slot[r]->work_ticket, 1u);
      __syncthreads();
      const int c = s_ticket;
      __syncthreads();
      if (c >= nch) break;
      const int t0 = c * tpc, t1 = min(p.T, t0 + tpc);
      if (t1 > t0) quantise_rows(p, t0, t1, lane, warp);
      push_chunk_ready(ps, c, epoch);
    }
    trace_mark(ps, 17);
  }

  // 3. src_to_row[s][t][*] = -1 for T <= t < M (no other writer; t < T: by the item's warp).
  {
    const int64_t per_s = (int64_t)(p.M - p.T) * p.L;
    const int64_t n = (int64_t)R * per_s;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
      const int64_t s = i / per_s;
      p.src_to_row[(s * p.M + p.T) * p.L + (i - s * per_s)] = -1;
    }
  }

  // 4. Wait for every rank's addresses (local polls; lane s for rank s).
  if (warp == 0 && lane < R) {
    push_wait_ready(ps, lane, epoch, p.timeout_ns, "ll_dispatch: wait for peers");
    s_src[lane] = pushed_ptr<const uint8_t>(ps, lane, 0);
    s_idx[lane] = pushed_ptr<const int32_t>(ps, lane, 1);
  }
  __syncthreads();
  trace_mark(ps, 18);

  // 5. Receive.
  const int nitems = R * p.T;
  const int i0 = (int)((int64_t)blockIdx.x * nitems / gridDim.x);
  const int i1 = (int)((int64_t)(blockIdx.x + 1) * nitems / gridDim.x);
  const int nvec = static_cast<int>(row_bytes / (int64_t)sizeof(V));
  const int G = p.G;
  uint8_t* recv_x = static_cast<uint8_t*>(p.recv_x);
  for (int base = i0; base < i1; base += kFastWarps) {  // block-uniform
    const int n = min(kFastWarps, i1 - base);
    // A. index warps
    int my_le = -1, my_pos = 0;
    bool lead = false;
    if (warp < n) {
      const int it = base + warp, s = it % R, t = it / R;
      const int v = lane < p.K ? __ldcg(s_idx[s] + (int64_t)t * p.K + lane) : -1;
      int32_t* s2r = p.src_to_row + ((int64_t)s * p.M + t) * p.L;
      for (int l = lane; l < p.L; l += 32) s2r[l] = -1;
      if (fp8 && lane == 0)
        push_wait_chunk(ps, s, t / tpc, epoch, p.timeout_ns, "ll_dispatch: wait for rows");
      my_le = local_expert(v, p.E, p.L, r);
      const unsigned same = __match_any_sync(kFull, my_le);
      lead = my_le >= 0 && (same & lanemask_lt()) == 0;  // first slot naming the expert
      const unsigned mask = __ballot_sync(kFull, lead);
      my_pos = __popc(mask & lanemask_lt());
      if (lead) s_le[warp][my_pos] = my_le;
      if (lane == 0) s_nlead[warp] = __popc(mask);
    }
    __syncthreads();
    // B1. every warp: loads of its part of one row
    const int wpi = kFastWarps / n;  // warps per item
    const int ci = warp % n, u = warp / n;
    const int nl = s_nlead[ci];
    const bool copier = u < wpi && nl > 0;
    const int cit = base + ci, cs = cit % R, ct = cit / R;
    const V* src = reinterpret_cast<const V*>(s_src[cs] + (int64_t)ct * row_bytes);
    const float* src_sc =
        reinterpret_cast<const float*>(s_src[cs] + (int64_t)p.M * p.H) + (int64_t)ct * G;
    const int stride = wpi * 32, lane0 = u * 32 + lane;
    V buf[kRowRegs];
    float sc[2] = {0.f, 0.f};
    if (copier) {
#pragma unroll
      for (int k = 0; k < kRowRegs; ++k) {
        const int v = lane0 + k * stride;
        if (v < nvec) buf[k] = __ldcg(src + v);
      }
      if (fp8) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int g = lane0 + k * stride;
          if (g < G) sc[k] = __ldcg(src_sc + g);
        }
      }
    }
    // B2. index warps take the rows while the loads are in flight
    if (lead) {
      const int it = base + warp, s = it % R, t = it / R;
      const int j = atomicAdd(counters + my_le, 1);
      s_j[warp][my_pos] = j;
      p.recv_src[(int64_t)my_le * RM + j] = s * p.M + t;
      p.src_to_row[((int64_t)s * p.M + t) * p.L + my_le] = j;  // after the -1 (same warp)
    }
    __syncthreads();
    // B3. store to every leader's row (local), then any rest of the row
    if (copier) {
      for (int q = 0; q < nl; ++q) {  // warp-uniform
        const int64_t row = (int64_t)s_le[ci][q] * RM + s_j[ci][q];
        V* d = reinterpret_cast<V*>(recv_x + row * row_bytes);
#pragma unroll
        for (int k = 0; k < kRowRegs; ++k) {
          const int v = lane0 + k * stride;
          if (v < nvec) d[v] = buf[k];
        }
        if (fp8) {
          float* ds = p.recv_scales + row * G;
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const int g = lane0 + k * stride;
            if (g < G) ds[g] = sc[k];
          }
          for (int g = lane0 + 2 * stride; g < G; g += stride) ds[g] = __ldcg(src_sc + g);
        }
      }
      for (int v0 = kRowRegs * stride; v0 < nvec; v0 += kRowRegs * stride) {  // long rows
#pragma unroll
        for (int k = 0; k < kRowRegs; ++k) {
          const int v = v0 + lane0 + k * stride;
          if (v < nvec) buf[k] = __ldcg(src + v);
        }
        for (int q = 0; q < nl; ++q) {
          const int64_t row = (int64_t)s_le[ci][q] * RM + s_j[ci][q];
          V* d = reinterpret_cast<V*>(recv_x + row * row_bytes);
#pragma unroll
          for (int k = 0; k < kRowRegs; ++k) {
            const int v = v0 + lane0 + k * stride;
            if (v < nvec) d[v] = buf[k];
          }
        }
      }
    }
    __syncthreads();  // shared tables are rewritten by the next round
  }
  trace_mark(ps, 19);

  // 6. num_invalid over own ids (one block; no dependence on the others).
  if (blockIdx.x == gridDim.x - 1) {  // block-uniform
    if (threadIdx.x == 0) s_invalid = 0;
    __syncthreads();
    int c = 0;
    const int64_t n = (int64_t)p.T * p.K;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const int v = __ldg(p.topk_idx + i);
      c += (v < -1 || v >= p.E) ? 1 : 0;
    }
    c = __reduce_add_sync(kFull, c);
    if (lane == 0 && c != 0) atomicAdd(&s_invalid, c);
    __syncthreads();
    if (threadIdx.x == 0) {
      p.stats[0] = s_invalid;
      p.stats[1] = 0;
    }
  }

  // 7. End barrier. The last block (all atomics done: counts final) signals done first, then
  // writes recv_count, recv_src = -1 past each count, zeroes the counters, then waits.
  end_barrier(ps, epoch, p.timeout_ns, "ll_dispatch: end", [&]() {
    if (threadIdx.x == 0) ps.slot[r]->work_ticket = 0;  // every block is past its tickets
    for (int l = warp; l < p.L; l += kFastWarps) {  // warp-uniform
      int cnt = 0;
      if (lane == 0) cnt = *reinterpret_cast<volatile int*>(counters + l);
      cnt = __shfl_sync(kFull, cnt, 0);
      if (lane == 0) {
        p.recv_count[l] = cnt;
        counters[l] = 0;
      }
      int32_t* rs = p.recv_src + (int64_t)l * RM;
      int64_t j = cnt;
      // scalar head up to 16-byte alignment, int4 body, scalar tail
      const int64_t head = min(RM, (j + 3) & ~int64_t{3});
      const bool vec_ok = (reinterpret_cast<uintptr_t>(p.recv_src) & 15) == 0 && (RM & 3) == 0;
      if (vec_ok) {
        if (j + lane < head) rs[j + lane] = -1;
        j = head;
        int4* rs4 = reinterpret_cast<int4*>(rs + j);
        const int64_t n4 = (RM - j) >> 2;
        for (int64_t v = lane; v < n4; v += 32) rs4[v] = make_int4(-1, -1, -1, -1);
        j += n4 * 4;
      }
      for (int64_t jj = j + lane; jj < RM; jj += 32) rs[jj] = -1;
    }
  }, 20);
}

// ---------------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------------

// Block (t, c): token t, column vectors [c*chunk, (c+1)*chunk) of H / EPV.
template <int EPV>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const __grid_constant__ CombineParams p, int blocks_per_token, int chunk) {
  using V = typename VecOf<EPV * 2>::type;
  extern __shared__ __align__(16) unsigned char smem[];  // K row pointers, then K weights
  const uint8_t** s_row = reinterpret_cast<const uint8_t**>(smem);
  float* s_w = reinterpret_cast<float*>(smem + sizeof(void*) * p.K);
  __shared__ const uint8_t* s_y[kMaxRanks];
  __shared__ const int32_t* s_s2r[kMaxRanks];
  const PeerSlots& ps = p.ps;
  const int R = ps.num_ranks, r = ps.rank;
  const unsigned long long epoch = call_epoch(ps);
  trace_mark(ps, 24);

  const int t = blockIdx.x / blocks_per_token;
  const int c = blockIdx.x - t * blocks_per_token;
  // Own operands first (no dependence on the peers): their loads overlap the wait below.
  int v_pre = -1;
  float w_pre = 0.f;
  if (t < p.T && (int)threadIdx.x < p.K) {
    v_pre = __ldg(p.topk_idx + (int64_t)t * p.K + threadIdx.x);
    w_pre = __ldg(p.topk_weights + (int64_t)t * p.K + threadIdx.x);
  }
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    if (blockIdx.x < kPushBlocks && lane < R) {  // lane s pushes to rank s
      const void* mine[2] = {p.y, static_cast<const void*>(p.src_to_row)};
      push_publish_lane(ps, lane, mine, 2, epoch);
    }
    if (lane < R) {  // lane s waits (local poll) for rank s's addresses
      push_wait_ready(ps, lane, epoch, p.timeout_ns, "ll_combine: wait for peers");
      s_y[lane] = pushed_ptr<const uint8_t>(ps, lane, 0);
      s_s2r[lane] = pushed_ptr<const int32_t>(ps, lane, 1);
    }
  }
  __syncthreads();
  trace_mark(ps, 25);

  if (t < p.T) {  // block-uniform
    const int64_t RM = (int64_t)R * p.M;
    const int64_t row_bytes = 2LL * p.H;
    // Resolve each slot's source row once per block: src_to_row of rank q (peer read), all K
    // slots in parallel (one thread each).
    for (int k = threadIdx.x; k < p.K; k += blockDim.x) {
      const int v = k == (int)threadIdx.x ? v_pre : __ldg(p.topk_idx + (int64_t)t * p.K + k);
      const uint8_t* rp = nullptr;
      float w = 0.f;
      if (v >= 0 && v < p.E) {
        const int q = v / p.L, l = v - q * p.L;
        const int row = __ldcg(s_s2r[q] + ((int64_t)r * p.M + t) * p.L + l);
        if (row >= 0 && row < RM) {
          rp = s_y[q] + ((int64_t)l * RM + row) * row_bytes;
          w = k == (int)threadIdx.x ? w_pre : __ldg(p.topk_weights + (int64_t)t * p.K + k);
        }
      }
      s_row[k] = rp;
      s_w[k] = w;
    }
    __syncthreads();
    const int nvec = p.H / EPV;
    const int v0 = c * chunk;
    const int v1 = min(v0 + chunk, nvec);
    float acc[kCombineVpt][EPV];
#pragma unroll
    for (int i = 0; i < kCombineVpt; ++i)
#pragma unroll
      for (int e = 0; e < EPV; ++e) acc[i][e] = 0.f;
    for (int k0 = 0; k0 < p.K; k0 += kCombineKb) {
      V buf[kCombineVpt][kCombineKb] = {};
#pragma unroll
      for (int kk = 0; kk < kCombineKb; ++kk) {  // all loads first: K x Vpt in flight
        const uint8_t* rp = k0 + kk < p.K ? s_row[k0 + kk] : nullptr;
#pragma unroll
        for (int i = 0; i < kCombineVpt; ++i) {
          const int v = v0 + threadIdx.x + i * kCombineThreads;
          if (rp != nullptr && v < v1) buf[i][kk] = __ldcg(reinterpret_cast<const V*>(rp) + v);
        }
      }
#pragma unroll
      for (int kk = 0; kk < kCombineKb; ++kk) {  // then accumulate in k order
        const uint8_t* rp = k0 + kk < p.K ? s_row[k0 + kk] : nullptr;
        if (rp == nullptr) continue;
        const float w = s_w[k0 + kk];
#pragma unroll
        for (int i = 0; i < kCombineVpt; ++i) {
          float f[EPV];
          unpack(buf[i][kk], f);
#pragma unroll
          for (int e = 0; e < EPV; ++e) acc[i][e] = __fadd_rn(acc[i][e], __fmul_rn(w, f[e]));
        }
      }
    }
    V* out = reinterpret_cast<V*>(static_cast<uint8_t*>(p.out) + (int64_t)t * row_bytes);
#pragma unroll
    for (int i = 0; i < kCombineVpt; ++i) {
      const int v = v0 + threadIdx.x + i * kCombineThreads;
      if (v < v1) pack(acc[i], out + v);
    }
  }
  trace_mark(ps, 26);
  end_barrier(ps, epoch, p.timeout_ns, "ll_combine: end", []() {}, 27);
}

constexpr int kMaxDevices = 256;
std::atomic<int> g_dispatch_ctas[kMaxDevices];  // co-resident dispatch CTAs per device (0: unknown)

}  // namespace

int dispatch_grid(int device, int K) {
  (void)K;
  int cap = (device >= 0 && device < kMaxDevices) ? g_dispatch_ctas[device].load() : 0;
  if (cap == 0) {
    int sms = 0, occ = 0, occ_fast = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, dispatch_kernel, kDispatchThreads,
                                                      kMaxLocalExperts * sizeof(int)) !=
        cudaSuccess)
      return 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &occ_fast, dispatch_fast_kernel<uint4>, kFastDispatchThreads, 0) != cudaSuccess)
      return 0;
    if (occ < 1 || occ_fast < 1) return 0;
    // One CTA per SM on half the SMs. Co-residency is not required (quantisation is ticketed),
    // but a grid holding every SM while it spins on its peers would starve other kernels that
    // XLA runs beside it (a NCCL collective on another stream) and that the peers may wait on.
    cap = sms / 2 > 0 ? sms / 2 : 1;
    if (device >= 0 && device < kMaxDevices) g_dispatch_ctas[device].store(cap);
  }
  return cap;
}

cudaError_t launch_dispatch(const DispatchParams& p, int grid, cudaStream_t stream) {
  if (p.K > kFastMaxK) {  // generic kernel: one warp per item, grid barriers
    dispatch_kernel<<<grid, kDispatchThreads, p.L * sizeof(int), stream>>>(p);
    return cudaGetLastError();
  }
  const int64_t row_bytes = p.use_fp8 ? (int64_t)p.H : 2LL * p.H;
  int vw = 16;  // widest vector dividing the row size and the output base
  while (vw > 2 && ((row_bytes | (int64_t)reinterpret_cast<uintptr_t>(p.recv_x)) & (vw - 1)))
    vw >>= 1;
  switch (vw) {
    case 16: dispatch_fast_kernel<uint4><<<grid, kFastDispatchThreads, 0, stream>>>(p); break;
    case 8: dispatch_fast_kernel<uint2><<<grid, kFastDispatchThreads, 0, stream>>>(p); break;
    case 4: dispatch_fast_kernel<unsigned int><<<grid, kFastDispatchThreads, 0, stream>>>(p); break;
    default: dispatch_fast_kernel<unsigned short><<<grid, kFastDispatchThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream) {
  const int epv = (p.H % 8 == 0) ? 8 : (p.H % 4 == 0) ? 4 : (p.H % 2 == 0) ? 2 : 1;
  const int nvec = p.H / epv;
  const int cap = kCombineThreads * kCombineVpt;
  const int bpt = nvec > cap ? (nvec + cap - 1) / cap : 1;
  const int chunk = (nvec + bpt - 1) / bpt;
  const int64_t blocks = (int64_t)p.T * bpt;
  const int grid = blocks > 0 ? static_cast<int>(blocks) : 1;  // every rank joins the protocol
  const size_t smem = (size_t)p.K * (sizeof(void*) + sizeof(float));
  switch (epv) {
    case 8: combine_kernel<8><<<grid, kCombineThreads, smem, stream>>>(p, bpt, chunk); break;
    case 4: combine_kernel<4><<<grid, kCombineThreads, smem, stream>>>(p, bpt, chunk); break;
    case 2: combine_kernel<2><<<grid, kCombineThreads, smem, stream>>>(p, bpt, chunk); break;
    default: combine_kernel<1><<<grid, kCombineThreads, smem, stream>>>(p, bpt, chunk);
  }
  return cudaGetLastError();
}

}  // namespace ll
}  // namespace jax_ep
