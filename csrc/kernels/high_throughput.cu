// High-throughput dispatch / gather / combine over peer memory (one process, pull design).
// Every op: publish own operand addresses -> wait until every peer published (same epoch) ->
// read peers' buffers through peer pointers, write own results only -> end_barrier.
// See docs/kernels.md ("High-throughput kernels") and docs/ffi.md for the contract.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/high_throughput.cuh"
#include "kernels/expert_ids.cuh"

namespace jax_ep {
namespace ht {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kCopyUnroll = 8;     // int4 loads in flight per lane (row copy)
// Combine: int4 loads per lane per source rank; two ranks are loaded at a time (2 * U int4 =
// 128 bytes in flight per lane), with U * 16 / sizeof(T) f32 accumulators per lane.
constexpr int kCombineUnroll = 4;

// Read-only loads of peer XLA operands (never written while an op runs).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
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
// of warp 0 wait for all peers' ready flags in parallel (one lane per peer).
__device__ __forceinline__ void publish_and_wait(const PeerSlots& ps, const void* const* ptrs,
                                                 int n, unsigned long long e, int64_t timeout_ns,
                                                 const char* phase) {
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) publish(ps, ptrs, n, e);
    __syncwarp();
    if (static_cast<int>(threadIdx.x) < ps.num_ranks)
      wait_flag_geq(&ps.slot[threadIdx.x]->ready, e, timeout_ns, ps.rank, threadIdx.x, phase);
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------
// Dispatch, kernel 1: layout. grid = R blocks (co-resident; one grid barrier), block s handles
// source rank s. Scratch: mask[R][T] (bit q: token goes to rank q), cnt[R][R].
// ------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kLayoutThreads, 1) dispatch_layout_kernel(DispatchArgs a) {
  const PeerSlots& ps = a.ps;
  const int R = ps.num_ranks, me = ps.rank, s = blockIdx.x;
  const int T = a.T, K = a.K, E = a.E, L = a.L, C = a.C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const unsigned long long e = call_epoch(ps);

  __shared__ int s_cnt[kMaxRanks];
  __shared__ int s_invalid;
  __shared__ int s_all[kMaxRanks * kMaxRanks];
  __shared__ int s_wtot[kMaxRanks][32];
  __shared__ int s_wpre[kMaxRanks][32];
  __shared__ int s_ctot[kMaxRanks];
  __shared__ int s_tpe[kMaxLocalExperts];
  __shared__ const int32_t* s_idx;
  __shared__ const float* s_w;

  const bool tpe_smem = L <= kMaxLocalExperts;
  if (tid < kMaxRanks) s_cnt[tid] = 0;
  if (tid == 0) s_invalid = 0;
  if (tpe_smem)
    for (int l = tid; l < L; l += blockDim.x) s_tpe[l] = 0;
  // Zeroed before the grid barrier; every block adds to it after.
  if (blockIdx.x == 0)
    for (int l = tid; l < L; l += blockDim.x) a.recv_tokens_per_expert[l] = 0;

  const void* ptrs[kNumDispatchPtrs] = {a.x, a.x_scales, a.topk_idx, a.topk_weights};
  publish_and_wait(ps, ptrs, kNumDispatchPtrs, e, a.timeout_ns, "ht_dispatch: wait for peers");
  if (tid == 0) {
    s_idx = peer_ptr<const int32_t>(ps, s, kPtrTopkIdx);
    s_w = peer_ptr<const float>(ps, s, kPtrTopkWeights);
  }
  __syncthreads();
  const int32_t* idx_s = s_idx;
  const float* w_s = s_w;

  uint32_t* mask_s = reinterpret_cast<uint32_t*>(a.scratch) + static_cast<int64_t>(s) * T;
  int32_t* cnt = a.scratch + static_cast<int64_t>(R) * T;  // cnt[s][q]

