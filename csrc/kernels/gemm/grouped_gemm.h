// Grouped GEMMs for the experts: the interface between the FFI handler (csrc/ffi/grouped_gemm.cc)
// and the CUTLASS instantiations (variants.cu, inst_*.cu). No CUTLASS here, so the handler
// compiles fast and builds without CUTLASS too (then `built()` is false).
//
// One call computes, for every group g (G groups, shapes static, group sizes on the device):
//   kContiguous:  out[rows of g] = lhs[rows of g] @ op(rhs[g])       lhs [M, K], out [M, N]
//   kMasked:      out[g, :count_g] = lhs[g, :count_g] @ op(rhs[g])    lhs [G, C, K], out [G, C, N]
//   kTransposed:  out[g] = lhs[rows of g]^T @ rhs2[rows of g]         lhs [M, K], rhs2 [M, N],
//                                                                      out [G, K, N]
//                 (with row_counts, only the first row_counts[g] rows of group g: the rest of
//                 its segment is padding, skipped; with accumulate, out[g] += the product, in
//                 float32 before the one rounding, and a group without rows keeps out[g])
// op(rhs[g]) is rhs[g] for rhs [G, K, N] (rhs_kn) or rhs[g]^T for rhs [G, N, K]. The rows of group
// g in the contiguous layouts start at the sum of the earlier (non-negative) group sizes and are
// clipped to [0, M). Every output element outside the groups' rows is written with zeros
// (kMasked with zero_padding false: the rows past each count are left as they were).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_ep::gemm {

enum class Mode : int { kContiguous = 0, kMasked = 1, kTransposed = 2 };
enum class Dtype : int { kBF16 = 0, kF16 = 1, kFP8 = 2 };

// FP8 block sizes: activations carry one float32 scale per row and 128 columns ([M, K/128]),
// weights one per 128 x 128 block ([G, K/128, N/128]).
inline constexpr int kFp8Block = 128;

// Operand geometry of one call. M: rows of lhs (kContiguous, kTransposed) or the capacity C of
// each group (kMasked).
struct GemmShape {
  Mode mode = Mode::kContiguous;
  Dtype dtype = Dtype::kBF16;
  bool rhs_kn = true;        // rhs [G, K, N] (true) or [G, N, K] (false)
  bool small_m = false;      // the tile shape for few rows per group (64-row tiles)
  bool zero_padding = true;  // kMasked: write zeros past each count (else leave those rows)
  bool accumulate = false;   // kTransposed: add the product to out's contents
  int64_t G = 0, M = 0, K = 0, N = 0;
};

struct Call {
  GemmShape s;
  const void* lhs = nullptr;            // [M, K] or [G, C, K]
  const void* rhs = nullptr;            // [G, K, N] / [G, N, K]; kTransposed: rhs2 [M, N]
  const int32_t* sizes = nullptr;       // [G] group sizes (kMasked: counts)
  const int32_t* row_counts = nullptr;  // kTransposed: [G] rows of each group to use, or null
  const float* lhs_scales = nullptr;    // FP8: [M, K/128] or [G, C, K/128]
  const float* rhs_scales = nullptr;    // FP8: [G, K/128, N/128]
  void* out = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int device = 0;
  int sm_count = 0;
};

// True when the CUTLASS kernels are compiled in.
bool built();
// Empty when a kernel exists for the shape, else why not (names the operand).
std::string unsupported(const GemmShape& s);
// Bytes of device workspace a call of this shape needs on a device with `sm_count` SMs.
size_t workspace_bytes(const GemmShape& s, int sm_count);
// Enqueue the call on `stream`; empty on success, else the error.
std::string run(const Call& c, cudaStream_t stream);

}  // namespace jax_ep::gemm
