// The GEMM tiles of the fused kernels (kernels/fused/gather_gemm.cu, gemm_combine.cu,
// docs/kernels.md#fused-gather-gemm): CUTLASS's SM90 collectives of one expert-major grouped
// GEMM (TMA loads into a shared-memory pipeline, two consumer warpgroups of wgmma, TMA-store
// epilogue) in a tile loop of our own, with hooks for what each kernel adds.
//
// A is one [C, K] tensor of expert-major rows for every expert (its batch stride is a static 0),
// B is w [L, K, N] with N contiguous (the layer's forward), or w [L, N, K] with K contiguous
// (kKMajorB: the backward's products by the transposed weights, read in place), D is [C, N] like
// A. Expert segments start at multiples of kBlockM, so a 128-row block never straddles two
// experts: tile (b, n) multiplies rows [b * kBlockM, (b + 1) * kBlockM) by columns
// [n * 256, (n + 1) * 256) of w[expert_of(b)].
#pragma once
#include <cuda_bf16.h>

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/pipeline/pipeline.hpp"
#include "common/warp.h"
#include "kernels/fused/sizes.h"
#include "kernels/fused/tile_order.h"
#include "kernels/high_throughput/common.cuh"
#include "kernels/launch.cuh"
#include "testing/mutations.h"

