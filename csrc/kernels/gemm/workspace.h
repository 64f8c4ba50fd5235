// The device workspace of one grouped-GEMM call: per-group arguments that the setup kernel
// writes (CUTLASS's pointer-array GEMMs read them), the FP8 row scales in CUTLASS's layout, and
// CUTLASS's own workspace. Its size has one owner, carve(); Python asks for it through
// jax_ep._C.grouped_gemm_workspace_bytes and passes a buffer of that size as the call's last
// result.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/gemm/grouped_gemm.h"

namespace jax_ep::gemm {

inline constexpr size_t kStrideBytes = 32;       // one CUTLASS stride, padded
inline constexpr size_t kScaleLayoutBytes = 64;  // one CUTLASS scale-factor layout, padded
inline constexpr long long kOutBytes = 2;        // outputs are bf16 or f16

struct Carved {
  long long* start = nullptr;  // [G + 1] first row of each group; [G]: rows used in all
  int* rows = nullptr;         // [G] rows of each group (clipped)
  void* shapes = nullptr;      // [G] CUTLASS problem shapes (M, N, K)
  const void** ptr_a = nullptr;
  const void** ptr_b = nullptr;
  void** ptr_d = nullptr;
  void* stride_a = nullptr;
  void* stride_b = nullptr;
  void* stride_d = nullptr;
  const float** ptr_sfa = nullptr;  // FP8 only
  const float** ptr_sfb = nullptr;
  void* layout_sfa = nullptr;
  void* layout_sfb = nullptr;
  float* sfa_t = nullptr;  // FP8: the row scales, [K/128, rows] per group
  void* cutlass = nullptr;
  size_t total = 0;  // bytes from the base
};

// Rows of lhs that carry scales (all of them): M, or G * C for the masked layout.
inline long long scale_rows(const GemmShape& s) {
  return s.mode == Mode::kMasked ? s.G * s.M : s.M;
}

// The layout of the workspace at `base` (nullptr: sizes only). Sub-buffers 256-byte aligned.
inline Carved carve(void* base, const GemmShape& s, size_t cutlass_bytes) {
  Carved w;
  size_t off = 0;
  auto take = [&](size_t bytes) -> void* {
    void* p = base ? static_cast<char*>(base) + off : nullptr;
    off += (bytes + 255) / 256 * 256;
    return p;
  };
  const size_t G = static_cast<size_t>(s.G);
  w.start = static_cast<long long*>(take((G + 1) * sizeof(long long)));
  w.rows = static_cast<int*>(take(G * sizeof(int)));
  w.shapes = take(G * 3 * sizeof(int));
  w.ptr_a = static_cast<const void**>(take(G * sizeof(void*)));
  w.ptr_b = static_cast<const void**>(take(G * sizeof(void*)));
  w.ptr_d = static_cast<void**>(take(G * sizeof(void*)));
  w.stride_a = take(G * kStrideBytes);
  w.stride_b = take(G * kStrideBytes);
  w.stride_d = take(G * kStrideBytes);
  if (s.dtype == Dtype::kFP8) {
    w.ptr_sfa = static_cast<const float**>(take(G * sizeof(void*)));
    w.ptr_sfb = static_cast<const float**>(take(G * sizeof(void*)));
    w.layout_sfa = take(G * kScaleLayoutBytes);
    w.layout_sfb = take(G * kScaleLayoutBytes);
    w.sfa_t = static_cast<float*>(take(static_cast<size_t>(scale_rows(s)) *
                                       static_cast<size_t>(s.K / kFp8Block) * sizeof(float)));
  }
  w.cutlass = take(cutlass_bytes);
  w.total = off;
  return w;
}

// After the setup kernel: the FP8 scale transpose and the zero fill (prologue.cu).
std::string launch_prologue(const Call& c, const Carved& w, cudaStream_t stream);

}  // namespace jax_ep::gemm
