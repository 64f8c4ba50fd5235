// High-throughput combine over peer memory (one process, pull design): each rank reads its
// tokens' rows from the ranks that hold them and sums them in float32. See docs/kernels.md
// ("High-throughput kernels") and docs/ffi.md for the contract; the dispatch: dispatch.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/high_throughput.cuh"
#include "kernels/high_throughput/common.cuh"
#include "kernels/launch.cuh"
#include "transport/poison.cuh"

namespace jax_ep {
namespace ht {
namespace {

// Combine: U int4 loads per lane per source rank, kCombineRanks ranks loaded at a time (P * U
// int4 in flight per lane), with U * 16 / sizeof(T) f32 accumulators per lane. U is 3 for 16-bit
// types (4 spills at 512 threads: 64 registers of loads + 32 accumulators), 4 for f32.
template <typename T>
constexpr int combine_unroll() {
  return sizeof(T) == 4 ? 4 : 3;
}
constexpr int kCombineRanks = 4;

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
  __device__ static void add(float* acc, int4 v) { add_bf16x8(acc, v); }
  __device__ static int4 pack(const float* a) { return pack_bf16x8(a); }
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
__device__ __forceinline__ void combine(const CombineArgs& a) {
  using V = Vec<T>;
  constexpr int EPV = V::kElems;
  constexpr int U = combine_unroll<T>();
  constexpr int P = kCombineRanks;
  const PeerSlots& ps = a.ps;
  const int R = ps.num_ranks, tid = threadIdx.x, lane = tid & 31;
  const unsigned long long e = call_epoch(ps);
  __shared__ const T* s_y[kMaxRanks];
  trace_mark(ps, trace::kCombineStart);

  const void* ptrs[1] = {a.y};
  if (!publish_and_wait(ps, ptrs, 1, e, a.timeout_ns, "ht_combine: wait for peers")) return;
  trace_mark(ps, trace::kCombinePeersReady);
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
  int64_t t = static_cast<int64_t>(blockIdx.x) * warps + (tid >> 5);
  // send_rows of the warp's next token are loaded one token ahead (hides a local load).
  int my_next = (t < a.T && lane < R) ? a.send_rows[t * R + lane] : -1;
  for (; t < a.T; t += nw) {
    // Lane q holds the row of token t on rank q (-1: not sent there; also for q >= R).
    int my = my_next;
    my_next = (t + nw < a.T && lane < R) ? a.send_rows[(t + nw) * R + lane] : -1;
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
        // P = kCombineRanks ranks at a time: all their loads are in flight before
        // accumulating, and the accumulation stays in rank order q0, q0 + 1, ...
        // Not unrolled: bounds the registers to P ranks' loads (the compiler would otherwise
        // hoist every rank's loads and spill).
#pragma unroll 1
        for (int q0 = 0; q0 < R; q0 += P) {
          const int4* p[P];
          bool has[P];  // warp-uniform
          bool any = false;
#pragma unroll
          for (int i = 0; i < P; ++i) {
            const int r = __shfl_sync(kFull, my, (q0 + i) & 31);
            has[i] = q0 + i < R && r >= 0;
            p[i] = has[i] ? reinterpret_cast<const int4*>(s_y[q0 + i] + r * H) : nullptr;
            any |= has[i];
          }
          if (!any) continue;
          int4 v[P][U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const bool in = base + u * 32 < n16;
#pragma unroll
            for (int i = 0; i < P; ++i)
              if (in && has[i]) v[i][u] = ld_nc_v4(p[i] + base + u * 32);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (base + u * 32 < n16) {
#pragma unroll
              for (int i = 0; i < P; ++i)
                if (has[i]) V::add(acc[u], v[i][u]);
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
  trace_mark(ps, trace::kCombineLoopDone);
  end_barrier(ps, e, a.timeout_ns, "ht_combine: end barrier", trace::kCombineAllBlocksArrived);
}

// The combine and its result, poisoned by the last block out when a wait gave up.
struct CombineLaunch {
  CombineArgs a;
  poison::Outputs outputs;
};
template <typename T>
__global__ void __launch_bounds__(kCopyThreads, 1) combine_kernel(CombineLaunch k) {
  combine<T>(k.a);
  poison::leave(k.a.ps, k.outputs);
}
}  // namespace

template <typename V>
void launch_combine_as(const CombineArgs& a, cudaStream_t stream) {
  CombineLaunch k{a, {}};
  poison::add(k.outputs, a.out, static_cast<int64_t>(a.T) * a.H * static_cast<int64_t>(sizeof(V)));
  launch_gated(combine_kernel<V>, "high-throughput combine", a.num_blocks, kCopyThreads, 0, stream,
               k);
}

void launch_combine(const CombineArgs& a, cudaStream_t stream) {
  switch (a.dtype) {
    case DType::kF32:
      launch_combine_as<float>(a, stream);
      break;
    case DType::kBF16:
      launch_combine_as<__nv_bfloat16>(a, stream);
      break;
    case DType::kF16:
      launch_combine_as<__half>(a, stream);
      break;
  }
}

}  // namespace ht
}  // namespace jax_ep