namespace jax_ep {
namespace fused {
namespace tiles {

using namespace cute;
using Element = cutlass::bfloat16_t;
using Tile = Shape<Int<kBlockM>, Int<kBlockN>, _64>;
using Cluster = Shape<_1, _1, _1>;
using StrideA = Stride<int64_t, _1, _0>;  // rows [C, K], shared by every expert
// w as B = (N, K, L): [L, K, N] with N contiguous, or (kKMajorB) [L, N, K] with K contiguous
template <bool kKMajorB>
using StrideBFor =
    std::conditional_t<kKMajorB, Stride<int64_t, _1, int64_t>, Stride<_1, int64_t, int64_t>>;
using StrideD = Stride<int64_t, _1, _0>;  // [C, N]
// The epilogue of a schedule (TMA stores, or stores from registers: its builder wants the
// fusion's source type void, like C), D bfloat16, alpha = 1.
template <class Schedule, class Source = Element>
using EpilogueFor = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, StrideD, 8, Element,
    StrideD, 8, Schedule,
    cutlass::epilogue::fusion::LinearCombination<Element, float, Source, float>>::CollectiveOp;

// The mainloop (TMA loads into a shared-memory pipeline, two consumer warpgroups), its stage
// count leaving `reserved` bytes of shared memory to the rest of the kernel.
template <int reserved, bool kKMajorB>
using MainloopFor = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, StrideA, 8, Element,
    StrideBFor<kKMajorB>, 8, float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<reserved>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using Epilogue = EpilogueFor<cutlass::epilogue::TmaWarpSpecializedCooperative>;
// Tile ids in flight from the producer warp, which takes them from the tile queue, to the warps
// that follow it (the consumer warps and warp 1, one arrival each).
constexpr int kRing = 4;
constexpr int kRingReaders = 2 * cutlass::NumWarpsPerWarpGroup + 1;
// Shared memory beside the collectives' (SharedStorage below).
constexpr int kExtraSmem = static_cast<int>(2 * kRing * sizeof(uint64_t) + kRing * sizeof(int) +
                                            sizeof(int) * (kMaxExperts + 2) + kMaxExperts / 8);
template <bool kKMajorB>
using MainloopOf =
    MainloopFor<static_cast<int>(sizeof(typename Epilogue::SharedStorage)) + kExtraSmem + 1024,
                kKMajorB>;
using Mainloop = MainloopOf<false>;  // B = w [L, K, N]
using MainloopK = MainloopOf<true>;  // B = w [L, N, K]
using EpiLoadPipeline = typename Epilogue::LoadPipeline;
using EpiStorePipeline = typename Epilogue::StorePipeline;
// Both mainloops share the block's shared memory layout and pipeline: only the B tiles' swizzle
// and the MMA's B operand differ.
static_assert(
    sizeof(typename Mainloop::TensorStorage) == sizeof(typename MainloopK::TensorStorage) &&
        std::is_same_v<typename Mainloop::MainloopPipeline, typename MainloopK::MainloopPipeline>,
    "one shared-memory layout for both B layouts");
static_assert(size(typename Mainloop::TiledMma{}) == 256 &&
                  size(typename MainloopK::TiledMma{}) == 256,
              "two consumer warpgroups");
static_assert(kThreads == 384, "one producer and two consumer warpgroups");

// A tile block's dynamic shared memory.
struct SharedStorage {
  struct Tensors : cute::aligned_struct<128, _1> {
    union Operands {  // the mainloop's A and B tiles, in the layout of B's mainloop
      typename Mainloop::TensorStorage n;
      typename MainloopK::TensorStorage k;
    } mainloop;
    typename Epilogue::TensorStorage epilogue;
  } tensors;
  struct Pipelines : cute::aligned_struct<16, _1> {
    alignas(16) typename Mainloop::PipelineStorage mainloop;
    alignas(16) typename Epilogue::PipelineStorage epi_load;
  } pipelines;
  uint64_t ring_full[kRing], ring_empty[kRing];  // mbarriers of the tile-id ring
  int ring[kRing];                               // tile ids, -1: no tile is left
  int block_start[kMaxExperts + 1];  // first row block of each segment; [L]: blocks in all
  // bit l: segment l's last row block has zero rows in [kBlockM / 2, kBlockM) (last_half_zero)
  unsigned int last_half_zero[kMaxExperts / 32];
  unsigned int stored;  // zeroed before the tiles: the hooks' count
};
// The dynamic allocation, aligned to 1 KiB by hand (128-byte swizzled TMA tiles need it, and a
// kernel's static shared memory comes first).
constexpr size_t kSmemBytes = sizeof(SharedStorage) + 1024;
// (with room for the kernels' static shared memory: 1.6 KiB in the gather + GEMM)
static_assert(kSmemBytes + 4096 <= 227 * 1024, "a Hopper block's shared memory");
__device__ __forceinline__ SharedStorage& shared_storage(uint8_t* raw) {
  return *reinterpret_cast<SharedStorage*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                           ~static_cast<uintptr_t>(1023));
}
// The mainloop ML's tiles in the block's shared memory.
template <class ML>
__device__ __forceinline__ typename ML::TensorStorage& mainloop_tensors(SharedStorage& ss) {
  if constexpr (std::is_same_v<ML, MainloopK>)
    return ss.tensors.mainloop.k;
  else
    return ss.tensors.mainloop.n;
}

// The collectives' parameters of one GEMM, B read by the mainloop ML. (The epilogue's type is
// named outside the template: inside it, its member `epilogue` would hide the namespace
// cutlass::epilogue that Epilogue's arguments name.)
using EpilogueParams = typename Epilogue::Params;
template <class ML>
struct TileParamsOf {
  typename ML::Params mainloop;
  EpilogueParams epilogue;
};
template <bool kKMajorB>
using TileParamsFor = TileParamsOf<MainloopOf<kKMajorB>>;
using TileParams = TileParamsFor<false>;

// What one GEMM computes: d [C, N] = a [C, K] @ w[l] [K, N] on the rows of segment l (segment
// lengths `sizes`, multiples of kBlockM but for one clipped to C), bfloat16.
struct TileProblem {
  const int32_t* sizes;
  int C, L;
  int64_t K, N;
  int chunk_blocks = 0;  // the queue's chunks of column blocks (chunked_tile_order); 0: none
};

// Host: the epilogue's parameters (D's TMA descriptor) of a problem. (Not in a template: the host
// compiler mistakes the epilogue's argument types there.)
inline EpilogueParams epilogue_params(const TileProblem& t, void* d) {
  auto mnkl = make_shape(t.C, static_cast<int>(t.N), static_cast<int>(t.K), t.L);
  typename Epilogue::Arguments ea{};
  ea.thread.alpha = 1.0f;
  ea.thread.beta = 0.0f;
  ea.ptr_C = nullptr;
  ea.dC = StrideD{t.N, _1{}, _0{}};
  ea.ptr_D = static_cast<Element*>(d);
  ea.dD = StrideD{t.N, _1{}, _0{}};
  return Epilogue::to_underlying_arguments(mnkl, ea, nullptr);
}

// Host: the collectives' parameters (TMA descriptors) of a problem, w [L, K, N] or (kKMajorB)
// [L, N, K].
template <bool kKMajorB = false>
TileParamsFor<kKMajorB> tile_params(const TileProblem& t, const void* a, const void* w, void* d) {
  using ML = MainloopOf<kKMajorB>;
  TileParamsFor<kKMajorB> p{};
  auto mnkl = make_shape(t.C, static_cast<int>(t.N), static_cast<int>(t.K), t.L);
  StrideBFor<kKMajorB> stride_b{};
  if constexpr (kKMajorB)
    stride_b = StrideBFor<true>{t.K, _1{}, t.K * t.N};
  else
    stride_b = StrideBFor<false>{_1{}, t.N, t.K * t.N};
  typename ML::Arguments ma{static_cast<const Element*>(a), StrideA{t.K, _1{}, _0{}},
                            static_cast<const Element*>(w), stride_b};
  p.mainloop = ML::to_underlying_arguments(mnkl, ma, nullptr);
  p.epilogue = epilogue_params(t, d);
  return p;
}

// The paired columns of the layer's first GEMM (gather_gemm.cu's activation epilogue,
// docs/kernels.md#fused-activation): w [L, K, N], N = 2I (the gate projection's I columns, then
// the up projection's), read as B = (N, K, L) with N = (kPairColumns columns, gate | up, I /
// kPairColumns column blocks), so that tile n holds the gate's columns [kPairColumns * n, +
// kPairColumns) and then the up projection's same columns: silu(gate) * up of kPairColumns
// columns is then in one thread's registers (an accumulator's column c and c + kPairColumns sit
// in the same thread). D (h) holds the tiles as computed: its columns in that paired order.
constexpr int kPairColumns = kBlockN / 2;
__host__ __device__ inline auto paired_b_layout(int64_t K, int64_t N, int L) {
  return make_layout(
      make_shape(make_shape(Int<kPairColumns>{}, _2{}, static_cast<int>(N / kBlockN)),
                 static_cast<int>(K), L),
      make_stride(make_stride(_1{}, N / 2, Int<kPairColumns>{}), N, K * N));
}
using PairedTmaB = decltype(make_tma_copy_B_sm90(
    typename Mainloop::GmemTiledCopyB{},
    make_tensor(static_cast<const Element*>(nullptr), paired_b_layout(0, 0, 0)),
    typename Mainloop::SmemLayoutB{}(_, _, cute::Int<0>{}), Tile{}, Cluster{}));
// Host: the TMA descriptor of w in paired columns (N a multiple of kBlockN).
inline PairedTmaB paired_tma_b(const void* w, int64_t K, int64_t N, int L) {
  return make_tma_copy_B_sm90(typename Mainloop::GmemTiledCopyB{},
                              make_tensor(static_cast<const Element*>(w), paired_b_layout(K, N, L)),
                              typename Mainloop::SmemLayoutB{}(_, _, cute::Int<0>{}), Tile{},
                              Cluster{});
}

// Host: launch a fused kernel of `grid` tile-sized blocks (kThreads threads, kSmemBytes of
// dynamic shared memory) through the launch gate (kernels/launch.cuh); an error message, empty
// on success. In the one-GPU multi-rank mode's dry run it checks the residency and launches
// nothing.
template <class Params>
std::string launch_kernel(void (*kernel)(Params), const char* name, int grid, const Params& p,
                          cudaStream_t stream) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kSmemBytes));
  if (e != cudaSuccess) return std::string("shared memory attribute: ") + cudaGetErrorString(e);
  if (!launch_gated(kernel, name, grid, kThreads, kSmemBytes, stream, p)) return {};
  e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("launch: ") + cudaGetErrorString(e);
  return {};
}

