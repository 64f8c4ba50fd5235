// The fused gather + grouped GEMM (gather_gemm.h, docs/kernels.md#fused-gather-gemm).
//
// One grid, two roles, all blocks co-resident (one per SM):
// - blocks [0, copy_blocks) pull rows: they follow the pull protocol of the high-throughput ops
//   (transport/pull.cuh) with x as the published operand, copy expert-major row j from the rank
//   holding its token (or zero it), a warp 8 rows at a time, and then add them to the arrival
//   counter of their row block (release). Rows past the last segment (and their GEMM output
//   rows) come last in that order, and are zeroed.
// - the other blocks compute tiles with CUTLASS's SM90 collectives (TMA loads into a smem
//   pipeline, warpgroup MMAs, TMA-store epilogue), in a loop of our own: tile i is row block
//   b = i / nN and column block i % nN, of the expert whose segment holds b. The producer warp
//   waits (bounded) until the counter of b reaches the rows of b before loading it.
// Segments start at multiples of kBlockM, so a row block never straddles two experts, and A
// (the rows) is one [C, H] tensor for every expert: its batch stride is a static 0.
// Copy blocks never wait for tile blocks, and have the lowest indices (the hardware starts blocks
// in index order), so the tile blocks' waits always end.
#define JAX_EP_WAITS_INLINE  // transport/peer.cuh: no function calls beside the wgmma
#include "kernels/fused/gather_gemm.h"

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/pipeline/pipeline.hpp"
#include "kernels/ht_common.cuh"
#include "runtime/virtual_ranks.h"

