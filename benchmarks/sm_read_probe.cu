// sm_read_probe.cu: how fast a few SMs read scattered rows from HBM, per method.
//
// What it measures: `blocks` reader blocks (one per SM), each of `warps` warps, read rows of
// 2 KiB at pseudo-random places of a buffer larger than L2, in the shape of the fused GEMM +
// combine's summing tasks (docs/kernels.md#fused-combine-blocks-r1): a task is 4 tokens of 8
// rows; every value read is summed in float32 so no load is dead. The other SMs either idle or
// (--busy 1) stream a copy of another buffer through HBM, or (--busy 2, 3) load 32 KiB blocks
// of an L2-resident window into shared memory with TMA, as a GEMM's operands (128 or 192 KiB in
// flight per SM; their rate is reported), or (--busy 4) keep the tensor cores busy (mma.sync),
// or (5) both, busy 3's loads in 6 warps and the MMAs in 6, or (6) as a GEMM's tiles also
// store: busy 2's loads in 4 warps, TMA stores over 1 GiB in 2, the MMAs in 6, or (7) the same
// with the stores over the rows the task modes read; for as long as the readers run.
// Reported: the median reader block's GB/s (bytes it read / its own time, globaltimer), all
// readers', and the median reader's SM clock (clock64 over the same span). Methods:
//   ld          per lane 2 loads of 16 bytes per row, 8 rows in flight (the combine's shape)
//   ld_wide     per lane 4 loads per row, a token's 8 rows in flight (twice ld's)
//   ld_rows4    per lane 4 loads per row, 4 rows in flight (ld's bytes, whole rows)
//   ld_acq      ld, and before each task 32 acquire loads (ld.acquire.gpu) of a flag word,
//               as the combine's waits issue them
//   task        the combine's own first step at R = 1 (gemm_combine.cu reduce_task's sum): per
//               token its row, per pass its slots and weights (dependent loads), 8 rows x 2
//               loads per lane in flight, weighted float32 sum, a bfloat16 store; over a
//               [32768, 7168] ye, columns [0, 1024)
//   task_light  task with ld's light sum (add8) instead of the weighting
//   task_pre    task with the 32 (row, slot) entries loaded once per task, one per lane
//   task_nostore  task without the stores (the sums go to a register sink)
//   task_n1024  task over rows of 1024 values (the chunk is the whole row: ye contiguous)
//   task_reg2   task with its entries loaded once, rows in passes of one vector per lane, the
//               next pass's rows loaded before this one is summed
//   task_tma    task with its entries loaded once, each pass's 8 rows (1 KiB each) copied into
//               shared memory by TMA, two 8 KiB stages per warp
//   tma_S       lane 0 loads a token's 8 rows into shared memory with cp.async.bulk (16 KiB a
//               stage, mbarrier completion), S stages per warp; the warp sums from shared memory
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -DJAX_EP_MUTATION=0 -o /tmp/sm_read_probe \
//            benchmarks/sm_read_probe.cu
// Run:   /tmp/sm_read_probe [--blocks 1,4,8,16] [--warps 12] [--tasks 10] [--busy 0,1,2,3,4,5,6,7]
//            [--modes ld,ld_acq,tma_1,tma_2] [--reps 5] [--json out.json]
// (the task modes: at most 32 blocks of 32 warps, 40 tasks each)
// Every wait is bounded: a probe that hangs traps. What it showed:
// docs/notes.md#rejected-combine-tma-stage.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// The kernels' own loads, stores and timer (ld.global.cg / .nc, the bfloat16 packing, the
// acquire the combine's waits issue, %globaltimer).
#include "kernels/high_throughput/common.cuh"
using jax_ep::global_timer_ns;
using jax_ep::ld_acquire_gpu;
using jax_ep::ht::ld_cg_v4;
using jax_ep::ht::ld_nc_f32;
using jax_ep::ht::ld_nc_s32;
using jax_ep::ht::pack_bf16x8;

#define CK(call)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(2);                                                                              \
    }                                                                                       \
  } while (0)

constexpr int kRowBytes = 2048;  // a row's chunk of columns
constexpr int kRowsPerToken = 8;
constexpr int kTokensPerTask = 4;
constexpr int kStageBytes = kRowBytes * kRowsPerToken;
constexpr long long kYeRows = 32768, kYeCols = 7168;  // the task modes' ye, bfloat16

