// The fused gather + grouped GEMM (gather_gemm.h, docs/kernels.md#fused-gather-gemm).
//
// One grid, all blocks co-resident (one per SM), every block computing GEMM tiles:
// - the first copy_blocks blocks first pull rows: they follow the pull protocol of the
//   high-throughput ops (transport/pull.cuh) with x as the published operand; each warp takes
//   chunks of kChunkRows expert-major rows from the copy queue (an atomic counter, chunks in row
//   order), copies each row from the rank holding its token (or zeroes it), and adds the chunk
//   to the arrival counter of its row block (release). A token of another rank crosses the link
//   once: its first row (in its lowest expert's segment) also writes its other rows here (the
//   copies in rows_dups) and adds each to its row block's counter; those rows (rows_src -2) are
//   skipped where they lie. Once the queue is empty the block arrives at the end barrier (its
//   first step: the last copy block to arrive tells the peers this rank is done reading) and
//   joins the tiles.
// - rows past the last segment (of xe, h and act) are not written: no tile reads or writes
//   them, and the layer reads none of them.
// - tiles come from one tile queue shared by every block (kernels/fused/tiles.cuh), in row
//   order by groups of kRasterRowBlocks row blocks of an expert, each group column by column
//   (tile_order), computed with CUTLASS's SM90 collectives (TMA loads into a smem pipeline,
//   warpgroup MMAs, TMA-store epilogue). The producer warp waits (bounded) until the counter of
//   a tile's row block reaches that block's rows before loading it.
// Segments start at multiples of kBlockM, so a row block never straddles two experts, and A
// (the rows) is one [C, H] tensor for every expert: its batch stride is a static 0.
// With the activation, h (which only the backward reads) may go unwritten: the tiles then skip
// their TMA-store epilogue.
// Copy warps never wait for tiles, and a block takes tiles only once its copies are done, so the
// tiles' waits always end.
#define JAX_EP_WAITS_INLINE  // transport/peer.cuh: no function calls beside the wgmma
#include "kernels/fused/gather_gemm.h"

#include "kernels/fused/tiles.cuh"
#include "testing/mutations.h"
#include "transport/poison.cuh"