namespace jax_ep {
namespace fused {
namespace {

using namespace cute;
using Element = cutlass::bfloat16_t;
using Tile = Shape<Int<kBlockM>, _256, _64>;
using Cluster = Shape<_1, _1, _1>;
using StrideA = Stride<int64_t, _1, _0>;       // rows [C, H], shared by every expert
using StrideB = Stride<_1, int64_t, int64_t>;  // w [L, H, N]: (N, K, L) with N contiguous
using StrideD = Stride<int64_t, _1, _0>;       // h [C, N]
constexpr int kChunkRows = 8;  // rows a copy warp moves per arrival update (divides kBlockM)
static_assert(kBlockM % kChunkRows == 0, "a chunk never straddles two row blocks");
constexpr int kExtraSmem = static_cast<int>(sizeof(int)) * (kMaxExperts + 1);

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, StrideD, 8, Element,
    StrideD, 8, cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, StrideA, 8, Element, StrideB, 8,
    float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename Epilogue::SharedStorage)) + kExtraSmem + 1024>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using TiledMma = typename Mainloop::TiledMma;
using MainloopPipeline = typename Mainloop::MainloopPipeline;
using PipelineState = typename Mainloop::PipelineState;
using EpiLoadPipeline = typename Epilogue::LoadPipeline;
using EpiStorePipeline = typename Epilogue::StorePipeline;
static_assert(size(TiledMma{}) == 256, "two consumer warpgroups");
static_assert(kThreads == 384, "one producer and two consumer warpgroups");

struct SharedStorage {
  struct Tensors : cute::aligned_struct<128, _1> {
    typename Mainloop::TensorStorage mainloop;
    typename Epilogue::TensorStorage epilogue;
  } tensors;
  struct Pipelines : cute::aligned_struct<16, _1> {
    alignas(16) typename Mainloop::PipelineStorage mainloop;
    alignas(16) typename Epilogue::PipelineStorage epi_load;
  } pipelines;
  int block_start[kMaxExperts + 1];  // first row block of each segment; [L]: blocks in all
};
// The dynamic allocation is aligned to 1 KiB by hand (128-byte swizzled TMA tiles need it, and
// the copy role's static shared memory comes first).
constexpr size_t kSmemBytes = sizeof(SharedStorage) + 1024;

struct Params {
  typename Mainloop::Params mainloop;
  typename Epilogue::Params epilogue;
  GatherGemmArgs a;
};

constexpr const char* kPhasePeers = "ht_gather_gemm: wait for peers";
constexpr const char* kPhaseRows = "ht_gather_gemm: wait for a row block's rows";
constexpr const char* kPhaseEnd = "ht_gather_gemm: end barrier";

// Rows in all segments (clipped to C), summed by one warp.
__device__ __forceinline__ int rows_in_segments(const GatherGemmArgs& a, int lane) {
  int s = 0;
  for (int l = lane; l < a.L; l += 32) s += max(0, a.sizes[l]);
  s = ht::warp_sum(s);
  return min(s, a.C);
}

// ------------------------------------------------------------------------------------------
// Copy role: a warp per chunk of kChunkRows rows, chunks in row order (early row blocks
// arrive first).
// ------------------------------------------------------------------------------------------
__device__ void copy_rows(const GatherGemmArgs& a) {
  const PeerSlots& ps = a.ps;
  const int R = ps.num_ranks, tid = threadIdx.x, lane = tid & 31;
  const unsigned long long e = call_epoch(ps);
  __shared__ const uint8_t* s_x[kMaxRanks];
  const void* ptrs[1] = {a.x};
  if (!ht::publish_and_wait(ps, ptrs, 1, e, a.timeout_ns, kPhasePeers)) return;
  if (tid < R) s_x[tid] = peer_ptr<const uint8_t>(ps, tid, 0);
  __syncthreads();
  const int64_t Hb = a.H * static_cast<int64_t>(sizeof(Element));
  const int64_t Nb = a.N * static_cast<int64_t>(sizeof(Element));
  auto* xe = static_cast<uint8_t*>(a.xe);
  auto* h = static_cast<uint8_t*>(a.h);
  bool vec = Hb % 16 == 0 && ht::aligned16(xe);
  for (int s = 0; s < R; ++s) vec = vec && ht::aligned16(s_x[s]);
  const bool vec_h = Nb % 16 == 0 && ht::aligned16(h);
  const int recv = rows_in_segments(a, lane);
  // A warp takes kChunkRows consecutive rows (inside one row block) at a time, chunks in row
  // order over all copy warps, and publishes their arrival with one release.
  const int warps = kThreads / 32;
  const int64_t nw = static_cast<int64_t>(a.copy_blocks) * warps;
  const int64_t chunks = (static_cast<int64_t>(a.C) + kChunkRows - 1) / kChunkRows;
  const int64_t T = a.T;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * warps + (tid >> 5); c < chunks; c += nw) {
    const int64_t j0 = c * kChunkRows, j1 = min(j0 + kChunkRows, static_cast<int64_t>(a.C));
    // the chunk's sources, one load per lane up front
    const int my_src = lane < j1 - j0 && j0 + lane < recv ? a.rows_src[j0 + lane] : -1;
    int arrived = 0;
    for (int64_t j = j0; j < j1; ++j) {
      uint8_t* dst = xe + j * Hb;
      const int src = __shfl_sync(ht::kFull, my_src, static_cast<int>(j - j0));
      if (j < recv) {
        const int64_t s = src >= 0 && T > 0 ? src / T : -1;
        if (s >= 0 && s < R)
          ht::copy_row(dst, s_x[s] + (src % T) * Hb, Hb, vec, lane);
        else
          ht::zero_row(dst, Hb, vec, lane);
        ++arrived;
      } else {  // past the last segment: no tile reads or writes these rows
        ht::zero_row(dst, Hb, vec, lane);
        ht::zero_row(h + j * Nb, Nb, vec_h, lane);
      }
    }
    __syncwarp();  // every lane's stores before lane 0's release
    if (lane == 0 && arrived > 0) red_release_gpu_add(a.counters + j0 / kBlockM, arrived);
  }
  end_barrier(ps, e, a.timeout_ns, kPhaseEnd, [] {}, -1, static_cast<unsigned int>(a.copy_blocks));
}

// The producer's wait for row block b: false when it gave up (the tile then computes whatever
// the rows hold; the op fails on the host).
__device__ __forceinline__ bool wait_rows(Waiter me, const int* counter, int target,
                                          int64_t timeout_ns) {
  Patience wait;
  int v;
  while ((v = ld_acquire_gpu(counter)) < target)
    if (wait.gives_up(me, timeout_ns,
                      WaitSite{kPhaseRows, -1, static_cast<unsigned long long>(target),
                               static_cast<unsigned long long>(v)}))
      return false;
  return true;
}

