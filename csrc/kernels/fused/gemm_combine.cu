// The fused grouped GEMM + combine (gemm_combine.h, docs/kernels.md#fused-gemm-combine).
//
// One grid, all blocks co-resident (one per SM). Every block first publishes this rank's ye and
// counters (the pull protocol of transport/pull.cuh), and reads where its segments end.
// - Tile blocks (the last gemm_blocks) compute ye = a @ w per segment with CUTLASS's SM90
//   collectives in a loop of our own (kernels/fused/tiles.cuh; TMA-store epilogue), their queue
//   going chunk by chunk (kChunkBlocks column tiles, over every row block; chunked_tile_order).
//   The warp that issues a tile's TMA stores waits for their completion one tile later (by then
//   they are done) and counts the tile in shared memory (release); warp 1, otherwise idle, waits
//   for that count and adds 1 to the tile's (row block, chunk) counter (release; the combine's
//   first step reads it).
// - The combine, chunk by chunk, on the chunk's columns, in two steps:
//   1. Per received row of this rank, 4 rows at a time in row order: wait until the row blocks
//      of the row's slots have the chunk's column tiles here, sum w * row over the slots in
//      float32 and round once to bfloat16 (the unfused layer's pre-reduction per rank) into the
//      chunk of the row's first slot's row of ye, which only this warp reads, and has read
//      (no buffer of received rows); then flag each row for the chunk with where its sum is
//      (system-scope release; peers read the flags and ye).
//   2. Per token of this rank, 4 at a time in token order: for each rank s holding the token,
//      wait for its row's flag of the chunk on s, pull the chunk of the one row of ye there
//      that the flag names, and sum over ranks in rank order, in float32. A token crosses the
//      links once per rank that holds it, not once per slot.
//   With one rank the first step sums each own token's slots straight into out (zeros for a
//   token without a slot): ye keeps its products and there is no second step, whose sum over a
//   single rank would round a bfloat16 value to itself, so the result is the same bit for bit
//   (but for the sign of a zero: a sum that rounds to -0 stays -0, where the second step's
//   0 + -0 gave +0).
//   With an addend that is on, a token's sum is rounded to bfloat16, its addend row added in
//   float32, and the result rounded again (out_value); an addend that is off is never read.
//   The addend may share out's buffer (the layer aliases them).
//   A slot naming a row past the rank's last segment (only a tampered handle names one) adds
//   nothing, as the zero row it is in the unfused layer. The tasks come from one queue (an
//   atomic counter): chunk 0's first-step tasks, then its second-step ones, then chunk 1's, and
//   so on. The first combine_blocks blocks do only this, while the GEMM computes the next
//   chunks; the tile blocks' consumer warps join once their tiles are done. The combine-only
//   blocks then wait until every token is combined in every chunk and every tile block has
//   started (read the call's epoch), and end the call (end barrier), so no peer reads this
//   rank's buffers after it.
// - Rows of ye past the last segment are not written: no tile computes them, the combine reads
//   them as zeros without loading them, and nothing else reads ye (the layer's scratch; over
//   several ranks the rows that took a received row's sum hold it, not their product).
// The phase tracer of the call site's slot gets, per column chunk, the latest times a tile was
// stored and a task of either step ended (trace::kFused..., benchmarks/trace_phases.py --fused).
// Tile blocks never wait for the combine; the waits end because every block of every rank runs
// at once (one block per SM of the rank's share, launched on otherwise idle SMs: a kernel that
// held some of them would delay the waits until it ends, or until their timeout).
#define JAX_EP_WAITS_INLINE  // transport/peer.cuh: no function calls beside the wgmma
#include "kernels/fused/gemm_combine.h"

#include "kernels/fused/tiles.cuh"
#include "testing/mutations.h"
#include "transport/poison.cuh"