struct Args {
  const int4* src;
  long long rows;  // 2 KiB rows in src, a power of two
  int* flag;       // the acquire loads' word
  int4* bg_src;    // the busy blocks' copy
  int4* bg_dst;
  long long bg_vectors;
  int readers;
  int tasks;  // per warp
  int kind;   // Kind
  int stages;
  int busy;   // 0 idle, 1 HBM copy, 2 (3) TMA loads from L2, 128 (192) KiB in flight per SM;
              // 4 MMAs, 5 MMAs + busy 3's loads, 6 MMAs + loads + TMA stores, 7 the
              // stores over the task modes' ye
  int* done;  // readers finished
  unsigned long long* bg_bytes;  // busy 2, 3: bytes the busy blocks loaded
  unsigned long long* t;         // per reader block: start, end
  long long* clk;                // per reader block: SM clocks from its start to its end
  float* sink;
  // task modes: the combine's own shape over ye [C, N] bfloat16 (columns [0, 1024) of each row)
  const int* send_rows;  // [tokens]: a token's received row (here: the token itself)
  const int* row_of;     // [tokens, 8]: its slots' rows of ye
  const float* weights;  // [tokens, 8]
  const unsigned char* ye;
  unsigned char* out;  // [tokens, N]
  long long N;
  int light;  // kTask: 1 add8 instead of the weighting, 2 no stores (task_light, task_nostore)
  bool pre;   // kTask: the task's entries loaded once (task_pre)
};

// How a reader warp reads (the methods of the header; tma_S: kTma with S stages).
enum Kind { kLd, kLdAcq, kTma, kLdWide, kLdRows4, kTask, kTaskReg2, kTaskTma };
struct Method {
  const char* name;
  Kind kind;
  int light = 0;
  bool pre = false;
  long long N = kYeCols;  // task modes: ye's row length
};
const Method kMethods[] = {
    {"ld", kLd},
    {"ld_acq", kLdAcq},
    {"ld_wide", kLdWide},
    {"ld_rows4", kLdRows4},
    {"task", kTask},
    {"task_light", kTask, 1},
    {"task_pre", kTask, 0, true},
    {"task_nostore", kTask, 2},
    {"task_n1024", kTask, 0, false, 1024},
    {"task_reg2", kTaskReg2},
    {"task_tma", kTaskTma},
};

__device__ __forceinline__ unsigned long long row_of(long long rows, int b, int w, int t, int r) {
  unsigned long long x = ((unsigned long long)b * 1000003ull + w) * 7919ull + t * 131ull + r;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x & (rows - 1);  // rows: a power of two
}
__device__ __forceinline__ void add8(float& acc, int4 v) {
  acc += __int_as_float(v.x & 0x7f7fffff) + __int_as_float(v.y & 0x7f7fffff) +
         __int_as_float(v.z & 0x7f7fffff) + __int_as_float(v.w & 0x7f7fffff);
}
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  for (uint32_t spins = 0;; ++spins) {
    uint32_t ok;
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(ok)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    if (ok) return;
    if (spins == (1u << 26)) __trap();
  }
}