  // Phase 1: destination mask of every token of s, counts per destination, invalid ids.
  int lc[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) lc[q] = 0;
  int inv = 0;
  for (int t = tid; t < T; t += blockDim.x) {
    const int32_t* row = idx_s + static_cast<int64_t>(t) * K;
    uint32_t m = 0;
    for (int k = 0; k < K; ++k) {
      const int raw = ld_nc_s32(row + k);
      if (expert_id_invalid(raw, E)) ++inv;
      else if (raw >= 0) m |= 1u << (raw / L);
    }
    mask_s[t] = m;  // read back in phase 2 by this same thread (same t -> tid mapping)
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) lc[q] += (m >> q) & 1u;
  }
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    const int v = warp_sum(lc[q]);
    if (lane == 0 && v != 0) atomicAdd(&s_cnt[q], v);
  }
  inv = warp_sum(inv);
  if (lane == 0 && inv != 0) atomicAdd(&s_invalid, inv);
  __syncthreads();
  if (tid < R) cnt[s * R + tid] = s_cnt[tid];
  grid_barrier(ps, 1, a.timeout_ns, "ht_dispatch: layout grid barrier");

  // Phase 2: offsets, then rows by a chunked block scan of the masks (ballot + popc per rank).
  if (tid < R * R) s_all[tid] = __ldcg(cnt + tid);
  __syncthreads();
  int off[kMaxRanks], running[kMaxRanks];
  int total_me = 0;
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) off[q] = running[q] = 0;
  for (int s2 = 0; s2 < R; ++s2) {
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q)
      if (q < R && s2 < s) off[q] += s_all[s2 * R + q];
    total_me += s_all[s2 * R + me];
  }
  const int recv_count = min(total_me, C);
  const unsigned lanes_below = (1u << lane) - 1u;
  int32_t* tpe_counter = tpe_smem ? s_tpe : a.recv_tokens_per_expert;

  for (int base = 0; base < T; base += blockDim.x) {
    const int t = base + tid;
    const uint32_t m = t < T ? mask_s[t] : 0u;
    int pre[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      const unsigned b = __ballot_sync(kFull, (m >> q) & 1u);
      pre[q] = __popc(b & lanes_below);
      if (lane == 0) s_wtot[q][warp] = __popc(b);
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        const int v = lane < nwarps ? s_wtot[q][lane] : 0;
        int incl = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int n = __shfl_up_sync(kFull, incl, o);
          if (lane >= o) incl += n;
        }
        s_wpre[q][lane] = incl - v;
        if (lane == 31) s_ctot[q] = incl;
      }
    }
    __syncthreads();
    int row[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      row[q] = off[q] + running[q] + s_wpre[q][warp] + pre[q];
      running[q] += s_ctot[q];
    }
    if (t < T) {
      int j = -1;
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q)
        if (q == me && ((m >> q) & 1u)) j = row[q];
      if (j >= 0 && j < C) {
        // Row j of this rank receives token t of source s.
        a.recv_src[j] = s * T + t;
        const int32_t* irow = idx_s + static_cast<int64_t>(t) * K;
        const float* wrow = w_s + static_cast<int64_t>(t) * K;
        int32_t* out_idx = a.recv_topk_idx + static_cast<int64_t>(j) * K;
        float* out_w = a.recv_topk_weights + static_cast<int64_t>(j) * K;
        for (int k = 0; k < K; ++k) {
          const int v = sanitize_expert_id(ld_nc_s32(irow + k), E);
          if (v >= 0 && v / L == me) {
            const int l = v - me * L;
            out_idx[k] = l;
            out_w[k] = ld_nc_f32(wrow + k);
            bool dup = false;
            for (int k2 = 0; k2 < k; ++k2) dup |= sanitize_expert_id(ld_nc_s32(irow + k2), E) == v;
            if (!dup) atomicAdd(&tpe_counter[l], 1);
          } else {
            out_idx[k] = -1;
            out_w[k] = 0.f;
          }
        }
      }
      if (s == me) {
        int32_t* sr = a.send_rows + static_cast<int64_t>(t) * R;
#pragma unroll
        for (int q = 0; q < kMaxRanks; ++q)
          if (q < R) sr[q] = (((m >> q) & 1u) && row[q] < C) ? row[q] : -1;
      }
    }
    __syncthreads();  // s_wtot / s_wpre / s_ctot are rewritten by the next chunk
  }

  // Padding rows [recv_count, C), shared by all blocks.
  for (int64_t j = recv_count + static_cast<int64_t>(blockIdx.x) * blockDim.x + tid; j < C;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    a.recv_src[j] = -1;
    for (int k = 0; k < K; ++k) {
      a.recv_topk_idx[j * K + k] = -1;
      a.recv_topk_weights[j * K + k] = 0.f;
    }
  }
  if (s == me && tid == 0) {
    a.stats[0] = recv_count;
    a.stats[1] = total_me - recv_count;
    a.stats[2] = s_invalid;
    a.stats[3] = 0;
  }
  __syncthreads();
  if (tpe_smem)
    for (int l = tid; l < L; l += blockDim.x)
      if (s_tpe[l] != 0) atomicAdd(&a.recv_tokens_per_expert[l], s_tpe[l]);
}