namespace jax_ep {
namespace fused {
namespace {

using namespace cute;
using namespace tiles;
constexpr int kUnroll = 2;  // int4 loads per lane and row, per pass over a token's rows
constexpr int kGroup = 8;   // rows loaded at once (kGroup * kUnroll loads in flight)
constexpr int kChunkVectors = kChunkBlocks * kBlockN / 8;  // int4 of a row in one chunk
// The second step's rows in flight at once, and int4 loads per lane and row in one pass: the
// first step's shape (a whole chunk of each row per pass, twice the loads, spilled registers).
constexpr int kPullRows = kGroup;
constexpr int kPullUnroll = kUnroll;
static_assert(kTokensPerTask * kMaxRanks <= 32, "a task's (token, rank) entries, one lane each");
static_assert(kReducedRowsPerTask <= 32, "a task's rows fit a mask");
static_assert(trace::kFusedEnd < kTraceSlots, "the phase tracer's marks fit a slot");

template <bool kKMajorB>
struct Params {
  TileParamsFor<kKMajorB> tiles;
  GemmCombineArgs a;
  poison::Outputs outputs;  // ye and out, filled when a wait on the device gave up
};

// What every rank published, for each rank.
struct PeerView {
  const uint8_t* ye[kMaxRanks];
  const int* counters[kMaxRanks];
  int end;  // rows in this rank's segments: a row at or past it is not computed (reads as zero)
};

// Where the words of the counters are (sizes.h, combine_counter_words: the same on every rank).
struct Layout {
  int chunks;      // column chunks
  int need_last;   // column tiles of the last chunk (every other chunk has kChunkBlocks)
  int64_t words;   // the CounterWord words
  int64_t flags;   // the first step's flags, one per received row and chunk (at chunk * Cr + row)
  int64_t n1, n2;  // first- and second-step tasks of one chunk (R = 1: token tasks, none)
  __device__ explicit Layout(const GemmCombineArgs& a)
      : chunks(static_cast<int>(combine_chunks(a.N))),
        need_last(static_cast<int>(column_blocks(a.N)) - (chunks - 1) * kChunkBlocks),
        words(combine_tile_words(a.C, a.N)),
        flags(words + kCounterTail),
        n1(direct(a) ? token_tasks(a.T) : reduce_tasks(a.Cr)),
        n2(direct(a) ? 0 : token_tasks(a.T)) {}
  // One rank: the first step sums each token's slots straight into out (ye keeps its products;
  // no second step, whose sum over one rank would round a bfloat16 value to itself).
  __device__ static bool direct(const GemmCombineArgs& a) { return a.ps.num_ranks == 1; }
  // The int4 range [lo, hi) of a row's columns in chunk c.
  __device__ int64_t lo(int c) const { return static_cast<int64_t>(c) * kChunkVectors; }
  __device__ int64_t hi(const GemmCombineArgs& a, int c) const {
    return min(a.N / 8, lo(c) + kChunkVectors);
  }
};

constexpr const char* kPhasePeers = "ht_gemm_combine: wait for peers";
constexpr const char* kPhaseTiles = "ht_gemm_combine: wait for a row block's tiles";
constexpr const char* kPhaseReduced = "ht_gemm_combine: wait for a peer's summed rows";
constexpr const char* kPhaseStored = "ht_gemm_combine: wait for a tile's stores";
constexpr const char* kPhaseTokens = "ht_gemm_combine: wait for every token's combine";
constexpr const char* kPhaseStarted = "ht_gemm_combine: wait for every tile block's start";
constexpr const char* kPhaseEnd = "ht_gemm_combine: end barrier";

// acc[0..8) += w * the 8 bfloat16 of v, product then sum rounded apart (no contraction: the
// unfused combine's weighting multiplies, then sums).
__device__ __forceinline__ void add_weighted(float* acc, float w, int4 v) {
  const ht::Words4 h = ht::words(v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = ht::bf16x2_to_float2(h.w[i]);
    acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w, f.x));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w, f.y));
  }
}

// The 8 columns of `sum` stored to out: their bfloat16 rounding, or with an addend row (the
// layer's extra passes, docs/design.md#layer-passes-early) that rounding plus the addend's 8
// values at vector v, in float32, rounded again. The addend may be out itself: the element is
// loaded here, before the caller stores over it (plain loads: not the read-only path).
__device__ __forceinline__ int4 out_value(const float* sum, const int4* addend_row, int64_t v) {
  const int4 r = ht::pack_bf16x8(sum);
  if (addend_row == nullptr) return r;
  float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  ht::add_bf16x8(f, r);
  ht::add_bf16x8(f, addend_row[v]);
  return ht::pack_bf16x8(f);
}

// Token t's addend row, or null when the call has none or it is off.
__device__ __forceinline__ const int4* addend_row(const GemmCombineArgs& a, int64_t t) {
  if (a.addend == nullptr || (!*a.addend_on && !JAX_EP_PLANTED(kAddendIgnoresOn))) return nullptr;
  return reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.addend) + t * a.N * 2);
}

