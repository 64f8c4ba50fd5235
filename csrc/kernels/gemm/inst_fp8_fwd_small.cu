// One CUTLASS grouped-GEMM instantiation (see impl.cuh, variants.h).
#include "kernels/gemm/impl.cuh"
#include "kernels/gemm/variants.h"

JAX_EP_GEMM_VARIANT(fp8_fwd_small, Fp8FwdSmall)
