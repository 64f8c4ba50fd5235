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
// Columns of one GEMM tile.
constexpr int kBlockN = 256;
// Column blocks of an N-column output: the tiles that make one row block.
constexpr long long column_blocks(long long N) { return (N + kBlockN - 1) / kBlockN; }
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
// The same at every R and k (the signature is auto_combine_blocks').
inline int auto_copy_blocks(int share, int /*ranks*/, long long /*k*/) {
  const int c = share / 8;
  return c < 1 ? 1 : c;
}

// Words of the gather + GEMM's counters result for C expert-major rows (exported as
// jax_ep._C.fused_counter_words): one per row block (its rows arrived), then the words below, at
// the row blocks' count plus their index. The GEMM + combine has the same words after its
// per-chunk tile counters (combine_counter_words).
enum CounterWord : int {
  kTileQueue = 0,     // the GEMM tiles' queue: every block takes its tiles from it
  kTaskQueue = 1,     // the copy chunks' queue (gather + GEMM) or the combine's (GEMM + combine)
  kTokensDone = 2,    // GEMM + combine: tokens combined, once per chunk
  kTilesStarted = 3,  // GEMM + combine: tile blocks started
  kCounterTail = 4,
};
// Row blocks of C expert-major rows: the first words of the counters (int in the kernels).
template <class I>
constexpr I row_blocks(I C) {
  return (C + kBlockM - 1) / kBlockM;
}
constexpr long long counter_words(long long C) { return row_blocks(C) + kCounterTail; }

// Received rows of one pre-reduction task of the GEMM + combine: a warp sums each row's slots
// into one row per received token, then flags the task's rows.
constexpr int kReducedRowsPerTask = 4;
// Own tokens of one task of the GEMM + combine's second step.
constexpr int kTokensPerTask = 4;
// Column tiles of one chunk of the GEMM + combine: the tile queue goes chunk by chunk over every
// row block, and the combine sums each chunk's columns as soon as that chunk is computed, while
// the GEMM goes on with the next (docs/kernels.md#fused-combine-chunks).
constexpr int kChunkBlocks = 4;

// Column chunks of an N-column GEMM + combine.
constexpr long long combine_chunks(long long N) {
  return (column_blocks(N) + kChunkBlocks - 1) / kChunkBlocks;
}
// Words of the GEMM + combine's per-chunk tile counters: one per row block and chunk (the
// chunk's column tiles of that row block stored), at row block * chunks + chunk; the words of
// CounterWord follow them.
constexpr long long combine_tile_words(long long C, long long N) {
  return row_blocks(C) * combine_chunks(N);
}
// Tasks of one chunk of the GEMM + combine's first step (kReducedRowsPerTask received rows
// each) and of its second (kTokensPerTask tokens each).
constexpr long long reduce_tasks(long long Cr) {
  return (Cr + kReducedRowsPerTask - 1) / kReducedRowsPerTask;
}
constexpr long long token_tasks(long long T) { return (T + kTokensPerTask - 1) / kTokensPerTask; }
// Words of the GEMM + combine's counters for C expert-major rows, Cr received rows and N
// columns (exported as jax_ep._C.fused_combine_counter_words): the per-chunk tile counters, the
// words of CounterWord, then one flag per chunk and received row, at chunk * Cr + row (0: not
// yet summed; 1: no slot here, nothing written; else 2 + the row of the output where the sum
// is, the row of the received row's first slot here).
constexpr long long combine_counter_words(long long C, long long Cr, long long N) {
  return combine_tile_words(C, N) + kCounterTail + combine_chunks(N) * Cr;
}

// The automatic number of blocks that only combine, out of `share`, over `ranks` ranks, for a
// GEMM of inner dimension k (the rows' columns). Over several ranks an eighth of them (16 of an
// H200's 132): they pull each chunk's sums from the peers while the GEMM computes the next chunk
// (docs/kernels.md#fused-combine-chunks). At R = 1 the combine reads the GEMM's output back once
// (rows x N) while the GEMM spends rows x N x k on it, so the blocks that keep pace with the GEMM
// go as 1 / k: one per k / kCombinePaceK SMs (8 of 132 at k = 2048, the layer forward's I), at
// least one, at most an eighth; the tile blocks join the combine once their tiles are done
// (docs/kernels.md#fused-combine-blocks-r1).
constexpr long long kCombinePaceK = 128;
inline int auto_combine_blocks(int share, int ranks, long long k) {
  const long long most = share / 8;
  long long c = ranks > 1 ? most : share * kCombinePaceK / (k > 0 ? k : 1);
  if (c > most) c = most;
  return c < 1 ? 1 : static_cast<int>(c);
}

}  // namespace fused
}  // namespace jax_ep
