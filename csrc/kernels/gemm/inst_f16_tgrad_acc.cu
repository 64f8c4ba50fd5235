// One CUTLASS grouped-GEMM instantiation (see impl.cuh, variants.h).
#include "kernels/gemm/impl.cuh"
#include "kernels/gemm/variants.h"

JAX_EP_GEMM_VARIANT(f16_tgrad_acc, TgradAcc<cutlass::half_t>)
