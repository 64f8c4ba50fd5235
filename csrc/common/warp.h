// Warp-wide constants and helpers. A leaf: it includes no other header of the project, so every
// floor (transport, kernels, ...) may include it.
#pragma once

namespace jax_ep {

// Every lane of a warp: the member mask of a whole-warp shuffle, ballot or vote.
constexpr unsigned kFull = 0xffffffffu;

#ifdef __CUDACC__
// The next ticket of a queue (an atomic counter of items handed out in order), drawn by lane 0
// for the whole warp: every lane returns the same value. All 32 lanes must call it.
__device__ __forceinline__ int warp_ticket(int* queue, int lane) {
  int t = 0;
  if (lane == 0) t = atomicAdd(queue, 1);
  return __shfl_sync(kFull, t, 0);
}
#endif

}  // namespace jax_ep