// The tile ids a warp reads from the ring (all lanes call next(), in order): tile i is row block
// i / col_blocks and column block i % col_blocks (the queue's order is chunked_tile_order's); -1
// once no tile is left, after which the warp calls next() no more.
struct TileRing {
  SharedStorage& ss;
  int col_blocks;
  int k = 0;
  __device__ __forceinline__ int next(int lane) {
    const int slot = k % kRing;
    cutlass::arch::ClusterBarrier::wait(&ss.ring_full[slot], (k / kRing) & 1);
    asm volatile("" ::: "memory");  // the slot's read stays after the wait
    const int i = ss.ring[slot];
    ++k;
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&ss.ring_empty[slot]);
    return i;
  }
};

// Rows in all segments (clipped to C: the sum never overflows, whatever the sizes), summed by
// one warp.
__device__ __forceinline__ int rows_in_segments(const int32_t* sizes, int L, int C, int lane) {
  long long s = 0;
  for (int l = lane; l < L; l += 32) s = min(s + max(0, sizes[l]), static_cast<long long>(C));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    s = min(s + __shfl_xor_sync(kFull, s, o), static_cast<long long>(C));
  return static_cast<int>(s);
}

// One warp: block_start[l] = the first row block of segment l (rounded up: a segment clipped to
// nothing starts at the end), block_start[L] = the row blocks of all segments.
__device__ __forceinline__ void segment_starts(const int32_t* sizes, int L, int C, int* block_start,
                                               int lane) {
  long long carry = 0;  // 64-bit, sizes clipped to C: no overflow whatever the sizes
  for (int base = 0; base < L; base += 32) {
    const int l = base + lane;
    const long long v = l < L ? min(max(0, sizes[l]), C) : 0;
    long long incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long n = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += n;
    }
    const int start = static_cast<int>(min(carry + incl - v, static_cast<long long>(C)));
    if (l < L) block_start[l] = (start + kBlockM - 1) / kBlockM;
    carry = min(carry + __shfl_sync(kFull, incl, 31), static_cast<long long>(C));
  }
  if (lane == 0) block_start[L] = static_cast<int>((carry + kBlockM - 1) / kBlockM);
}

