// Sizes and settings of the fused gather + grouped GEMM (kernels/fused/gather_gemm.h) that the
// handler and the Python side share (exported as jax_ep._C.fused_block_rows). Plain C++.
#pragma once

namespace jax_ep {
namespace fused {

// Rows of one GEMM tile and of one arrival counter; expert segments start at multiples of it
// (the expert-major layout's alignment on this path, exported to Python).
constexpr int kBlockM = 128;
// Threads of a block, in either role (one producer and two consumer warpgroups).
constexpr int kThreads = 384;
// Most local experts (their segment starts sit in shared memory).
constexpr int kMaxExperts = 1024;

// The automatic number of copy blocks out of `share` blocks (one per SM): an eighth of them
// (16 of an H200's 132). A copy block moves rows through registers at about 60 GB/s, so fewer
// leave the tiles waiting for rows (measured at R = 1: 8 blocks 1.3x slower, 2 blocks 3.9x;
// docs/kernels.md#fused-gather-gemm).
inline int auto_copy_blocks(int share) {
  const int c = share / 8;
  return c < 1 ? 1 : c;
}

// Words of the fused GEMM + combine's counters result for C expert-major rows: one per row block
// (its column tiles stored), then the token queue, the tokens combined and the tile blocks
// started (exported as jax_ep._C.fused_counter_words).
inline long long counter_words(long long C) { return (C + kBlockM - 1) / kBlockM + 3; }

// The automatic number of blocks that only combine, out of `share`: one (it also ends the call);
// the tile blocks join the combine once their tiles are done, so at R = 1 the GEMM keeps all the
// other SMs (docs/kernels.md#fused-gemm-combine).
inline int auto_combine_blocks(int share) {
  (void)share;
  return 1;
}

}  // namespace fused
}  // namespace jax_ep