// The weighted sum of csrc/kernels/fused/gemm_combine.cu's add_weighted (file-local there).
__device__ __forceinline__ void add_weighted(float* acc, float w, int4 v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w, f.x));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w, f.y));
  }
}
// The fused GEMM + combine's first-step sum of one task (direct, K = 8), as in
// csrc/kernels/fused/gemm_combine.cu reduce_task: per token its row, per pass of 2 x 32 vectors
// its slots and weights, 8 rows in flight, weighted sum, one store. pre: the task's 32 (row,
// slot) entries loaded once, one per lane, instead of per token and pass.
__device__ __forceinline__ float sum_task(const Args& a, long long c0, int lane, bool pre) {
  constexpr int K = 8, kGroup = 8, kUnroll = 2;
  const long long N = a.N, lo = 0, hi = 128;
  float sink = 0.f;
  int pj = -1;
  float pw = 0.f;
  if (pre) {
    const int c = ld_nc_s32(a.send_rows + c0 + lane / K);
    pj = ld_nc_s32(a.row_of + c * K + lane % K);
    pw = ld_nc_f32(a.weights + c * K + lane % K);
  }
  for (int i = 0; i < 4; ++i) {
    const long long c = pre ? c0 + i : ld_nc_s32(a.send_rows + c0 + i);
    unsigned char* dst = a.out + (c0 + i) * N * 2;
    for (long long v0 = lo; v0 < hi; v0 += 32 * kUnroll) {
      const long long i0 = v0 + lane;
      float part[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) part[u][q] = 0.f;
      int mj;
      float mw;
      if (pre) {
        mj = __shfl_sync(~0u, pj, (i * K + lane % K) & 31);
        mw = __shfl_sync(~0u, pw, (i * K + lane % K) & 31);
      } else {
        mj = lane < K ? ld_nc_s32(a.row_of + c * K + lane) : -1;
        mw = lane < K ? ld_nc_f32(a.weights + c * K + lane) : 0.f;
      }
      int j[kGroup];
      float w[kGroup];
      int4 v[kGroup][kUnroll];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        j[g] = __shfl_sync(~0u, mj, g);
        w[g] = __shfl_sync(~0u, mw, g);
        if (j[g] < 0) continue;
        const int4* src = reinterpret_cast<const int4*>(a.ye + (long long)j[g] * N * 2);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i0 + u * 32 < hi) v[g][u] = ld_cg_v4(src + i0 + u * 32);
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (j[g] < 0) continue;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i0 + u * 32 < hi) {
            if (a.light)
              add8(part[u][0], v[g][u]);
            else
              add_weighted(part[u], w[g], v[g][u]);
          }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i0 + u * 32 < hi) {
          if (a.light == 2)
            sink += part[u][0] + part[u][7];
          else
            reinterpret_cast<int4*>(dst)[i0 + u * 32] = pack_bf16x8(part[u]);
        }
    }
  }
  return sink;
}

// task_reg2: task with the entries loaded once per task and the rows in passes of one vector
// per lane and row, the next pass's 8 rows loaded before this pass is summed (two register
// buffers): 16 steps per task.
__device__ __forceinline__ void reg2_load(const Args& a, int pj, int s, int lane, int4* v) {
  constexpr int K = 8;
  const int i = s / 4, p = s % 4;
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    const int j = __shfl_sync(~0u, pj, (i * K + g) & 31);
    if (j >= 0)
      v[g] = ld_cg_v4(reinterpret_cast<const int4*>(a.ye + (long long)j * a.N * 2) + p * 32 + lane);
  }
}
__device__ __forceinline__ void reg2_sum(const Args& a, int pj, float pw, long long c0, int s,
                                         int lane, const int4* v) {
  constexpr int K = 8;
  const int i = s / 4, p = s % 4;
  float part[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) part[q] = 0.f;
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    const int j = __shfl_sync(~0u, pj, (i * K + g) & 31);
    const float w = __shfl_sync(~0u, pw, (i * K + g) & 31);
    if (j >= 0) add_weighted(part, w, v[g]);
  }
  reinterpret_cast<int4*>(a.out + (c0 + i) * a.N * 2)[p * 32 + lane] = pack_bf16x8(part);
}
__device__ __forceinline__ void sum_task_reg2(const Args& a, long long c0, int lane) {
  constexpr int K = 8;
  const int c = ld_nc_s32(a.send_rows + c0 + lane / K);
  const int pj = ld_nc_s32(a.row_of + c * K + lane % K);
  const float pw = ld_nc_f32(a.weights + c * K + lane % K);
  int4 va[8], vb[8];
  reg2_load(a, pj, 0, lane, va);
  for (int s = 0; s < 16; s += 2) {
    reg2_load(a, pj, s + 1, lane, vb);
    reg2_sum(a, pj, pw, c0, s, lane, va);
    if (s + 2 < 16) reg2_load(a, pj, s + 2, lane, va);
    reg2_sum(a, pj, pw, c0, s + 1, lane, vb);
  }
}
// task_tma: task with the entries loaded once per task and each pass's 8 rows (1 KiB each)
// brought into this warp's shared memory by TMA (lanes 0..7 one row each), two stages of 8 KiB,
// the next pass's in flight while this one is summed.
__device__ __forceinline__ void sum_task_tma(const Args& a, long long c0, int lane,
                                             unsigned char* stage, uint64_t* bars,
                                             unsigned int& uses) {
  constexpr int K = 8;
  const int c = ld_nc_s32(a.send_rows + c0 + lane / K);
  const int pj = ld_nc_s32(a.row_of + c * K + lane % K);
  const float pw = ld_nc_f32(a.weights + c * K + lane % K);
  const unsigned valid = __ballot_sync(~0u, pj >= 0);
  auto issue = [&](int s) {
    const int i = s / 2, p = s % 2, b = (uses + s) & 1;
    if (lane == 0)
      asm volatile(
          "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bars + b)),
          "r"(1024u * __popc((valid >> (i * K)) & 0xffu))
          : "memory");
    __syncwarp();
    if (lane / K == i && pj >= 0)
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(smem_addr(stage + b * 8192 + (lane % K) * 1024)),
          "l"(a.ye + (long long)pj * a.N * 2 + p * 1024), "r"(1024), "r"(smem_addr(bars + b))
          : "memory");
  };
  issue(0);
  for (int s = 0; s < 8; ++s) {
    if (s + 1 < 8) issue(s + 1);
    const int i = s / 2, p = s % 2, b = (uses + s) & 1;
    mbar_wait(bars + b, ((uses + s) >> 1) & 1);
    float part[2][8];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) part[u][q] = 0.f;
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      const float w = __shfl_sync(~0u, pw, (i * K + g) & 31);
      if (!((valid >> (i * K + g)) & 1u)) continue;
      const int4* row = reinterpret_cast<const int4*>(stage + b * 8192 + g * 1024);
