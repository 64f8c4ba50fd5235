// Buffer sizes of the high-throughput ops that Python asks for (plain C++: the nanobind module
// includes it too).
#pragma once
#include <cstdint>

namespace jax_ep::ht {

// int32 words of the dispatch's scratch result for R ranks and T tokens (the layout kernel's
// per-chunk counts and offsets): the one definition, exported as jax_ep._C.ht_scratch_words.
inline int64_t ht_scratch_words(int64_t R, int64_t T) { return R * T + R * R + 64; }

// Per-process mode: the operands peers read are copied into a symmetric staging buffer, each
// at a 256-byte-aligned offset. How many leading operands each op stages, and the buffer size
// for given operand sizes: exported as jax_ep._C.ht_staged_operands / ht_stage_bytes.
constexpr int kStagedDispatch = 4;     // x, x_scales, topk_idx, topk_weights
constexpr int kStagedGather = 1;       // rows
constexpr int kStagedCombine = 1;      // y
constexpr int kStagedGatherGemm = 1;   // x (fused gather + grouped GEMM)
constexpr int kStagedGemmCombine = 0;  // one process only (fused grouped GEMM + combine)
inline int64_t stage_aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }
template <typename Sizes>
int64_t stage_bytes(const Sizes& operand_bytes) {
  int64_t total = 0;
  for (int64_t b : operand_bytes) total += stage_aligned(b);
  return total > 256 ? total : 256;
}

}  // namespace jax_ep::ht