// ------------------------------------------------------------------------------------------
// Row copy (dispatch kernel 2, and gather): one warp per destination row, grid-stride.
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ void copy_row(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src,
                                         int64_t nbytes, bool vec, int lane) {
  if (vec) {
    const int64_t n = nbytes >> 4;
    int4* d = reinterpret_cast<int4*>(dst);
    const int4* p = reinterpret_cast<const int4*>(src);
    for (int64_t base = lane; base < n; base += 32 * kCopyUnroll) {
      int4 v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u)
        if (base + u * 32 < n) v[u] = ld_nc_v4(p + base + u * 32);
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u)
        if (base + u * 32 < n) d[base + u * 32] = v[u];
    }
  } else {
    for (int64_t i = lane; i < nbytes; i += 32) dst[i] = __ldg(src + i);
  }
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

struct CopyArgs {
  PeerSlots ps;
  int64_t timeout_ns;
  const uint8_t* own_x;  // gather: published here (dispatch: published by the layout kernel)
  const int32_t* recv_src;
  const int32_t* stats;
  int T, C, G;
  int64_t Hb;
  uint8_t* recv_x;
  float* recv_scales;
};

template <bool kGather>
__global__ void __launch_bounds__(kCopyThreads) copy_rows_kernel(CopyArgs a) {
  const PeerSlots& ps = a.ps;
  const int R = ps.num_ranks, tid = threadIdx.x, lane = tid & 31;
  const unsigned long long e = call_epoch(ps);
  __shared__ const uint8_t* s_x[kMaxRanks];
  __shared__ const float* s_sc[kMaxRanks];

  if (kGather) {
    const void* ptrs[1] = {a.own_x};
    publish_and_wait(ps, ptrs, 1, e, a.timeout_ns, "ht_gather: wait for peers");
  } else if (blockIdx.x == 0 && tid == 0) {
    // Every block of the layout kernel has exited (stream order): its grid barrier is done.
    grid_barrier_reset(ps);
  }
  // Peer addresses are remote loads: fetch them once per block, in parallel.
  if (tid < R) {
    s_x[tid] = peer_ptr<const uint8_t>(ps, tid, kPtrX);
    s_sc[tid] = kGather ? nullptr : peer_ptr<const float>(ps, tid, kPtrScales);
  }
  __syncthreads();
  bool vec = (a.Hb % 16 == 0) && aligned16(a.recv_x);
  for (int s = 0; s < R; ++s) vec = vec && aligned16(s_x[s]);

  const int T = a.T, C = a.C, G = a.G;
  const int64_t Hb = a.Hb;
  const int recv_count = min(max(a.stats[0], 0), C);
  const int warps = blockDim.x >> 5;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * warps;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * warps + (tid >> 5); j < C; j += nw) {
    int s = -1;
    int64_t t = 0;
    if (j < recv_count) {
      const int src = a.recv_src[j];
      if (src >= 0 && T > 0 && src / T < R) {
        s = src / T;
        t = src % T;
      }
    }
    uint8_t* dst = a.recv_x + j * Hb;
    if (s >= 0) copy_row(dst, s_x[s] + t * Hb, Hb, vec, lane);
    else zero_row(dst, Hb, vec, lane);
    if (!kGather && G > 0) {
      float* d = a.recv_scales + j * G;
      for (int g = lane; g < G; g += 32) d[g] = s >= 0 ? ld_nc_f32(s_sc[s] + t * G + g) : 0.f;
    }
  }
  end_barrier(ps, e, a.timeout_ns, kGather ? "ht_gather: end barrier" : "ht_dispatch: end barrier");
}