// The expert whose segment holds row block b: the largest l with block_start[l] <= b (an empty
// segment shares its start with the next one, which wins).
__device__ __forceinline__ int expert_of(const int* block_start, int L, int b) {
  int lo = 0, hi = L - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (block_start[mid] <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// ------------------------------------------------------------------------------------------
// Tile role.
// ------------------------------------------------------------------------------------------
__device__ void compute_tiles(const Params& p, SharedStorage& ss) {
#if defined(__CUDA_ARCH__)  // CUTLASS's epilogue visitors are device-only: not in the host pass
  const GatherGemmArgs& a = p.a;
  const int thread_idx = threadIdx.x;
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int warp_group = cutlass::canonical_warp_group_idx();
  const int lane = thread_idx & 31;

  // Segment starts in row blocks (rounded up: a segment clipped to nothing starts at the end).
  if (warp_idx == 0) {
    int carry = 0;
    for (int base = 0; base < a.L; base += 32) {
      const int l = base + lane;
      const int v = l < a.L ? max(0, a.sizes[l]) : 0;
      int incl = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(ht::kFull, incl, o);
        if (lane >= o) incl += n;
      }
      const int start = min(carry + incl - v, a.C);
      if (l < a.L) ss.block_start[l] = (start + kBlockM - 1) / kBlockM;
      carry = min(carry + __shfl_sync(ht::kFull, incl, 31), a.C);
    }
    if (lane == 0) ss.block_start[a.L] = (carry + kBlockM - 1) / kBlockM;
  }
  if (warp_idx == 0 && cute::elect_one_sync()) {
    Mainloop::prefetch_tma_descriptors(p.mainloop);
    Epilogue::prefetch_tma_descriptors(p.epilogue);
  }

  typename MainloopPipeline::Params mp;
  if (warp_group == 0 && warp_idx == 0) mp.role = MainloopPipeline::ThreadCategory::Producer;
  if (warp_group > 0) mp.role = MainloopPipeline::ThreadCategory::Consumer;
  mp.is_leader = thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
  mp.num_consumers = size(TiledMma{});
  mp.transaction_bytes = p.mainloop.tma_transaction_bytes;
  MainloopPipeline pipeline(ss.pipelines.mainloop, mp, Cluster{});

  typename EpiLoadPipeline::Params ep;
  if (warp_group > 0) ep.role = EpiLoadPipeline::ThreadCategory::Consumer;
  ep.dst_blockid = 0;
  ep.producer_arv_count = cutlass::NumThreadsPerWarp;
  ep.consumer_arv_count = size(TiledMma{});
  ep.transaction_bytes = p.epilogue.tma_transaction_bytes;
  EpiLoadPipeline epi_load(ss.pipelines.epi_load, ep);
  typename EpiStorePipeline::Params sp;
  sp.always_wait = true;
  EpiStorePipeline epi_store(sp);
  __syncthreads();  // barrier init and block starts visible to the whole block

  const int L = a.L;
  const int blocks = ss.block_start[L];
  const int col_blocks = static_cast<int>((a.N + size<1>(Tile{}) - 1) / size<1>(Tile{}));
  const int tiles = blocks * col_blocks;
  const int first = static_cast<int>(blockIdx.x) - a.copy_blocks;
  const int stride = a.gemm_blocks;
  const int recv_rows = min(blocks * kBlockM, a.C);
  auto mnkl = make_shape(a.C, static_cast<int>(a.N), static_cast<int>(a.H), L);

  Mainloop mainloop;
  auto load_inputs = mainloop.load_init(mnkl, p.mainloop);
  const int k_tiles = static_cast<int>(size<3>(get<0>(load_inputs)));

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_idx != 0) return;
    PipelineState state = cutlass::make_producer_start_state<MainloopPipeline>();
    const Waiter me = waiter(a.ps);
    bool failed = false;
    for (int i = first; i < tiles; i += stride) {
      const int b = i / col_blocks, n = i % col_blocks;
      const int target = min(kBlockM, recv_rows - b * kBlockM);
#if JAX_EP_MUTATION == 11  // planted bug 11: a tile does not wait for its rows
      failed = true;
#endif
      if (lane == 0 && !failed) {
        const int* c = a.counters + b;
        if (ld_acquire_gpu(c) < target) failed = !wait_rows(me, c, target, a.timeout_ns);
      }
      failed = __shfl_sync(ht::kFull, failed, 0);
      fence_proxy_async_global();
      auto k_iter = cute::make_coord_iterator(shape<3>(get<0>(load_inputs)));
      mainloop.load(p.mainloop, pipeline, state, load_inputs,
                    make_coord(b, n, _, expert_of(ss.block_start, L, b)), k_iter, k_tiles, lane, 0u,
                    ss.tensors.mainloop);
      state.advance(k_tiles);
    }
    mainloop.load_tail(pipeline, state);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  TiledMma tiled_mma;
  Epilogue epilogue(p.epilogue, ss.tensors.epilogue);
  const int mma_thread = thread_idx - cutlass::NumThreadsPerWarpGroup;
  PipelineState read_state;
  typename Epilogue::LoadPipelineState epi_load_state;
  auto epi_store_state = cutlass::make_producer_start_state<EpiStorePipeline>();
  bool stored = false;
  for (int i = first; i < tiles; i += stride) {
    const int b = i / col_blocks, n = i % col_blocks;
    auto acc = partition_fragment_C(tiled_mma, take<0, 2>(Tile{}));
    mainloop.mma(pipeline, read_state, acc, k_tiles, mma_thread, ss.tensors.mainloop, p.mainloop);
    mainloop.mma_tail(pipeline, read_state, k_tiles);
    read_state.advance(k_tiles);
    auto [load_next, store_next] =
        epilogue.store(epi_load, epi_load_state, epi_store, epi_store_state, mnkl, Tile{},
                       make_coord(b, n, _, expert_of(ss.block_start, L, b)), acc, tiled_mma,
                       mma_thread, ss.tensors.epilogue);
    epi_load_state = load_next;
    epi_store_state = store_next;
    stored = true;
  }
  if (stored) epilogue.store_tail(epi_load, epi_load_state, epi_store, epi_store_state);
#endif
}

