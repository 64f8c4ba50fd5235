// The order of the fused kernels' tile queue (kernels/fused/tiles.cuh): which tile the q-th
// draw of the queue computes. Plain C++ with CUDA qualifiers: the kernels call it, and the
// extension exports it (jax_ep._C.fused_tile_order) so that tests check the order on any machine.
#pragma once

#if defined(__CUDACC__)
#define JAX_EP_TILE_ORDER_FN __host__ __device__ __forceinline__
#else
#define JAX_EP_TILE_ORDER_FN inline
#endif

namespace jax_ep {
namespace fused {

// block_start[l]: the first row block of expert l's segment (non-decreasing; an empty segment
// starts where the next one does); block_start[L]: the row blocks of all segments.

// The expert whose segment holds row block b: the largest l with block_start[l] <= b (an empty
// segment shares its start with the next one, which wins).
JAX_EP_TILE_ORDER_FN int expert_of(const int* block_start, int L, int b) {
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

// The tile that draw q (in [0, block_start[L] * col_blocks)) computes, as row block * col_blocks
// + column block. Experts go in order, and within an expert's segment the row blocks go in
// groups of `group` (the last one shorter), each group column by column: the tiles in flight at
// once share their weight columns and the group's rows, which stay in L2, where row-block order
// would read all of the expert's weights again for every few row blocks. Early rows are still
// computed first. group 1 is row-block order.
JAX_EP_TILE_ORDER_FN int tile_order(const int* block_start, int L, int col_blocks, int group,
                                    int q) {
  const int l = expert_of(block_start, L, q / col_blocks);
  const int start = block_start[l], rows = block_start[l + 1] - start;
  const int j = q - start * col_blocks;  // in [0, rows * col_blocks)
  const int first = j / (group * col_blocks) * group;
  const int in_group = rows - first < group ? rows - first : group;
  const int r = j - first * col_blocks;
  return (start + first + r % in_group) * col_blocks + r / in_group;
}

// The tile that draw q computes when the queue goes in chunks of `chunk_blocks` column blocks
// (the last chunk narrower): every tile of chunk c, over all row blocks, before any of chunk
// c + 1, and within a chunk tile_order's order over the chunk's columns. A chunk at least as wide
// as the row is tile_order itself.
JAX_EP_TILE_ORDER_FN int chunked_tile_order(const int* block_start, int L, int col_blocks,
                                            int chunk_blocks, int group, int q) {
  if (chunk_blocks >= col_blocks) return tile_order(block_start, L, col_blocks, group, q);
  const int per = block_start[L] * chunk_blocks;  // draws of a whole chunk
  const int c = q / per, first = c * chunk_blocks;
  const int cols = col_blocks - first < chunk_blocks ? col_blocks - first : chunk_blocks;
  const int t = tile_order(block_start, L, cols, group, q - c * per);
  return t / cols * col_blocks + first + t % cols;
}

}  // namespace fused
}  // namespace jax_ep

#undef JAX_EP_TILE_ORDER_FN