// ------------------------------------------------------------------------------------------
// Combine: one warp per token, f32 accumulation over ranks q = 0..R-1 in order.
// ------------------------------------------------------------------------------------------
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kElems = 4;
  __device__ static void add(float* acc, int4 v) {
    acc[0] += __int_as_float(v.x);
    acc[1] += __int_as_float(v.y);
    acc[2] += __int_as_float(v.z);
    acc[3] += __int_as_float(v.w);
  }
  __device__ static int4 pack(const float* a) {
    return make_int4(__float_as_int(a[0]), __float_as_int(a[1]), __float_as_int(a[2]),
                     __float_as_int(a[3]));
  }
  __device__ static float to_f32(float v) { return v; }
  __device__ static float from_f32(float v) { return v; }
};
template <>
struct Vec<__nv_bfloat16> {
  static constexpr int kElems = 8;
  __device__ static void add(float* acc, int4 v) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static int4 pack(const float* a) {
    int4 r;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);
    return r;
  }
  __device__ static float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_f32(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Vec<__half> {
  static constexpr int kElems = 8;
  __device__ static void add(float* acc, int4 v) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static int4 pack(const float* a) {
    int4 r;
    __half2* h = reinterpret_cast<__half2*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(a[2 * i], a[2 * i + 1]);
    return r;
  }
  __device__ static float to_f32(__half v) { return __half2float(v); }
  __device__ static __half from_f32(float v) { return __float2half_rn(v); }
};

template <typename T>
__global__ void __launch_bounds__(kCopyThreads, 1) combine_kernel(CombineArgs a) {
  using V = Vec<T>;
  constexpr int EPV = V::kElems;
  constexpr int U = kCombineUnroll;
  const PeerSlots& ps = a.ps;
  const int R = ps.num_ranks, tid = threadIdx.x, lane = tid & 31;
  const unsigned long long e = call_epoch(ps);
  __shared__ const T* s_y[kMaxRanks];

  const void* ptrs[1] = {a.y};
  publish_and_wait(ps, ptrs, 1, e, a.timeout_ns, "ht_combine: wait for peers");
  if (tid < R) s_y[tid] = peer_ptr<const T>(ps, tid, 0);
  __syncthreads();

  const int64_t H = a.H;
  const int C = a.C;
  T* out = static_cast<T*>(a.out);
  bool vec = ((H * static_cast<int64_t>(sizeof(T))) % 16 == 0) && aligned16(out);
  for (int s = 0; s < R; ++s) vec = vec && aligned16(s_y[s]);
  const int64_t n16 = (H * static_cast<int64_t>(sizeof(T))) >> 4;

  const int warps = blockDim.x >> 5;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * warps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + (tid >> 5); t < a.T; t += nw) {
    // Lane q holds the row of token t on rank q (-1: not sent there; also for q >= R).
    int my = lane < R ? a.send_rows[t * R + lane] : -1;
    if (my >= C || my < 0) my = -1;
    T* dst = out + t * H;
    if (vec) {
      int4* d = reinterpret_cast<int4*>(dst);
      // The chunk loop is warp-uniform (lanes past the row end are predicated off), because
      // the rank loop inside it uses __shfl_sync over the full warp.
      for (int64_t chunk = 0; chunk < n16; chunk += 32 * U) {
        const int64_t base = chunk + lane;
        float acc[U][EPV];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int i = 0; i < EPV; ++i) acc[u][i] = 0.f;
        // Ranks two at a time: both ranks' loads are in flight before accumulating, and the
        // accumulation stays in rank order q, q+1.
        // Not unrolled: bounds the registers to 2 ranks' loads (the compiler would otherwise
        // hoist every rank's loads and spill).
#pragma unroll 1
        for (int q = 0; q < R; q += 2) {
          const int r0 = __shfl_sync(kFull, my, q), r1 = __shfl_sync(kFull, my, q + 1);
          const bool has0 = r0 >= 0, has1 = r1 >= 0;  // warp-uniform
          if (!has0 && !has1) continue;
          const int4* p0 = has0 ? reinterpret_cast<const int4*>(s_y[q] + r0 * H) : nullptr;
          const int4* p1 = has1 ? reinterpret_cast<const int4*>(s_y[q + 1] + r1 * H) : nullptr;
          int4 v0[U], v1[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const bool in = base + u * 32 < n16;
            if (in && has0) v0[u] = ld_nc_v4(p0 + base + u * 32);
            if (in && has1) v1[u] = ld_nc_v4(p1 + base + u * 32);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (base + u * 32 < n16) {
              if (has0) V::add(acc[u], v0[u]);
              if (has1) V::add(acc[u], v1[u]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (base + u * 32 < n16) d[base + u * 32] = V::pack(acc[u]);
      }
    } else {
      for (int64_t i0 = 0; i0 < H; i0 += 32) {  // warp-uniform loop (shuffles inside)
        const int64_t i = i0 + lane;
        float acc = 0.f;
        for (int q = 0; q < R; ++q) {
          const int rq = __shfl_sync(kFull, my, q);
          if (rq >= 0 && i < H) acc += V::to_f32(s_y[q][rq * H + i]);
        }
        if (i < H) dst[i] = V::from_f32(acc);
      }
    }
  }
  end_barrier(ps, e, a.timeout_ns, "ht_combine: end barrier");
}

}  // namespace

void launch_dispatch(const DispatchArgs& a, cudaStream_t stream) {
  dispatch_layout_kernel<<<a.ps.num_ranks, kLayoutThreads, 0, stream>>>(a);
  CopyArgs c{a.ps, a.timeout_ns, a.x, a.recv_src, a.stats, a.T, a.C, a.G, a.Hb, a.recv_x,
             a.recv_scales};
  copy_rows_kernel<false><<<a.num_blocks, kCopyThreads, 0, stream>>>(c);
}

void launch_gather(const GatherArgs& a, cudaStream_t stream) {
  CopyArgs c{a.ps, a.timeout_ns, a.x, a.recv_src, a.stats, a.T, a.C, 0, a.Hb, a.recv_x, nullptr};
  copy_rows_kernel<true><<<a.num_blocks, kCopyThreads, 0, stream>>>(c);
}

void launch_combine(const CombineArgs& a, cudaStream_t stream) {
  switch (a.dtype) {
    case DType::kF32:
      combine_kernel<float><<<a.num_blocks, kCopyThreads, 0, stream>>>(a);
      break;
    case DType::kBF16:
      combine_kernel<__nv_bfloat16><<<a.num_blocks, kCopyThreads, 0, stream>>>(a);
      break;
    case DType::kF16:
      combine_kernel<__half><<<a.num_blocks, kCopyThreads, 0, stream>>>(a);
      break;
  }
}

}  // namespace ht
}  // namespace jax_ep