// first[i] of a task's rows, read without indexing the array by a variable (which would put it
// in local memory).
template <class I>
__device__ __forceinline__ int first_of(const int (&first)[kReducedRowsPerTask], I i) {
  int f = -1;
#pragma unroll
  for (int q = 0; q < kReducedRowsPerTask; ++q)
    if (q == i) f = first[q];
  return f;
}

// A first-step task, one warp: received rows [c0, c0 + kReducedRowsPerTask), the columns of
// chunk `ch`. The bfloat16 rounding of sum over the slots k of row c (in slot order, float32)
// of weights[c, k] * ye[row_of[c, k]], once those rows' tiles of the chunk are stored here,
// goes into ye[f], f the row of c's first slot here: ye's rows each belong to one received row
// (two slots naming one expert name one row), so no other warp reads f, and each lane stores
// its columns of f after loading them. A row without a slot here writes nothing. Then each row's
// flag of the chunk (f + 2, or 1 without a slot; system-scope release). The waits of every slot
// of the task's rows come first, 32 at a time, so that a row's loads follow no wait of their own.
// When the task has at most 32 entries (top-k up to 8, or a last task of fewer rows up to 32),
// the lanes that waited keep their entry's row and weight, and each row's sum takes them from
// there: the index arrays are read once a task, not again per pass over a row (each wait's
// acquire invalidates the SM's L1, so a second read goes to L2:
// docs/kernels.md#fused-kernels-profiled).
// With one rank (Layout::direct) the task's rows are those of own tokens [c0, c0 +
// kTokensPerTask) (send_rows) and each sum goes to out[t], zeros for a token without a slot; no
// flag, the tokens counted in *done instead. False when a wait gave up.
__device__ bool reduce_task(const GemmCombineArgs& a, const Layout& lay, int end, int ch,
                            int64_t c0, int lane, int* done) {
  static_assert(kTokensPerTask == kReducedRowsPerTask, "one task shape for either kind of row");
  const bool direct = Layout::direct(a);
  const int K = a.K;
  const int64_t N = a.N, lo = lay.lo(ch), hi = lay.hi(a, ch);
  const int need = ch == lay.chunks - 1 ? lay.need_last : kChunkBlocks;
  const auto* ye = static_cast<const uint8_t*>(a.ye);
  // (the handler keeps N within an int, so a row's bytes fit 32 bits unsigned)
  const uint32_t row_bytes = static_cast<uint32_t>(N * 2);
  auto* dst_base = static_cast<uint8_t*>(direct ? a.out : a.ye);
  const Waiter me = waiter(a.ps);
  const int64_t c1 = min(c0 + kReducedRowsPerTask, static_cast<int64_t>(direct ? a.T : a.Cr));
  // The task's received rows: its own (c0 + i), or (direct) its tokens' (-1: none)
  auto row = [&a, direct, c0](int64_t i) -> int64_t {
    if (!direct) return c0 + i;
    const int r = ht::ld_nc_s32(a.send_rows + c0 + i);
    return r < a.Cr ? r : -1;
  };
  // The task's (row, slot) entries, lane e % 32 holding entry e (row e / K, slot e % K).
  const int64_t ne = (c1 - c0) * K;
  // Entries of a task of at most 32, each in its lane from the waits: its row of ye (-1: none
  // or past the segments) and its weight.
  const bool kept = ne <= 32;
  int kept_j = -1;
  float kept_w = 0.f;
  unsigned int held = 0;           // the task's rows with a slot here (bit c - c0)
  int first[kReducedRowsPerTask];  // per row: the row of its first slot here, or -1 (uniform)
#pragma unroll
  for (int i = 0; i < kReducedRowsPerTask; ++i) first[i] = -1;
  for (int64_t base = 0; base < ne; base += 32) {
    const int64_t e = base + lane;
    int j = -1;
    if (e < ne) {
      const int64_t c = row(e / K);
      if (c >= 0) j = ht::ld_nc_s32(a.row_of + c * K + e % K);
      if (j >= end) j = -1;  // past the segments (a tampered handle): a zero row
      if (kept && j >= 0) kept_w = ht::ld_nc_f32(a.weights + c * K + e % K);
    }
    kept_j = j;
    bool good = true;
    if (j >= 0 && !JAX_EP_PLANTED(kCombineSkipsTiles))
      good = wait_count_geq(me, a.timeout_ns, kPhaseTiles, -1, need,
                            [p = a.counters + static_cast<int64_t>(j / kBlockM) * lay.chunks + ch] {
                              return ld_acquire_gpu(p);
                            });
    held |= __reduce_or_sync(kFull, j >= 0 ? 1u << (e / K) : 0u);
    if (!direct) {  // (direct: each sum goes to out, not to a slot's row)
#pragma unroll
      for (int i = 0; i < kReducedRowsPerTask; ++i) {
        const unsigned int m = __ballot_sync(kFull, j >= 0 && e / K == i);
        if (JAX_EP_PLANTED(kSumInLastSlot)) {
          const int f = __shfl_sync(kFull, j, m != 0 ? 31 - __clz(m) : 0);
          if (m != 0) first[i] = f;
          continue;
        }
        const int f = __shfl_sync(kFull, j, m != 0 ? __ffs(m) - 1 : 0);
        if (m != 0 && first[i] < 0) first[i] = f;
      }
    }
    if (!__all_sync(kFull, good)) return false;
  }
  __syncwarp();  // orders each lane's acquire before every lane's loads of the rows
  for (int64_t i = 0; i < c1 - c0; ++i) {
    const bool has = held >> i & 1u;
    if (!has && !direct) continue;
    const int fi = first_of(first, i);
    uint8_t* dst = dst_base + (direct ? c0 + i : static_cast<int64_t>(fi)) * N * 2;
    const int4* add = direct ? addend_row(a, c0 + i) : nullptr;
    const int64_t c = has && !kept ? row(i) : -1;  // (kept: not needed)
    for (int64_t v0 = lo; v0 < hi; v0 += 32 * kUnroll) {
      const int64_t i0 = v0 + lane;
      // this lane's vectors of the pass: u below `in` (a 32-bit compare, once a pass)
      const int in = static_cast<int>(min(hi - i0, static_cast<int64_t>(32 * kUnroll)));
      const uint8_t* ye_i0 = ye + i0 * 16;  // column i0 of ye's row 0: a row adds j * row_bytes
      float part[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) part[u][q] = 0.f;
      for (int base = 0; has && base < K; base += 32) {
        int mj = -1;
        float mw = 0.f;
        if (kept) {  // warp-uniform (K <= 32, so base is 0): entry i * K + lane, from its lane
          const int64_t row_i = JAX_EP_PLANTED(kKeptEntriesShifted) ? i + 1 : i;
          // (the mask wraps only for lanes past K, masked below)
          const int src = static_cast<int>((row_i * K + lane) & 31);
          mj = __shfl_sync(kFull, kept_j, src);
          mw = __shfl_sync(kFull, kept_w, src);
          if (lane >= K) mj = -1;
        } else if (base + lane < K) {
          mj = ht::ld_nc_s32(a.row_of + c * K + base + lane);
          mw = ht::ld_nc_f32(a.weights + c * K + base + lane);
          if (mj >= end) mj = -1;
        }
        const int n =
            JAX_EP_PLANTED(kCombineOneSlotGroup) ? min(kGroup, K - base) : min(32, K - base);
        // kGroup slots' rows in flight at once, summed in slot order.
        for (int q0 = 0; q0 < n; q0 += kGroup) {  // warp-uniform
          int j[kGroup];
          float w[kGroup];
          int4 v[kGroup][kUnroll];
#pragma unroll
          for (int g = 0; g < kGroup; ++g) {
            const int q = min(q0 + g, 31);
            j[g] = __shfl_sync(kFull, mj, q);
            w[g] = __shfl_sync(kFull, mw, q);
            if (q0 + g >= n) j[g] = -1;
            if (j[g] < 0) continue;
            // (j >= 0: one wide multiply-add for the address)
            const int4* src = reinterpret_cast<const int4*>(
                ye_i0 + static_cast<uint64_t>(static_cast<uint32_t>(j[g])) * row_bytes);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
              if (u * 32 < in) v[g][u] = ht::ld_cg_v4(src + u * 32);
          }
#pragma unroll
          for (int g = 0; g < kGroup; ++g) {
            if (j[g] < 0) continue;
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
              if (u * 32 < in) add_weighted(part[u], w[g], v[g][u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (u * 32 < in)
          reinterpret_cast<int4*>(dst)[i0 + u * 32] = out_value(part[u], add, i0 + u * 32);
    }
  }
  if (direct) {
    *done += static_cast<int>(c1 - c0);
    if (lane == 0 && ch < trace::kFusedTracedChunks) {
      trace_max(a.ps, trace::kFusedChunkReduced + ch);
      trace_max(a.ps, trace::kFusedChunkCombined + ch);
    }
    return true;
  }
  __syncwarp();  // every lane's stores before the releases
  if (lane < c1 - c0)
    st_release_sys_s32(a.counters + lay.flags + ch * static_cast<int64_t>(a.Cr) + c0 + lane,
                       first_of(first, lane) + 2);
  if (lane == 0 && ch < trace::kFusedTracedChunks) trace_max(a.ps, trace::kFusedChunkReduced + ch);
  return true;
}

// A second-step task, one warp: own tokens [t0, t0 + kTokensPerTask), the columns of chunk
// `ch`: for each rank s holding the token, wait for its row's flag of the chunk on s, pull the
// chunk of the row of ye there that the flag names, and sum over ranks in rank order, in
// float32. The task's (token, rank) entries are one lane each (e = token * R + rank, as in
// send_rows): every wait first, then their rows kPullRows at a time, whatever their tokens,
// summed token by token.
// *done: tokens combined. False when a wait gave up.
__device__ bool combine_task(const GemmCombineArgs& a, const PeerView& pv, const Layout& lay,
                             int ch, int64_t t0, int lane, int* done) {
  const int R = a.ps.num_ranks;
  const int64_t N = a.N, lo = lay.lo(ch), hi = lay.hi(a, ch);
  const int64_t flags = lay.flags + ch * static_cast<int64_t>(a.Cr);
  const Waiter me = waiter(a.ps);
  const int64_t t1 = min(t0 + kTokensPerTask, static_cast<int64_t>(a.T));
  const int ne = static_cast<int>(t1 - t0) * R;
  // Lane e < ne: token t0 + e / R's received row on rank e % R (-1: none), once that rank
  // summed it; then the row of that rank's ye that holds the sum (-1: no slot there).
  int r = lane < ne ? ht::ld_nc_s32(a.send_rows + t0 * R + lane) : -1;
  if (r >= a.Cr) r = -1;
  bool good = true;
  if (r >= 0) {
    const int* f = pv.counters[lane % R] + flags + r;
    int v = 0;
    if (JAX_EP_PLANTED(kCombineSkipsSummed))
      v = ld_acquire_sys_s32(f);  // not yet flagged (0): taken as no slot
    else
      good = wait_count_geq(me, a.timeout_ns, kPhaseReduced, lane % R, 1,
                            [f, &v] { return v = ld_acquire_sys_s32(f); });
    r = v - 2;
  }
  const bool ok = __all_sync(kFull, good);
  __syncwarp();  // orders each lane's acquire before every lane's loads of the rows
  if (!ok) return false;
  for (int64_t v0 = lo; v0 < hi; v0 += 32 * kPullUnroll) {
    const int64_t i0 = v0 + lane;
    float total[kPullUnroll][8];
    for (int e0 = 0; e0 < ne; e0 += kPullRows) {  // warp-uniform
      int4 v[kPullRows][kPullUnroll];
      int rs[kPullRows];
#pragma unroll
      for (int g = 0; g < kPullRows; ++g) {
        const int e = e0 + g;
        rs[g] = __shfl_sync(kFull, r, e & 31);
        if (e >= ne || rs[g] < 0) {
          rs[g] = -1;
          continue;
        }
        const int4* row =
            reinterpret_cast<const int4*>(pv.ye[e % R] + static_cast<int64_t>(rs[g]) * N * 2);
#pragma unroll
        for (int u = 0; u < kPullUnroll; ++u)
          if (i0 + u * 32 < hi) v[g][u] = ht::ld_cg_v4(row + i0 + u * 32);
      }
#pragma unroll
      for (int g = 0; g < kPullRows; ++g) {
        const int e = e0 + g;
        if (e >= ne) break;
        const int s = e % R;
        if (s == 0) {  // the token's first rank: its sum starts
#pragma unroll
          for (int u = 0; u < kPullUnroll; ++u)
#pragma unroll
            for (int i = 0; i < 8; ++i) total[u][i] = 0.f;
        }
        if (rs[g] >= 0) {
#pragma unroll
          for (int u = 0; u < kPullUnroll; ++u)
            if (i0 + u * 32 < hi) ht::add_bf16x8(total[u], v[g][u]);
        }
        if (s == R - 1) {  // the token's last rank: its sum is stored
          auto* dst = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.out) + (t0 + e / R) * N * 2);
          const int4* add = addend_row(a, t0 + e / R);
#pragma unroll
          for (int u = 0; u < kPullUnroll; ++u)
            if (i0 + u * 32 < hi) dst[i0 + u * 32] = out_value(total[u], add, i0 + u * 32);
        }
      }
    }
  }
  *done += static_cast<int>(t1 - t0);
  if (lane == 0 && ch < trace::kFusedTracedChunks) trace_max(a.ps, trace::kFusedChunkCombined + ch);
  return true;
}

// The combine, one warp: tasks from one queue, chunk by chunk, each chunk's first-step tasks
// before its second-step ones, until none is left; then the warp adds the tokens it combined
// (once per chunk) to the done counter (release). A first-step task waits only for tiles here,
// which wait for nothing; a second-step task of chunk c waits only for first-step tasks of chunk
// c, which every rank's queue hands out before it: so every wait ends. False when a wait gave up.
__device__ bool combine(const GemmCombineArgs& a, const PeerView& pv, int lane) {
  const Layout lay(a);
  const int64_t per = lay.n1 + lay.n2, tasks = per * lay.chunks;
  int* queue = a.counters + lay.words + kTaskQueue;
  int done = 0;
  bool ok = true;
  for (int64_t i; ok && (i = warp_ticket(queue, lane)) < tasks;) {
    const int ch = static_cast<int>(i / per);
    const int64_t r = i - ch * per;
    ok = r < lay.n1 ? reduce_task(a, lay, pv.end, ch, r * kReducedRowsPerTask, lane, &done)
                    : combine_task(a, pv, lay, ch, (r - lay.n1) * kTokensPerTask, lane, &done);
  }
  __syncwarp();  // every lane's stores before lane 0's release
  if (lane == 0 && done > 0) red_release_gpu_add(a.counters + lay.words + kTokensDone, done);
  return ok;
}

// ------------------------------------------------------------------------------------------
// Combine-only blocks: combine, then end the call.
// ------------------------------------------------------------------------------------------
__device__ void combine_role(const GemmCombineArgs& a, const PeerView& pv, unsigned long long e) {
  const int tid = threadIdx.x, lane = tid & 31;
  combine(a, pv, lane);
  __syncthreads();
  // Every token combined in every chunk, and every tile block past its start (it reads the
  // call's epoch there, which the end barrier advances).
  if (tid == 0) {
    const Layout lay(a);
    const int* c = a.counters + lay.words;
    if (wait_count_geq(waiter(a.ps), a.timeout_ns, kPhaseTokens, -1, a.T * lay.chunks,
                       [c] { return ld_acquire_gpu(c + kTokensDone); }))
      wait_count_geq(waiter(a.ps), a.timeout_ns, kPhaseStarted, -1, a.gemm_blocks,
                     [c] { return ld_acquire_gpu(c + kTilesStarted); });
  }
  end_barrier(
      a.ps, e, a.timeout_ns, kPhaseEnd, [] {}, -1, static_cast<unsigned int>(a.combine_blocks));
  trace_mark(a.ps, trace::kFusedEnd);
}

// ------------------------------------------------------------------------------------------
// Tile blocks: the tiles, then the combine in the consumer warps.
// ------------------------------------------------------------------------------------------
template <class P>
__device__ void tile_role(const P& p, SharedStorage& ss, const PeerView& pv) {
  const GemmCombineArgs& a = p.a;
  const int lane = threadIdx.x & 31;
  // Warp 1: each tile's row-block counter once its stores are complete.
  const int chunks = static_cast<int>(combine_chunks(a.N));
  auto signal = [&a, &ss, chunks, lane](TileRing& ring) {
    const Waiter me = waiter(a.ps);
    unsigned int k = 0;
    bool ok = true;
    for (int i; (i = ring.next(lane)) >= 0;) {
      if (lane != 0 || !ok) continue;
      // the poll backs off: its issue slots belong to the MMA warps
      ok = wait_count_geq(me, a.timeout_ns, kPhaseStored, -1, ++k, [&ss] {
        __nanosleep(64);
        return ld_acquire_cta_shared(&ss.stored);
      });
      // Cumulative: the stores, seen complete through the shared count, are ordered before
      // the counter's release to every GPU.
      if (!ok) continue;
      const int ch = (i % ring.col_blocks) / kChunkBlocks;
      red_release_sys_add(a.counters + static_cast<int64_t>(i / ring.col_blocks) * chunks + ch, 1);
      if (ch < trace::kFusedTracedChunks) trace_max(a.ps, trace::kFusedChunkStored + ch);
    }
  };
  // Consumer warp 0 issues a tile's TMA stores; once they are complete it counts the tile
  // (release), one tile late: by then they are, and nothing waits.
  auto count_stored = [&ss, lane](bool stored) {
    if (!stored || threadIdx.x >= cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp)
      return;
    bulk_stores_complete();
    __syncwarp();
    if (lane == 0) red_release_cta_shared_add(&ss.stored, 1u);
  };
  const TileProblem t{a.sizes, a.C, a.L, a.I, a.N, kChunkBlocks};
  if (run_tiles(
          p.tiles, ss, t, a.counters + combine_tile_words(a.C, a.N) + kTileQueue, [](int) {},
          signal, count_stored, nullptr)) {
    if (threadIdx.x == cutlass::NumThreadsPerWarpGroup) trace_max(a.ps, trace::kFusedTilesDone);
    combine(a, pv, lane);
  }
}

template <class P>
__device__ __forceinline__ void gemm_combine(const P& p) {
  const GemmCombineArgs& a = p.a;
  const unsigned long long e = call_epoch(a.ps);
  __shared__ PeerView pv;
  const void* ptrs[2] = {a.ye, a.counters};
  const bool ok = ht::publish_and_wait(a.ps, ptrs, 2, e, a.timeout_ns, kPhasePeers);
  const int R = a.ps.num_ranks, tid = threadIdx.x;
  const bool tile_block = static_cast<int>(blockIdx.x) >= a.combine_blocks;
  if (tile_block && tid == 0)
    red_release_gpu_add(a.counters + combine_tile_words(a.C, a.N) + kTilesStarted, 1);
  if (!ok) return;
  trace_mark(a.ps, trace::kFusedStart);
  if (tid < R) {
    pv.ye[tid] = peer_ptr<const uint8_t>(a.ps, tid, 0);
    pv.counters[tid] = peer_ptr<const int>(a.ps, tid, 1);
  }
  if (tid < 32) {  // warp 0: where this rank's segments end
    const int end = rows_in_segments(a.sizes, a.L, a.C, tid);
    if (tid == 0) pv.end = end;
  }
  __syncthreads();
  if (!tile_block) {
    combine_role(a, pv, e);
    return;
  }
  extern __shared__ uint8_t smem_raw[];
  tile_role(p, shared_storage(smem_raw), pv);
}

// Every block, also one that ended early, leaves through the poison step, its TMA stores
// complete first (a fill must land after them).
template <bool kKMajorB>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_combine_kernel(const __grid_constant__ Params<kKMajorB> p) {
  gemm_combine(p);
  bulk_stores_complete();
  poison::leave(p.a.ps, p.outputs);
}

}  // namespace

namespace {
template <bool kKMajorB>
std::string launch_for(const GemmCombineArgs& a, const char* name, cudaStream_t stream) {
  Params<kKMajorB> p{};
  p.a = a;
  p.tiles =
      tile_params<kKMajorB>(TileProblem{a.sizes, a.C, a.L, a.I, a.N, kChunkBlocks}, a.a, a.w, a.ye);
  poison::add(p.outputs, a.ye, a.C * a.N * 2);
  poison::add(p.outputs, a.out, a.T * a.N * 2);
  return launch_kernel(&gemm_combine_kernel<kKMajorB>, name, a.combine_blocks + a.gemm_blocks, p,
                       stream);
}
}  // namespace

std::string launch(const GemmCombineArgs& a, cudaStream_t stream) {
  return a.w_k_major ? launch_for<true>(a, "fused GEMM + combine (w transposed)", stream)
                     : launch_for<false>(a, "fused GEMM + combine", stream);
}

}  // namespace fused
}  // namespace jax_ep
