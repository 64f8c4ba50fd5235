// Sizes and settings of the fused kernels (kernels/fused/) that the handler and the Python side
// share (exported as jax_ep._C.fused_block_rows, fused_max_dups, fused_counter_words and
// fused_raster_row_blocks).
// Plain C++.
#pragma once

namespace jax_ep {
namespace fused {

// Rows of one GEMM tile and of one arrival counter; expert segments start at multiples of it
// (the expert-major layout's alignment on this path, exported to Python).
constexpr int kBlockM = 128;
// Row blocks of a group of the tile queue: within an expert's segment the tiles go column by
// column over this many row blocks at a time (kernels/fused/tile_order.h; exported as
// jax_ep._C.fused_raster_row_blocks; docs/kernels.md#fused-tile-order).
constexpr int kRasterRowBlocks = 8;
// Threads of a block, in either role (one producer and two consumer warpgroups).
constexpr int kThreads = 384;
// Most local experts (their segment starts sit in shared memory).
constexpr int kMaxExperts = 1024;
// Most copies a token's first row writes for the other rows of the same token (one per lane of
// the warp that copies the row: the width of rows_dups, exported as jax_ep._C.fused_max_dups).
constexpr int kMaxDups = 32;

// The automatic number of copy blocks out of `share` blocks (one per SM): an eighth of them
// (16 of an H200's 132). They take tiles too once the rows are copied, so more copy blocks cost
// the GEMM only while rows are still arriving (docs/kernels.md#fused-gather-gemm).
inline int auto_copy_blocks(int share) {
  const int c = share / 8;
  return c < 1 ? 1 : c;
}

// Words of a fused kernel's counters result for C expert-major rows (exported as
// jax_ep._C.fused_counter_words): one per row block (its rows arrived, or its column tiles
// stored), then the words below, at the row blocks' count plus their index.
enum CounterWord : int {
  kTileQueue = 0,     // the GEMM tiles' queue: every block takes its tiles from it
  kTaskQueue = 1,     // the copy chunks' queue (gather + GEMM) or the tokens' (GEMM + combine)
  kTokensDone = 2,    // GEMM + combine: tokens combined
  kTilesStarted = 3,  // GEMM + combine: tile blocks started
  kTailQueue = 4,     // gather + GEMM: the chunks of rows past the last segment, to zero
  kReduceQueue = 5,   // GEMM + combine: the received rows' queue (their pre-reduction)
  kCounterTail = 6,
};
// Row blocks of C expert-major rows: the first words of the counters (int in the kernels).
template <class I>
constexpr I row_blocks(I C) {
  return (C + kBlockM - 1) / kBlockM;
}
constexpr long long counter_words(long long C) { return row_blocks(C) + kCounterTail; }

// Received rows of one pre-reduction task of the GEMM + combine: a warp sums each row's slots
// into one row per received token, then flags the task's rows at once.
constexpr int kReducedRowsPerTask = 4;
// Words of the GEMM + combine's counters for C expert-major rows and Cr received rows (exported
// as jax_ep._C.fused_combine_counter_words): counter_words(C), then one flag per task of
// kReducedRowsPerTask received rows (0: not yet summed; else 1 + the mask of its rows that have
// no slot here, and so no row written).
constexpr long long combine_counter_words(long long C, long long Cr) {
  return counter_words(C) + (Cr + kReducedRowsPerTask - 1) / kReducedRowsPerTask;
}

// The automatic number of blocks that only combine, out of `share`: one (it also ends the call);
// the tile blocks join the combine once their tiles are done, so at R = 1 the GEMM keeps all the
// other SMs (docs/kernels.md#fused-gemm-combine).
inline int auto_combine_blocks(int share) {
  (void)share;
  return 1;
}

}  // namespace fused
}  // namespace jax_ep
