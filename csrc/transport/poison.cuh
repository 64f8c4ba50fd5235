// No plausible numbers from an op whose wait gave up (docs/design.md#clean-timeouts): the last
// block to leave each communication kernel reads the device's `failed` latch
// (runtime/fault.h), and when a wait on the device gave up, in this kernel or before, fills
// every result of the op with poison::kByte (transport/poison.h): floating results read NaN,
// int32 results -1. The latch stays set for the process, so every later kernel (a replayed
// command buffer, which runs no handler) poisons its results too.
//
// The healthy path pays one atomic per block (the low-latency kernels already count their
// blocks out: push::leave_kernel) and one load in the last block; the fill is the failure
// path's, by that one block.
#pragma once
#include <cstdint>

#include "testing/mutations.h"
#include "transport/peer.cuh"
#include "transport/poison.h"

namespace jax_ep {
namespace poison {

// Whole block: every byte of [p, p + n) set to kByte, 16-byte stores between the unaligned ends.
// Out of line (one copy per kernel) unless the kernel inlines its waits (JAX_EP_WAITS_INLINE:
// the fused kernels, where a call would serialize their warpgroup MMAs).
static __device__ JAX_EP_WAIT_FN void fill_bytes(uint8_t* p, int64_t n) {
  const int64_t tid = threadIdx.x, bd = blockDim.x;
  const int64_t head = (16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15;
  const int64_t h = head < n ? head : n;
  const int64_t nv = (n - h) >> 4;
  const uint8_t b = static_cast<uint8_t>(kByte);
  for (int64_t i = tid; i < h; i += bd) p[i] = b;
  int4* v = reinterpret_cast<int4*>(p + h);
  const int word = static_cast<int>(0x01010101u * b);
  const int4 all = make_int4(word, word, word, word);
  for (int64_t i = tid; i < nv; i += bd) v[i] = all;
  for (int64_t i = h + (nv << 4) + tid; i < n; i += bd) p[i] = b;
}

// Whole block: fill every listed result. Unrolled, so that a kernel parameter's list is read at
// constant offsets (a dynamic index would copy the whole parameter block to local memory).
__device__ __forceinline__ void fill(const Outputs& o) {
  if constexpr (JAX_EP_PLANTED(kSkipPoison)) return;
#pragma unroll
  for (int i = 0; i < kMaxOutputs; ++i)
    if (i < o.n) fill_bytes(static_cast<uint8_t*>(o.ptr[i]), o.bytes[i]);
}

// Thread 0 of the last block out of a kernel, once its count returned: whether a wait on this
// device gave up. The load issues after the count came back (it depends on its value), so it
// sees the `failed` store of every block counted before (give_up fences it before that block
// counts itself out).
__device__ __forceinline__ bool device_gave_up(const PeerSlots& ps) { return device_failed(ps); }

// Whole block, at the very end of a kernel: `poison` is thread 0's (the last block out saw the
// device failed); then the block fills the results.
__device__ __forceinline__ void fill_if(bool poison, const Outputs& o) {
  if (__syncthreads_or(poison)) fill(o);
}

// Whole block, every block of a pull kernel (the high-throughput and fused kernels) at its very
// end, also a block that ended early: count the block out on the slot's exit counter (the pull
// slots' own: the push protocol uses it on the push slots); the last block resets it and, when
// the device failed, fills the results.
__device__ __forceinline__ void leave(const PeerSlots& ps, const Outputs& o) {
  __syncthreads();
  bool poison = false;
  if (threadIdx.x == 0) {
    Slot* me = ps.slot[ps.rank];
    const unsigned int prev = atomicAdd(&me->exit_counter, 1u);
    if (prev == gridDim.x * gridDim.y * gridDim.z - 1) {
      me->exit_counter = 0;
      __threadfence();  // acquire: after every block's count
      poison = device_gave_up(ps);
    }
  }
  fill_if(poison, o);
}

}  // namespace poison
}  // namespace jax_ep