// One warp, after segment_starts: bit l of bits set when segment l has rows and half_zero(b)
// (one lane, b the segment's last row block) says that rows [kBlockM / 2, kBlockM) of A's block b
// are zero rows.
template <class HalfZero>
__device__ __forceinline__ void last_blocks_half_zero(const int* block_start, int L,
                                                      unsigned int* bits, HalfZero&& half_zero,
                                                      int lane) {
  for (int base = 0; base < L; base += 32) {
    const int l = base + lane;
    const bool z =
        l < L && block_start[l + 1] > block_start[l] && half_zero(block_start[l + 1] - 1);
    const unsigned int m = __ballot_sync(kFull, z);
    if (lane == 0) bits[base / 32] = m;
  }
}

// The producer warp (all lanes): the k tiles of tile (b, n) of expert l into the pipeline, A
// through the mainloop's descriptor (gA: its tiled view, (BLK_M, BLK_K, m, k, l)) and B through
// the paired one; what CUTLASS's mainloop load does, with B's columns paired.
template <class Pipeline, class State, class TensorA>
__device__ __forceinline__ void load_paired(const TileParams& p, const PairedTmaB& tma_b,
                                            Pipeline& pipeline, State state, const TensorA& gA_mkl,
                                            const TileProblem& t, int b, int n, int l, int k_tiles,
                                            SharedStorage& ss) {
  if (!cute::elect_one_sync()) return;
  Tensor sA = make_tensor(make_smem_ptr(ss.tensors.mainloop.n.smem_A.data()),
                          typename Mainloop::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(ss.tensors.mainloop.n.smem_B.data()),
                          typename Mainloop::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
  Tensor mB = tma_b.get_tma_tensor(shape(paired_b_layout(t.K, t.N, t.L)));
  Tensor gB_nkl = local_tile(mB, Tile{}, make_coord(_, _, _), Step<Underscore, _1, _1>{});
  auto tma_a = p.mainloop.tma_load_a.get_slice(0);
  auto tma_b_slice = tma_b.get_slice(0);
  Tensor tAgA = tma_a.partition_S(gA_mkl(_, _, b, _, l));  // (TMA, TMA_M, TMA_K, k)
  Tensor tAsA = tma_a.partition_D(sA);                     // (TMA, TMA_M, TMA_K, PIPE)
  Tensor tBgB = tma_b_slice.partition_S(gB_nkl(_, _, n, _, l));
  Tensor tBsB = tma_b_slice.partition_D(sB);
  for (int k = 0; k < k_tiles; ++k) {
    pipeline.producer_acquire(state);
    auto* bar = pipeline.producer_get_barrier(state);
    const int stage = state.index();
    copy(p.mainloop.tma_load_a.with(*bar, 0), tAgA(_, _, _, k), tAsA(_, _, _, stage));
    copy(tma_b.with(*bar, 0), tBgB(_, _, _, k), tBsB(_, _, _, stage));
    ++state;
  }
}

// The tile loop of one block (all kThreads threads): the producer warp takes tiles from
// `queue` (an int zeroed before the launch, shared by every block that computes tiles: the tiles
// go out in chunked_tile_order's order to whichever block is free) and passes their ids on through
// the ring. Hooks:
// - before_load(b): the producer warp (all lanes), before it loads row block b;
// - warp_one(ring): warp 1 of the producer warpgroup (all lanes), otherwise idle: it must read
//   the ring up to its -1;
// - after_mma(stored): the consumer threads after each tile's MMAs, before its epilogue
//   (stored: an earlier tile's stores were issued), and once after the last epilogue;
// - on_acc(acc, tiled_mma, b, n, mma_thread): the consumer threads, each tile's accumulators
//   (float32, read-only) before its epilogue;
// - half_zero(b): one lane of warp 0 at the start, once per segment with rows, b its last row
//   block: true when rows [kBlockM / 2, kBlockM) of A's block b are zero rows. The second
//   consumer warpgroup (those rows' MMAs) then issues no MMA for that block's tiles, its
//   accumulators zero (the product of zero rows): such a tile costs about half its MMAs
//   (docs/kernels.md#fused-half-tiles). nullptr: no block skips, and the tile loop has no such
//   branch.
// paired: B in paired columns (paired_tma_b, kPaired) instead of the mainloop's descriptor (B =
// w [L, K, N] only). store_d: false leaves D unwritten (no TMA-store epilogue: on_acc stores
// what the kernel needs). ML: the mainloop of p (B's layout). True in the consumer threads (232
// registers each, free once this returns), false in the producer warpgroup's (40 registers).
template <bool kPaired = false, class ML, class BeforeLoad, class WarpOne, class AfterMma,
          class HalfZero, class OnAcc = void (*)()>
__device__ __forceinline__ bool run_tiles(const TileParamsOf<ML>& p, SharedStorage& ss,
                                          const TileProblem& t, int* queue,
                                          BeforeLoad&& before_load, WarpOne&& warp_one,
                                          AfterMma&& after_mma, HalfZero&& half_zero,
                                          const PairedTmaB* paired = nullptr,
                                          OnAcc&& on_acc = nullptr, bool store_d = true) {
#if defined(__CUDA_ARCH__)  // CUTLASS's epilogue visitors are device-only: not in the host pass
  static_assert(!kPaired || std::is_same_v<ML, Mainloop>, "paired columns read w [L, K, N]");
  constexpr bool kHalfTiles = !std::is_null_pointer_v<std::decay_t<HalfZero>>;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TiledMma = typename ML::TiledMma;
  using MainloopPipeline = typename ML::MainloopPipeline;
  using PipelineState = typename ML::PipelineState;
  const int thread_idx = threadIdx.x;
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int warp_group = cutlass::canonical_warp_group_idx();
  const int lane = thread_idx & 31;

  if (warp_idx == 0) {
    segment_starts(t.sizes, t.L, t.C, ss.block_start, lane);
    if constexpr (kHalfTiles) {
      __syncwarp();
      last_blocks_half_zero(ss.block_start, t.L, ss.last_half_zero, half_zero, lane);
    }
  }
  if (thread_idx == 0) {
    ss.stored = 0;
    for (int s = 0; s < kRing; ++s) {
      Barrier::init(&ss.ring_full[s], 1);
      Barrier::init(&ss.ring_empty[s], kRingReaders);
    }
    cutlass::arch::fence_barrier_init();
  }
  if (warp_idx == 0 && cute::elect_one_sync()) {
    ML::prefetch_tma_descriptors(p.mainloop);
    Epilogue::prefetch_tma_descriptors(p.epilogue);
    if constexpr (kPaired) cute::prefetch_tma_descriptor(paired->get_tma_descriptor());
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
  __syncthreads();  // barrier init, block starts and the count visible to the whole block

  const int col_blocks = static_cast<int>(column_blocks(t.N));
  const int count = ss.block_start[t.L] * col_blocks;
  const int chunk = t.chunk_blocks > 0 ? t.chunk_blocks : col_blocks;
  auto mnkl = make_shape(t.C, static_cast<int>(t.N), static_cast<int>(t.K), t.L);
  ML mainloop;
  auto load_inputs = mainloop.load_init(mnkl, p.mainloop);
  const int k_tiles = static_cast<int>(size<3>(get<0>(load_inputs)));
  TileRing ring{ss, col_blocks};

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_idx == 0) {
      auto draw = [&, queue, count, chunk, lane] {
        const int q = warp_ticket(queue, lane);
        return q < count
                   ? chunked_tile_order(ss.block_start, t.L, col_blocks, chunk, kRasterRowBlocks, q)
                   : -1;
      };
      PipelineState state = cutlass::make_producer_start_state<MainloopPipeline>();
      int i = draw();
      for (int k = 0;; ++k) {
        const int slot = k % kRing;
        Barrier::wait(&ss.ring_empty[slot], ((k / kRing) & 1) ^ 1);
        if (lane == 0) {
          ss.ring[slot] = i;
          asm volatile("" ::: "memory");  // the slot's write stays before the arrive
          Barrier::arrive(&ss.ring_full[slot]);
        }
        if (i < 0) break;
        const int next = draw();  // in flight while this tile loads
        const int b = i / col_blocks, n = i % col_blocks;
        before_load(b);
        const int l = expert_of(ss.block_start, t.L, b);
        if constexpr (kPaired) {
          load_paired(p, *paired, pipeline, state, get<0>(load_inputs), t, b, n, l, k_tiles, ss);
        } else {
          auto k_iter = cute::make_coord_iterator(shape<3>(get<0>(load_inputs)));
          mainloop.load(p.mainloop, pipeline, state, load_inputs, make_coord(b, n, _, l), k_iter,
                        k_tiles, lane, 0u, mainloop_tensors<ML>(ss));
        }
        state.advance(k_tiles);
        i = next;
      }
      mainloop.load_tail(pipeline, state);
    } else if (warp_idx == 1) {
      warp_one(ring);
    }
    return false;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  TiledMma tiled_mma;
  Epilogue epilogue(p.epilogue, ss.tensors.epilogue);
  const int mma_thread = thread_idx - cutlass::NumThreadsPerWarpGroup;
  PipelineState read_state;
  typename Epilogue::LoadPipelineState epi_load_state;
  auto epi_store_state = cutlass::make_producer_start_state<EpiStorePipeline>();
  bool stored = false;
  for (int i; (i = ring.next(lane)) >= 0;) {
    const int b = i / col_blocks, n = i % col_blocks;
    const int l = expert_of(ss.block_start, t.L, b);
    auto acc = partition_fragment_C(tiled_mma, take<0, 2>(Tile{}));
    // A's rows [kBlockM / 2, kBlockM) (the tiled MMA's second 64-row atom, the second
    // warpgroup's) are zero rows: that warpgroup only passes the stages on, and the first one's
    // MMAs have the tensor cores to themselves.
    constexpr int kHalfSkipper = JAX_EP_PLANTED(kHalfTileSkipsRows) ? 1 : 2;
    // (a warp vote: a branch on it leaves the mainloop's stage and descriptor arithmetic in
    // uniform registers, where a branch on the plain condition moved it to per-thread ones,
    // R2UR before every wgmma: docs/kernels.md#fused-half-tiles)
    bool half_skip = false;
    if constexpr (kHalfTiles)
      half_skip = __all_sync(kFull, warp_group == kHalfSkipper && b + 1 == ss.block_start[l + 1] &&
                                        (ss.last_half_zero[l / 32] >> (l % 32) & 1u));
    if (half_skip) {
      clear(acc);
      PipelineState s = read_state;
      for (int k = 0; k < k_tiles; ++k, ++s) {
        pipeline.consumer_wait(s, pipeline.consumer_try_wait(s));
        pipeline.consumer_release(s);
      }
    } else {
      mainloop.mma(pipeline, read_state, acc, k_tiles, mma_thread, mainloop_tensors<ML>(ss),
                   p.mainloop);
      mainloop.mma_tail(pipeline, read_state, k_tiles);
    }
    read_state.advance(k_tiles);
    after_mma(stored);
    if constexpr (JAX_EP_PLANTED(kUnwrittenHSkipsActivation)) {
      if (!store_d) continue;
    }
    if constexpr (!std::is_pointer_v<std::decay_t<OnAcc>>) on_acc(acc, tiled_mma, b, n, mma_thread);
    if (!store_d) continue;
    auto [load_next, store_next] =
        epilogue.store(epi_load, epi_load_state, epi_store, epi_store_state, mnkl, Tile{},
                       make_coord(b, n, _, l), acc, tiled_mma, mma_thread, ss.tensors.epilogue);
    epi_load_state = load_next;
    epi_store_state = store_next;
    stored = true;
  }
  if (stored) epilogue.store_tail(epi_load, epi_load_state, epi_store, epi_store_state);
  after_mma(stored);
  return true;
#else
  return false;
#endif
}

}  // namespace tiles
}  // namespace fused
}  // namespace jax_ep