#pragma unroll
      for (int u = 0; u < 2; ++u) add_weighted(part[u], w, row[u * 32 + lane]);
    }
    int4* dst = reinterpret_cast<int4*>(a.out + (c0 + i) * a.N * 2) + p * 64;
#pragma unroll
    for (int u = 0; u < 2; ++u) dst[u * 32 + lane] = pack_bf16x8(part[u]);
    __syncwarp();  // every lane's reads of this stage before its next copy
  }
  uses += 8;
}

// busy 4-6: warps that keep the tensor cores busy (mma.sync, 8 independent accumulators), until
// every reader is done.
__device__ __forceinline__ void mma_loop(const Args& a, int lane) {
  const unsigned x = 0x3c003c00u ^ (lane * 0x00010001u);  // small bfloat16 pairs, per lane
  float d[8][4] = {};
  for (int i = 0; i < (1 << 22); ++i) {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+f"(d[k][0]), "+f"(d[k][1]), "+f"(d[k][2]), "+f"(d[k][3])
          : "r"(x), "r"(x ^ 0x8000u), "r"(x), "r"(x ^ 0x80000000u), "r"(x), "r"(x ^ 0x80008000u));
    if ((i & 255) == 255 && *(volatile int*)a.done >= a.readers) break;
  }
  float t = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) t += d[k][0] + d[k][1] + d[k][2] + d[k][3];
  a.sink[blockIdx.x * blockDim.x + threadIdx.x] = t;
}
// busy 6: bulk (TMA) stores of 32 KiB from shared memory over 1 GiB, two in flight per warp
// (busy 7: over the task modes' ye, the rows the readers read, as a GEMM's tiles store the rows
// its combine then reads).
__device__ __forceinline__ void store_loop(const Args& a, int warp, int lane,
                                           const unsigned char* buf) {
  constexpr int kBytes = 32768;
  char* base = a.busy == 7 ? const_cast<char*>(reinterpret_cast<const char*>(a.ye))
                           : reinterpret_cast<char*>(a.bg_dst);
  const long long window = (a.busy == 7 ? kYeRows * kYeCols * 2 : a.bg_vectors * 16) / kBytes;
  for (int i = 0; i < (1 << 20); ++i) {
    if (lane == 0) {
      char* dst =
          base +
          (((long long)blockIdx.x * 2 + warp + (long long)i * 2 * gridDim.x) % window) * kBytes;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                   "r"(smem_addr(buf)), "r"(kBytes)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    }
    __syncwarp();
    if ((i & 15) == 15 && *(volatile int*)a.done >= a.readers) break;
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void probe(Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (blockIdx.x >= a.readers && a.busy == 4) {
    mma_loop(a, lane);
    return;
  }
  if (blockIdx.x >= a.readers && a.busy >= 5 && warp >= 6) {
    mma_loop(a, lane);
    return;
  }
  if (blockIdx.x >= a.readers && a.busy >= 6 && warp >= 4) {
    store_loop(a, warp - 4, lane, smem + 1024 + 4 * 32768);
    return;
  }
  if (blockIdx.x >= a.readers && a.busy >= 2) {
    // busy 2 (3): TMA loads of 32 KiB from a 32 MiB window (L2-resident) into shared memory, one
    // load in flight per warp of 4 (6) warps, as a GEMM's operand loads (128 or 192 KiB in
    // flight per SM), until every reader is done (busy 5: busy 3's loads; busy 6: 4 warps')
    if (warp >= (a.busy == 2 || a.busy >= 6 ? 4 : 6)) return;
    constexpr int kBytes = 32768;
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem) + warp;
    unsigned char* buf = smem + 1024 + warp * kBytes;
    if (lane == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::
                     : "memory");
    __syncwarp();
    const long long window = (32ll << 20) / kBytes;
    for (int i = 0; i < (1 << 20); ++i) {
      if (lane == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
                     "r"(kBytes)
                     : "memory");
        const char* src = reinterpret_cast<const char*>(a.bg_src) +
                          ((blockIdx.x * 4 + warp + (long long)i * 37) % window) * kBytes;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem_addr(buf)),
            "l"(src), "r"(kBytes), "r"(smem_addr(bar))
            : "memory");
      }
      mbar_wait(bar, i & 1);
      __syncwarp();
      if ((i & 15) == 15 && *(volatile int*)a.done >= a.readers) {
        if (lane == 0) atomicAdd(a.bg_bytes, (unsigned long long)(i + 1) * kBytes);
        return;
      }
    }
    return;
  }
  if (blockIdx.x >= a.readers) {  // busy 1: stream a copy until every reader is done
    const long long n = a.bg_vectors, stride = (long long)(gridDim.x - a.readers) * blockDim.x;
    for (int pass = 0; pass < 64; ++pass) {
      for (long long i = (long long)(blockIdx.x - a.readers) * blockDim.x + threadIdx.x; i < n;
           i += stride)
        a.bg_dst[i] = ld_cg_v4(a.bg_src + i);
      if (*(volatile int*)a.done >= a.readers) return;
    }
    return;
  }
  __syncthreads();
  const unsigned long long t0 = global_timer_ns(), k0 = clock64();
  float acc = 0.f;
  // the task modes: this warp's tokens
  const long long base =
      ((long long)blockIdx.x * (blockDim.x / 32) + warp) * a.tasks * kTokensPerTask;
  if (a.kind == kTaskReg2) {
    for (int t = 0; t < a.tasks; ++t) sum_task_reg2(a, base + (long long)t * kTokensPerTask, lane);
  } else if (a.kind == kTaskTma) {
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * 2;
    unsigned char* stage = smem + 1024 + (size_t)warp * 16384;
    if (lane == 0)
      for (int b = 0; b < 2; ++b)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + b)));
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::
                     : "memory");
    __syncwarp();
    unsigned int uses = 0;
    for (int t = 0; t < a.tasks; ++t)
      sum_task_tma(a, base + (long long)t * kTokensPerTask, lane, stage, bars, uses);
  } else if (a.kind == kTask) {
    for (int t = 0; t < a.tasks; ++t)
      acc += sum_task(a, base + (long long)t * kTokensPerTask, lane, a.pre);
  } else if (a.kind == kLdWide || a.kind == kLdRows4) {
    // ld_wide: a token's 8 whole rows in flight, 4 loads per lane and row; ld_rows4: 4 whole
    // rows at a time (ld's bytes in flight, whole rows)
    const int per = a.kind == kLdWide ? 8 : 4;
    for (int t = 0; t < a.tasks; ++t)
      for (int k = 0; k < kTokensPerTask; ++k)
        for (int g0 = 0; g0 < kRowsPerToken; g0 += per) {
          int4 v[kRowsPerToken][4];
#pragma unroll
          for (int g = 0; g < kRowsPerToken; ++g) {
            if (g >= per) break;
            const int4* row =
                a.src +
                row_of(a.rows, blockIdx.x, warp, t * kTokensPerTask + k, g0 + g) * (kRowBytes / 16);
#pragma unroll
            for (int u = 0; u < 4; ++u) v[g][u] = ld_cg_v4(row + 32 * u + lane);
          }
#pragma unroll
          for (int g = 0; g < kRowsPerToken; ++g) {
            if (g >= per) break;
#pragma unroll
            for (int u = 0; u < 4; ++u) add8(acc, v[g][u]);
          }
        }
  } else if (a.kind == kLd || a.kind == kLdAcq) {
    for (int t = 0; t < a.tasks; ++t) {
      if (a.kind == kLdAcq) acc += (float)ld_acquire_gpu(a.flag + lane);
      for (int k = 0; k < kTokensPerTask; ++k)
        for (int half = 0; half < 2; ++half) {
          int4 v[kRowsPerToken][2];
#pragma unroll
          for (int g = 0; g < kRowsPerToken; ++g) {
            const int4* row =
                a.src +
                row_of(a.rows, blockIdx.x, warp, t * kTokensPerTask + k, g) * (kRowBytes / 16) +
                half * 64;
            v[g][0] = ld_cg_v4(row + lane);
            v[g][1] = ld_cg_v4(row + 32 + lane);
          }
#pragma unroll
          for (int g = 0; g < kRowsPerToken; ++g) {
            add8(acc, v[g][0]);
            add8(acc, v[g][1]);
          }
        }
    }
  } else {
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * a.stages;
    unsigned char* stage0 =
        smem + 1024 + (size_t)warp * a.stages * kStageBytes;  // after the barriers
    if (lane == 0)
      for (int s = 0; s < a.stages; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + s)));
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::
                     : "memory");
    __syncwarp();
    const int n = a.tasks * kTokensPerTask;  // stage loads: one token's rows each
    auto issue = [&](int i) {
      const int s = i % a.stages;
      asm volatile(
          "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bars + s)),
          "r"(kStageBytes)
          : "memory");
      for (int g = 0; g < kRowsPerToken; ++g) {
        const int4* row = a.src + row_of(a.rows, blockIdx.x, warp, i, g) * (kRowBytes / 16);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem_addr(stage0 + (size_t)s * kStageBytes + g * kRowBytes)),
            "l"(row), "r"(kRowBytes), "r"(smem_addr(bars + s))
            : "memory");
      }
    };
    if (lane == 0)
      for (int i = 0; i < min(a.stages, n); ++i) issue(i);
    for (int i = 0; i < n; ++i) {
      const int s = i % a.stages;
      mbar_wait(bars + s, (i / a.stages) & 1);
      const int4* st = reinterpret_cast<const int4*>(stage0 + (size_t)s * kStageBytes);
#pragma unroll 4
      for (int q = lane; q < kStageBytes / 16; q += 32) add8(acc, st[q]);
      __syncwarp();
      if (lane == 0 && i + a.stages < n) issue(i + a.stages);
    }
  }
  a.sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    a.t[2 * blockIdx.x] = t0;
    a.t[2 * blockIdx.x + 1] = global_timer_ns();
    a.clk[blockIdx.x] = clock64() - k0;
    atomicAdd(a.done, 1);
  }
}