__global__ void __launch_bounds__(kThreads, 1)
    gather_gemm_kernel(const __grid_constant__ Params p) {
  if (static_cast<int>(blockIdx.x) < p.a.copy_blocks) {
    copy_rows(p.a);
    return;
  }
  extern __shared__ uint8_t smem_raw[];
  auto* ss = reinterpret_cast<SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                              ~static_cast<uintptr_t>(1023));
  compute_tiles(p, *ss);
}

}  // namespace

std::string launch(const GatherGemmArgs& a, cudaStream_t stream) {
  cudaError_t e =
      cudaFuncSetAttribute(gather_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kSmemBytes));
  if (e != cudaSuccess) return std::string("shared memory attribute: ") + cudaGetErrorString(e);
  const int grid = a.copy_blocks + a.gemm_blocks;
  if (!may_launch(reinterpret_cast<const void*>(&gather_gemm_kernel), "fused gather + GEMM", grid,
                  kThreads, kSmemBytes))
    return {};
  Params p{};
  p.a = a;
  auto mnkl = make_shape(a.C, static_cast<int>(a.N), static_cast<int>(a.H), a.L);
  typename Mainloop::Arguments ma{static_cast<const Element*>(a.xe), StrideA{a.H, _1{}, _0{}},
                                  static_cast<const Element*>(a.w), StrideB{_1{}, a.N, a.H * a.N}};
  p.mainloop = Mainloop::to_underlying_arguments(mnkl, ma, nullptr);
  typename Epilogue::Arguments ea{};
  ea.thread.alpha = 1.0f;
  ea.thread.beta = 0.0f;
  ea.ptr_C = nullptr;
  ea.dC = StrideD{a.N, _1{}, _0{}};
  ea.ptr_D = static_cast<Element*>(a.h);
  ea.dD = StrideD{a.N, _1{}, _0{}};
  p.epilogue = Epilogue::to_underlying_arguments(mnkl, ea, nullptr);
  gather_gemm_kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("launch: ") + cudaGetErrorString(e);
  return {};
}

}  // namespace fused
}  // namespace jax_ep
