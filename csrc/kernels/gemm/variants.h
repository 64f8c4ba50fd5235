// The compiled grouped-GEMM variants: one CUTLASS instantiation each, in inst_<name>.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "kernels/gemm/grouped_gemm.h"

// X(name): every variant, in the order of `select` in variants.cu.
#define JAX_EP_GEMM_VARIANTS(X) \
  X(bf16_fwd)                   \
  X(bf16_fwd_small)             \
  X(bf16_fwd_nk)                \
  X(bf16_tgrad)                 \
  X(bf16_tgrad_acc)             \
  X(f16_fwd)                    \
  X(f16_fwd_small)              \
  X(f16_fwd_nk)                 \
  X(f16_tgrad)                  \
  X(f16_tgrad_acc)              \
  X(fp8_fwd)                    \
  X(fp8_fwd_small)

namespace jax_ep::gemm::variants {
#define JAX_EP_GEMM_DECLARE(name)                             \
  std::string run_##name(const Call& c, cudaStream_t stream); \
  size_t workspace_##name(int G, int sm_count);
JAX_EP_GEMM_VARIANTS(JAX_EP_GEMM_DECLARE)
#undef JAX_EP_GEMM_DECLARE
}  // namespace jax_ep::gemm::variants