static std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    if (q > p) out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

int main(int argc, char** argv) {
  std::string blocks_s = "1,4,8,16", modes_s = "ld,ld_acq,tma_1,tma_2", json;
  int warps = 12, tasks = 10, reps = 5;
  std::vector<int> busy_list = {0, 1};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--blocks")
      blocks_s = v;
    else if (k == "--modes")
      modes_s = v;
    else if (k == "--warps")
      warps = atoi(v.c_str());
    else if (k == "--tasks")
      tasks = atoi(v.c_str());
    else if (k == "--reps")
      reps = atoi(v.c_str());
    else if (k == "--busy") {
      busy_list.clear();
      for (auto& b : split(v)) busy_list.push_back(atoi(b.c_str()));
    } else if (k == "--json")
      json = v;
    else {
      fprintf(stderr, "unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const long long rows = (512ll << 20) / kRowBytes;  // 512 MiB, past any L2
  const long long bg_vectors = (1ll << 30) / 16;     // 1 GiB copied by the busy blocks
  Args a{};
  int4 *src, *bg_src, *bg_dst;
  CK(cudaMalloc(&src, rows * kRowBytes));
  CK(cudaMemset(src, 0x3c, rows * kRowBytes));
  CK(cudaMalloc(&bg_src, bg_vectors * 16));
  CK(cudaMalloc(&bg_dst, bg_vectors * 16));
  CK(cudaMemset(bg_src, 1, bg_vectors * 16));
  CK(cudaMalloc(&a.flag, 4096));
  CK(cudaMemset(a.flag, 0, 4096));
  CK(cudaMalloc(&a.done, 4));
  CK(cudaMalloc(&a.bg_bytes, 8));
  CK(cudaMalloc(&a.t, 2 * sms * sizeof(unsigned long long)));
  CK(cudaMalloc(&a.clk, sms * sizeof(long long)));
  CK(cudaMalloc(&a.sink, (size_t)sms * 1024 * sizeof(float)));
  {  // the task modes' ye [C, N], tokens and their routing
    const long long N = kYeCols, C = kYeRows,
                    tokens = 32ll * 32 * kTokensPerTask * 40;  // 32 blocks of 32 warps, 40 tasks
    unsigned char *ye, *out;
    int *send, *rof;
    float* wts;
    CK(cudaMalloc(&ye, C * N * 2));
    CK(cudaMemset(ye, 0x3c, C * N * 2));
    CK(cudaMalloc(&out, tokens * N * 2));
    std::vector<int> hs(tokens), hr(tokens * 8);
    std::vector<float> hw(tokens * 8, 0.125f);
    unsigned long long x = 88172645463325252ull;
    for (long long t = 0; t < tokens; ++t) {
      hs[t] = (int)t;
      for (int k = 0; k < 8; ++k) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        hr[t * 8 + k] = (int)(x % C);
      }
    }
    CK(cudaMalloc(&send, tokens * 4));
    CK(cudaMalloc(&rof, tokens * 8 * 4));
    CK(cudaMalloc(&wts, tokens * 8 * 4));
    CK(cudaMemcpy(send, hs.data(), tokens * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(rof, hr.data(), tokens * 8 * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(wts, hw.data(), tokens * 8 * 4, cudaMemcpyHostToDevice));
    a.send_rows = send, a.row_of = rof, a.weights = wts, a.ye = ye, a.out = out, a.N = N;
  }
  a.src = src;
  a.rows = rows;
  a.bg_src = bg_src;
  a.bg_dst = bg_dst;
  a.bg_vectors = bg_vectors;
  a.tasks = tasks;
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          prop.sharedMemPerBlockOptin));
  printf("%s, %d SMs; rows of %d bytes, tasks of %d, %d tasks per warp, %d warps per block\n",
         prop.name, sms, kRowBytes, kTokensPerTask * kRowsPerToken * kRowBytes, tasks, warps);
  printf("%-8s %6s %5s %14s %14s %12s %14s %8s\n", "method", "blocks", "busy", "GB/s per block",
         "GB/s all", "us", "busy GB/s", "SM GHz");
  FILE* jf = json.empty() ? nullptr : fopen(json.c_str(), "w");
  if (jf) fprintf(jf, "{\"gpu\": \"%s\", \"rows\": [\n", prop.name);
  bool first = true;
  for (int busy : busy_list)
    for (auto& bs : split(blocks_s))
      for (auto& m : split(modes_s)) {
        const int nb = atoi(bs.c_str());
        if (nb > 32 || warps > 32 || tasks > 40) {
          fprintf(stderr, "the task modes' routing covers 32 blocks of 32 warps, 40 tasks each\n");
          return 2;
        }
        a.readers = nb;
        a.stages = 1;
        const Method* me = nullptr;
        for (const Method& k : kMethods)
          if (m == k.name) me = &k;
        if (me != nullptr) {
          a.kind = me->kind, a.light = me->light, a.pre = me->pre, a.N = me->N;
        } else if (m.rfind("tma_", 0) == 0) {
          a.kind = kTma, a.stages = atoi(m.c_str() + 4), a.N = kYeCols;
        } else {
          fprintf(stderr, "unknown method %s\n", m.c_str());
          return 2;
        }
        // At least half an SM's shared memory, so that no two blocks share an SM
        const size_t shm =
            std::max<size_t>(a.kind == kTma       ? 1024 + (size_t)warps * a.stages * kStageBytes
                             : a.kind == kTaskTma ? 1024 + (size_t)warps * 16384
                                                  : 0,
                             std::max<size_t>(prop.sharedMemPerMultiprocessor / 2 + 1024,
                                              busy >= 2 ? 1024 + 6 * 32768 : 0));
        if (shm > prop.sharedMemPerBlockOptin) {
          printf("%-8s %6d %5d  needs %zu bytes of shared memory per block: skipped\n", m.c_str(),
                 nb, busy, shm);
          continue;
        }
        a.busy = busy;
        const int grid = busy ? sms : nb;
        std::vector<double> per, all, us, bg, gh;
        for (int r = 0; r < reps + 1; ++r) {
          CK(cudaMemset(a.done, 0, 4));
          CK(cudaMemset(a.bg_bytes, 0, 8));
          probe<<<grid, warps * 32, shm>>>(a);
          CK(cudaGetLastError());
          CK(cudaDeviceSynchronize());
          std::vector<unsigned long long> t(2 * nb);
          CK(cudaMemcpy(t.data(), a.t, t.size() * 8, cudaMemcpyDeviceToHost));
          std::vector<long long> clk(nb);
          CK(cudaMemcpy(clk.data(), a.clk, nb * 8, cudaMemcpyDeviceToHost));
          unsigned long long bgb = 0;
          CK(cudaMemcpy(&bgb, a.bg_bytes, 8, cudaMemcpyDeviceToHost));
          if (r == 0) continue;  // warm-up
          const double bytes = (double)warps * tasks * kTokensPerTask * kRowsPerToken * kRowBytes;
          std::vector<double> bw, ghz;
          unsigned long long lo = ~0ull, hi = 0;
          for (int b = 0; b < nb; ++b) {
            bw.push_back(bytes / (double)(t[2 * b + 1] - t[2 * b]));
            ghz.push_back(clk[b] / (double)(t[2 * b + 1] - t[2 * b]));
            lo = std::min(lo, t[2 * b]);
            hi = std::max(hi, t[2 * b + 1]);
          }
          std::sort(bw.begin(), bw.end());
          std::sort(ghz.begin(), ghz.end());
          gh.push_back(ghz[ghz.size() / 2]);
          per.push_back(bw[bw.size() / 2]);
          all.push_back(bytes * nb / (double)(hi - lo));
          us.push_back((hi - lo) / 1e3);
          bg.push_back(bgb / (double)(hi - lo));
        }
        std::sort(per.begin(), per.end());
        std::sort(all.begin(), all.end());
        std::sort(us.begin(), us.end());
        std::sort(bg.begin(), bg.end());
        std::sort(gh.begin(), gh.end());
        const double c = gh[gh.size() / 2];
        const double g = bg[bg.size() / 2];
        const double p = per[per.size() / 2], q = all[all.size() / 2], u = us[us.size() / 2];
        printf("%-8s %6d %5d %14.1f %14.1f %12.1f %14.0f %8.2f\n", m.c_str(), nb, busy, p, q, u, g,
               c);
        if (jf)
          fprintf(
              jf,
              "%s {\"method\": \"%s\", \"blocks\": %d, \"busy\": %d, \"warps\": %d, "
              "\"gbps_per_block\": %.2f, \"gbps_all\": %.2f, \"us\": %.2f, \"busy_gbps\": %.0f, "
              "\"reader_sm_ghz\": %.3f}",
              first ? "" : ",\n", m.c_str(), nb, busy, warps, p, q, u, g, c);
        first = false;
      }
  if (jf) {
    fprintf(jf, "\n]}\n");
    fclose(jf);
  }
  return 0;
}
