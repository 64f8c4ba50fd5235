// Expert-id sanitising shared by the layout count and the dispatch kernels.
#pragma once

namespace jax_ep {

// An id outside [-1, E) is invalid (counts in num_invalid) and acts as -1.
__device__ __forceinline__ bool expert_id_invalid(int v, int num_experts) {
  return v < -1 || v >= num_experts;
}
__device__ __forceinline__ int sanitize_expert_id(int v, int num_experts) {
  return (v < 0 || v >= num_experts) ? -1 : v;
}

}  // namespace jax_ep
