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
      float v[8];
      fp8::bf16x8_to_float(raw[q], v);
      float amax = fp8::abs_max8(v);
#pragma unroll
      for (int o = 8; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
      float scale, inv;
      fp8::group_scale(amax, round_scale, &scale, &inv);
      if (u < units) {
        const int t = u / p.G, g = u - t * p.G;
        *reinterpret_cast<uint2*>(q_base + (int64_t)t * p.H + g * fp8::kGroup + sub * 8) =
            fp8::quantize8(v, inv);
        if (sub == 0) sc_base[(int64_t)t * p.G + g] = scale;
      }
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

  // 1. Sender side: quantise own rows once (FP8); peers pull the staging rows.
  if (p.use_fp8) {
    quantise_own_rows(p, lane, warp);
    grid_barrier(ps, ++gen, p.timeout_ns, "ll_dispatch: quantise");
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
  });
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

  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    if (lane == 0) {
      const void* mine[2] = {p.y, static_cast<const void*>(p.src_to_row)};
      publish(ps, mine, 2, epoch);
    }
    __syncwarp();
    if (lane < R) {  // lane s waits for rank s (the R remote polls run in parallel)
      wait_flag_geq(&ps.slot[lane]->ready, epoch, p.timeout_ns, r, lane,
                    "ll_combine: wait for peers");
      s_y[lane] = peer_ptr<const uint8_t>(ps, lane, 0);
      s_s2r[lane] = peer_ptr<const int32_t>(ps, lane, 1);
    }
  }
  __syncthreads();

  const int t = blockIdx.x / blocks_per_token;
  const int c = blockIdx.x - t * blocks_per_token;
  if (t < p.T) {  // block-uniform
    const int64_t RM = (int64_t)R * p.M;
    const int64_t row_bytes = 2LL * p.H;
    // Resolve each slot's source row once per block: src_to_row of rank q (peer read).
    for (int k = threadIdx.x; k < p.K; k += blockDim.x) {
      const int v = p.topk_idx[(int64_t)t * p.K + k];
      const uint8_t* rp = nullptr;
      float w = 0.f;
      if (v >= 0 && v < p.E) {
        const int q = v / p.L, l = v - q * p.L;
        const int row = __ldcg(s_s2r[q] + ((int64_t)r * p.M + t) * p.L + l);
        if (row >= 0 && row < RM) {
          rp = s_y[q] + ((int64_t)l * RM + row) * row_bytes;
          w = p.topk_weights[(int64_t)t * p.K + k];
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
  end_barrier(ps, epoch, p.timeout_ns, "ll_combine: end");
}

constexpr int kMaxDevices = 256;
std::atomic<int> g_dispatch_ctas[kMaxDevices];  // co-resident dispatch CTAs per device (0: unknown)

}  // namespace

int dispatch_grid(int device, int64_t num_blocks) {
  int cap = (device >= 0 && device < kMaxDevices) ? g_dispatch_ctas[device].load() : 0;
  if (cap == 0) {
    int sms = 0, occ = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, dispatch_kernel, kDispatchThreads,
                                                      kMaxLocalExperts * sizeof(int)) !=
        cudaSuccess)
      return 0;
    if (occ < 1) return 0;
    cap = sms;  // one CTA per SM (co-residency for the in-kernel grid barrier)
    if (device >= 0 && device < kMaxDevices) g_dispatch_ctas[device].store(cap);
  }
  if (num_blocks < 1) return cap;
  return static_cast<int>(num_blocks < cap ? num_blocks : cap);
}

cudaError_t launch_dispatch(const DispatchParams& p, int grid, cudaStream_t stream) {
  dispatch_kernel<<<grid, kDispatchThreads, p.L * sizeof(int), stream>>>(p);
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