namespace jax_ep {
namespace fused {
namespace {

using namespace cute;
using namespace tiles;
constexpr int kChunkRows = 8;  // rows a copy warp moves per arrival update (divides kBlockM)
static_assert(kBlockM % kChunkRows == 0, "a chunk never straddles two row blocks");

template <bool kKMajorB>
struct Params {
  TileParamsFor<kKMajorB> tiles;
  PairedTmaB paired_b;  // w in paired columns (with act)
  GatherGemmArgs a;
  poison::Outputs outputs;  // xe, h and act, filled when a wait on the device gave up
};

constexpr const char* kPhasePeers = "ht_gather_gemm: wait for peers";
constexpr const char* kPhaseRows = "ht_gather_gemm: wait for a row block's rows";
constexpr const char* kPhaseEnd = "ht_gather_gemm: end barrier";

// ------------------------------------------------------------------------------------------
// Copy role: a warp per chunk of kChunkRows rows from the copy queue, chunks in row order (early
// row blocks arrive first). True in the block that must end the call (end_wait) once its tiles
// are done.
// ------------------------------------------------------------------------------------------
__device__ bool copy_rows(const GatherGemmArgs& a, unsigned long long e) {
  const PeerSlots& ps = a.ps;
  const int R = ps.num_ranks, tid = threadIdx.x, lane = tid & 31;
  __shared__ const uint8_t* s_x[kMaxRanks];
  static_assert(kMaxDups <= 32, "a row's copies are one per lane of its warp");
  __shared__ int s_copies[kThreads / 32][kMaxDups];  // per warp: the copies of the row it writes
  const void* ptrs[1] = {a.x};
  if (!ht::publish_and_wait(ps, ptrs, 1, e, a.timeout_ns, kPhasePeers)) return false;
  if (tid < R) s_x[tid] = peer_ptr<const uint8_t>(ps, tid, 0);
  __syncthreads();
  const int64_t Hb = a.H * static_cast<int64_t>(sizeof(Element));
  auto* xe = static_cast<uint8_t*>(a.xe);
  bool vec = Hb % 16 == 0 && ht::aligned16(xe);
  for (int s = 0; s < R; ++s) vec = vec && ht::aligned16(s_x[s]);
  const int recv = rows_in_segments(a.sizes, a.L, a.C, lane);
  int* queue = a.counters + row_blocks(a.C) + kTaskQueue;
  // recv is a multiple of kBlockM or C: no chunk straddles the last segment's end
  const int64_t chunks = (static_cast<int64_t>(recv) + kChunkRows - 1) / kChunkRows;
  const int64_t T = a.T;
  for (;;) {
    const int c = warp_ticket(queue, lane);
    if (c >= chunks) break;
    const int64_t j0 = static_cast<int64_t>(c) * kChunkRows;
    const int64_t j1 = min(j0 + kChunkRows, static_cast<int64_t>(recv));
    // the chunk's sources, one load per lane up front
    const int my_src = lane < j1 - j0 ? a.rows_src[j0 + lane] : -1;
    int arrived = 0;
    for (int64_t j = j0; j < j1; ++j) {
      uint8_t* dst = xe + j * Hb;
      const int src = __shfl_sync(kFull, my_src, static_cast<int>(j - j0));
      if (src == -2) continue;  // a copy: its token's first row writes and counts it
      const int64_t s = src >= 0 && T > 0 ? src / T : -1;
      if (s >= 0 && s < R) {
        // this row's copies (rows of other experts holding the same token), if any
        // (only a row marked as a copy: a row written and counted twice would let its block's
        // tiles start early)
        int d = lane < a.D ? a.rows_dups[j * a.D + lane] : -1;
        if (d >= 0 && (d >= recv || d == j || a.rows_src[d] != -2)) d = -1;
        const bool copy = d >= 0;
        const unsigned mask = __ballot_sync(kFull, copy);
        const int nd = __popc(mask);
        if (copy) s_copies[tid >> 5][__popc(mask & ((1u << lane) - 1))] = d;
        __syncwarp();
        ht::copy_row_to(dst, s_x[s] + (src % T) * Hb, Hb, vec, lane, xe, s_copies[tid >> 5],
                        JAX_EP_PLANTED(kCopiesUnwritten) ? 0 : nd);
        __syncwarp();  // every lane's stores (and reads of the copies) before the releases
        if (copy) red_release_gpu_add(a.counters + d / kBlockM, 1);
      } else {
        ht::zero_row(dst, Hb, vec, lane);
      }
      ++arrived;
    }
    __syncwarp();  // every lane's stores before lane 0's release
    if (lane == 0 && arrived > 0) red_release_gpu_add(a.counters + j0 / kBlockM, arrived);
  }
  return end_arrive(ps, e, -1, static_cast<unsigned int>(a.copy_blocks));
}

// ------------------------------------------------------------------------------------------
// The activation epilogue (with act): silu(gate) * up of tile (b, n) from its accumulators, into
// act's rows [b * kBlockM, + kBlockM) below C and columns [n * kPairColumns, + kPairColumns). In
// the paired columns a thread's accumulator i < 64 is column c < kPairColumns of the gate and
// i + 64 the same column of the up projection (the SM90 64xN accumulator layout: 2 columns, 2
// rows 8 apart, then N / 8 column groups), its neighbour i + 1 column c + 1. Gate and up are
// rounded to bfloat16 first (the values h holds, which the unfused layer's activation reads),
// silu(gate) * up = gate * up / (1 + exp(-gate)) in float32, rounded once.
// ------------------------------------------------------------------------------------------
template <class Acc, class Mma>
__device__ __forceinline__ void store_activation(const GatherGemmArgs& a, const Acc& acc,
                                                 const Mma& mma, int b, int n, int mma_thread) {
  Tensor coord = mma.get_slice(mma_thread)
                     .partition_C(make_identity_tensor(make_shape(Int<kBlockM>{}, Int<kBlockN>{})));
  constexpr int kHalf = decltype(size(acc))::value / 2;
  static_assert(kHalf == kBlockM * kBlockN / 2 / (2 * cutlass::NumThreadsPerWarpGroup),
                "the gate's accumulators are the first half of each thread's");
  const int64_t I = a.N / 2, row0 = static_cast<int64_t>(b) * kBlockM;
  auto* out = static_cast<__nv_bfloat162*>(a.act);
#pragma unroll
  for (int i = 0; i < kHalf; i += 2) {
    const int m = get<0>(coord(i)), c = get<1>(coord(i));
    if (row0 + m >= a.C) continue;
    float v[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      constexpr int kGate = JAX_EP_PLANTED(kActivationSwapsHalves) ? kHalf : 0;
      const float g = __bfloat162float(__float2bfloat16_rn(acc(i + u + kGate)));
      const float up = __bfloat162float(__float2bfloat16_rn(acc(i + u + kHalf - kGate)));
      // fast exp and division (a few instructions each, IEEE's take tens; ample for a
      // bfloat16 result): the epilogue holds up the tile's MMAs
      v[u] = __fdividef(g * up, 1.f + __expf(-g));
    }
    out[((row0 + m) * I + static_cast<int64_t>(n) * kPairColumns + c) / 2] =
        __floats2bfloat162_rn(v[0], v[1]);
  }
}

// ------------------------------------------------------------------------------------------
// Every block: copies first in the copy blocks, then tiles. The producer waits (bounded) until
// row block b's rows have arrived before loading it; `fence.proxy.async.global` orders that
// acquire before the TMA reads.
// ------------------------------------------------------------------------------------------
template <bool kAct, bool kKMajorB>
__global__ void __launch_bounds__(kThreads, 1)
    gather_gemm_kernel(const __grid_constant__ Params<kKMajorB> p) {
  static_assert(!(kAct && kKMajorB), "the activation's paired columns read w [L, H, N]");
  const GatherGemmArgs& a = p.a;
  const bool copier = static_cast<int>(blockIdx.x) < a.copy_blocks;
  const unsigned long long e = copier ? call_epoch(a.ps) : 0;
  const bool ends_call = copier && copy_rows(a, e);
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& ss = shared_storage(smem_raw);
  const Waiter me = waiter(a.ps);
  const int lane = threadIdx.x & 31;
  bool failed = false;  // a wait gave up: the tiles compute whatever the rows hold
  auto wait_for_rows = [&](int b) {
    const int target = min(kBlockM, min(ss.block_start[a.L] * kBlockM, a.C) - b * kBlockM);
    if constexpr (JAX_EP_PLANTED(kTileSkipsRows)) failed = true;
    if (lane == 0 && !failed) {
      const int* c = a.counters + b;
      failed = !wait_count_geq(me, a.timeout_ns, kPhaseRows, -1, target,
                               [c] { return ld_acquire_gpu(c); });
    }
    failed = __shfl_sync(kFull, failed, 0);
    fence_proxy_async_global();
  };
  const TileProblem t{a.sizes, a.C, a.L, a.H, a.N};
  auto drain = [lane](TileRing& ring) {
    while (ring.next(lane) >= 0) {
    }
  };
  // a segment's last row block: rows of -1 (zero rows) in rows [kBlockM / 2, kBlockM) only
  auto half_zero = [&a](int b) {
    const int64_t r0 = static_cast<int64_t>(b) * kBlockM + kBlockM / 2;
    bool zero = true;
#pragma unroll
    for (int r = 0; r < kBlockM / 2; ++r) zero &= r0 + r >= a.C || __ldg(a.rows_src + r0 + r) == -1;
    return zero;
  };
  if constexpr (kAct) {
    auto on_acc = [&a](const auto& acc, const auto& mma, int b, int n, int mma_thread) {
      store_activation(a, acc, mma, b, n, mma_thread);
    };
    run_tiles<true>(
        p.tiles, ss, t, a.counters + row_blocks(a.C) + kTileQueue, wait_for_rows, drain,
        [](bool) {}, half_zero, &p.paired_b, on_acc, a.h != nullptr);
  } else {
    run_tiles(
        p.tiles, ss, t, a.counters + row_blocks(a.C) + kTileQueue, wait_for_rows, drain,
        [](bool) {}, half_zero);
  }
  if (ends_call) end_wait(a.ps, e, a.timeout_ns, kPhaseEnd);
  // The tiles' TMA stores complete before the block counts itself out: a fill must land after.
  bulk_stores_complete();
  poison::leave(a.ps, p.outputs);
}

}  // namespace

namespace {
template <bool kKMajorB>
Params<kKMajorB> params(const GatherGemmArgs& a) {
  Params<kKMajorB> p{};
  p.a = a;
  // (h not written still names memory in its descriptor, which nothing writes)
  p.tiles = tile_params<kKMajorB>(TileProblem{a.sizes, a.C, a.L, a.H, a.N}, a.xe, a.w,
                                  a.h != nullptr ? a.h : a.act);
  poison::add(p.outputs, a.xe, a.C * a.H * 2);
  if (a.h != nullptr) poison::add(p.outputs, a.h, a.C * a.N * 2);
  return p;
}
}  // namespace

std::string launch(const GatherGemmArgs& a, cudaStream_t stream) {
  const int grid = a.copy_blocks + a.gemm_blocks;
  if (a.h == nullptr && a.act == nullptr) return "h not written needs act";
  if (a.w_k_major) {
    if (a.act != nullptr) return "act: w must be [L, H, N] (w_k_major off)";
    return launch_kernel(&gather_gemm_kernel<false, true>, "fused gather + GEMM (w transposed)",
                         grid, params<true>(a), stream);
  }
  Params<false> p = params<false>(a);
  if (a.act == nullptr)
    return launch_kernel(&gather_gemm_kernel<false, false>, "fused gather + GEMM", grid, p, stream);
  if (a.N % kBlockN != 0) return "act: N must be a multiple of " + std::to_string(kBlockN);
  p.paired_b = paired_tma_b(a.w, a.H, a.N, a.L);
  poison::add(p.outputs, a.act, a.C * a.N);
  return launch_kernel(&gather_gemm_kernel<true, false>, "fused gather + GEMM + activation", grid,
                       p, stream);
}

}  // namespace fused
}  // namespace jax_ep
