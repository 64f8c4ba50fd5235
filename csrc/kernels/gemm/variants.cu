// Which CUTLASS variant serves a call, its workspace, and the call itself (grouped_gemm.h).
// Built without CUTLASS (JAX_EP_WITH_GEMM unset), every call reports that.
#include <string>

#include "kernels/gemm/grouped_gemm.h"
#include "kernels/gemm/workspace.h"
#ifdef JAX_EP_WITH_GEMM
#include "kernels/gemm/variants.h"
#endif

namespace jax_ep::gemm {
namespace {

enum Variant : int {
#define JAX_EP_GEMM_ENUM(name) k_##name,
#ifdef JAX_EP_WITH_GEMM
  JAX_EP_GEMM_VARIANTS(JAX_EP_GEMM_ENUM)
#endif
#undef JAX_EP_GEMM_ENUM
      kNumVariants
};

[[maybe_unused]] int select(const GemmShape& s) {
#ifdef JAX_EP_WITH_GEMM
  if (s.dtype == Dtype::kFP8) return s.small_m ? k_fp8_fwd_small : k_fp8_fwd;
  const bool bf16 = s.dtype == Dtype::kBF16;
  if (s.mode == Mode::kTransposed && s.accumulate) return bf16 ? k_bf16_tgrad_acc : k_f16_tgrad_acc;
  if (s.mode == Mode::kTransposed) return bf16 ? k_bf16_tgrad : k_f16_tgrad;
  if (!s.rhs_kn) return bf16 ? k_bf16_fwd_nk : k_f16_fwd_nk;
  if (s.small_m) return bf16 ? k_bf16_fwd_small : k_f16_fwd_small;
  return bf16 ? k_bf16_fwd : k_f16_fwd;
#else
  (void)s;
  return -1;
#endif
}

}  // namespace

bool built() {
#ifdef JAX_EP_WITH_GEMM
  return true;
#else
  return false;
#endif
}

std::string unsupported(const GemmShape& s) {
  if (!built())
    return "jax_ep was built without CUTLASS (the nvidia-cutlass package or JAX_EP_CUTLASS_DIR): "
           "no grouped-GEMM kernels";
  const long long lim = (1LL << 31) - 1;
  if (s.G < 1 || s.G > 65535) return "rhs: G must be in [1, 65535], got " + std::to_string(s.G);
  if (s.M < 0 || s.M > lim || s.K < 1 || s.K > lim || s.N < 1 || s.N > lim)
    return "shapes must be in [1, 2^31) (M, K, N = " + std::to_string(s.M) + ", " +
           std::to_string(s.K) + ", " + std::to_string(s.N) + ")";
  if (s.mode == Mode::kMasked && s.G * s.M > lim) return "lhs: G * C must be < 2^31";
  if (s.accumulate && s.mode != Mode::kTransposed)
    return "accumulate applies to mode 2 (the weight gradient) only";
  if (s.dtype == Dtype::kFP8) {
    if (s.mode == Mode::kTransposed) return "FP8 has no weight-gradient kernel";
    if (s.rhs_kn) return "FP8 rhs must be stored [G, N, K] (quantize_fp8_weights)";
    if (s.K % kFp8Block || s.N % kFp8Block)
      return "FP8 needs K and N multiples of 128 (K = " + std::to_string(s.K) +
             ", N = " + std::to_string(s.N) + ")";
  } else if (s.K % 8 || s.N % 8) {
    return "the kernels need K and N multiples of 8 (16-byte rows; K = " + std::to_string(s.K) +
           ", N = " + std::to_string(s.N) + ")";
  }
  return {};
}

size_t workspace_bytes(const GemmShape& s, int sm_count) {
  size_t cutlass_bytes = 0;
#ifdef JAX_EP_WITH_GEMM
  const int G = static_cast<int>(s.G);
  switch (select(s)) {
#define JAX_EP_GEMM_WS(name)                                 \
  case k_##name:                                             \
    cutlass_bytes = variants::workspace_##name(G, sm_count); \
    break;
    JAX_EP_GEMM_VARIANTS(JAX_EP_GEMM_WS)
#undef JAX_EP_GEMM_WS
    default:
      break;
  }
#else
  (void)sm_count;
#endif
  return carve(nullptr, s, cutlass_bytes).total;
}

std::string run(const Call& c, cudaStream_t stream) {
  if (auto why = unsupported(c.s); !why.empty()) return why;
#ifdef JAX_EP_WITH_GEMM
  switch (select(c.s)) {
#define JAX_EP_GEMM_RUN(name) \
  case k_##name:              \
    return variants::run_##name(c, stream);
    JAX_EP_GEMM_VARIANTS(JAX_EP_GEMM_RUN)
#undef JAX_EP_GEMM_RUN
    default:
      break;
  }
#else
  (void)stream;
#endif
  return "no grouped-GEMM variant for this call";
}

}  // namespace jax_ep::gemm
