// Device-side synchronisation between the ranks of one EP group in one process.
// Every op follows the same protocol on its call-site slot, with epoch e = slot.epoch + 1:
//   1. publish: rank r writes the addresses its peers will read into its own slot, then
//      ready = e (system-scope release).
//   2. wait_ready: wait until every peer's ready >= e (acquire), then read their addresses.
//   3. the op's work: loads from peer buffers (pull), stores to local outputs only.
//   4. end barrier (last block of the last kernel): write done[r] = e into every peer's slot,
//      wait until our own done[s] >= e for all s, then slot.epoch = e. After it nobody reads
//      our buffers any more, so XLA may reuse them, and the next call may publish again.
// Every wait stops after timeout_ns and traps with a message naming the rank and the phase.
#pragma once
#include <cstdint>
#include <cstdio>

#include "runtime/workspace.h"

namespace jax_ep {

// Addresses of this call-site's slot on every rank of the group (UVA: valid on all devices).
struct PeerSlots {
  Slot* slot[kMaxRanks];
  int num_ranks;
  int rank;
};

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_volatile_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until *flag >= target; trap after timeout_ns naming rank / peer / phase.
__device__ __forceinline__ void wait_flag_geq(const unsigned long long* flag,
                                              unsigned long long target, int64_t timeout_ns,
                                              int rank, int peer, const char* phase) {
  if (ld_acquire_sys(flag) >= target) return;
  const uint64_t start = global_timer_ns();
  while (ld_acquire_sys(flag) < target) {
    if ((int64_t)(global_timer_ns() - start) > timeout_ns) {
      printf("jax_ep: rank %d timed out after %lld s in phase '%s' waiting for rank %d "
             "(epoch %llu, seen %llu). A peer did not arrive: check that every rank runs the "
             "same program (JAX_EP_TIMEOUT_S sets the limit).\n",
             rank, (long long)(timeout_ns / 1000000000LL), phase, peer, target,
             ld_acquire_sys(flag));
      __trap();
    }
  }
}

// The epoch of the call now starting on this slot (owner-only counter, stable within a call).
__device__ __forceinline__ unsigned long long call_epoch(const PeerSlots& ps) {
  return ld_volatile_u64(&ps.slot[ps.rank]->epoch) + 1;
}

// Step 1 (one thread): publish n addresses for this call.
__device__ __forceinline__ void publish(const PeerSlots& ps, const void* const* ptrs, int n,
                                        unsigned long long e) {
  Slot* me = ps.slot[ps.rank];
  for (int i = 0; i < n; ++i) me->ptrs[i] = reinterpret_cast<unsigned long long>(ptrs[i]);
  __threadfence_system();
  st_release_sys(&me->ready, e);
}

// Step 2 (one thread per block is enough; call from threadIdx.x == 0 then __syncthreads).
__device__ __forceinline__ void wait_ready(const PeerSlots& ps, unsigned long long e,
                                           int64_t timeout_ns, const char* phase) {
  for (int s = 0; s < ps.num_ranks; ++s)
    wait_flag_geq(&ps.slot[s]->ready, e, timeout_ns, ps.rank, s, phase);
}

// Address number i that rank s published for this call (valid after wait_ready).
template <typename T>
__device__ __forceinline__ T* peer_ptr(const PeerSlots& ps, int s, int i) {
  return reinterpret_cast<T*>(ld_volatile_u64(&ps.slot[s]->ptrs[i]));
}

// Step 4, whole block calls it at the very end of the op's last kernel. The last block to
// arrive signals the peers, waits for them, and closes the epoch. Returns after that.
__device__ __forceinline__ void end_barrier(const PeerSlots& ps, unsigned long long e,
                                           int64_t timeout_ns, const char* phase) {
  __syncthreads();
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    __threadfence();
    Slot* me = ps.slot[ps.rank];
    unsigned int prev = atomicAdd(&me->block_counter, 1u);
    is_last = (prev == gridDim.x * gridDim.y * gridDim.z - 1);
    if (is_last) {
      me->block_counter = 0;
      __threadfence_system();
      for (int s = 0; s < ps.num_ranks; ++s) st_release_sys(&ps.slot[s]->done[ps.rank], e);
      for (int s = 0; s < ps.num_ranks; ++s)
        wait_flag_geq(&me->done[s], e, timeout_ns, ps.rank, s, phase);
      me->epoch = e;
      __threadfence_system();
    }
  }
  __syncthreads();
}

// end_barrier with a hook: the last block to arrive first runs last_fn() with all its threads
// (call it block-uniformly; it may use __syncthreads). When it runs, every other block of the
// grid has finished all its work (it is waiting in this barrier, or gone), so it is the place to
// copy and zero per-op slot counters and to call grid_barrier_reset. Then as end_barrier.
template <typename LastFn>
__device__ __forceinline__ void end_barrier(const PeerSlots& ps, unsigned long long e,
                                           int64_t timeout_ns, const char* phase,
                                           LastFn&& last_fn) {
  __syncthreads();
  __shared__ bool is_last_hook;
  if (threadIdx.x == 0) {
    __threadfence();
    Slot* me = ps.slot[ps.rank];
    unsigned int prev = atomicAdd(&me->block_counter, 1u);
    is_last_hook = (prev == gridDim.x * gridDim.y * gridDim.z - 1);
    if (is_last_hook) __threadfence();  // acquire: see what the other blocks wrote
  }
  __syncthreads();
  if (is_last_hook) {
    last_fn();
    __syncthreads();
    if (threadIdx.x == 0) {
      Slot* me = ps.slot[ps.rank];
      me->block_counter = 0;
      __threadfence_system();
      for (int s = 0; s < ps.num_ranks; ++s) st_release_sys(&ps.slot[s]->done[ps.rank], e);
      for (int s = 0; s < ps.num_ranks; ++s)
        wait_flag_geq(&me->done[s], e, timeout_ns, ps.rank, s, phase);
      me->epoch = e;
      __threadfence_system();
    }
  }
  __syncthreads();
}

// In-kernel barrier among the blocks of one grid (all blocks must be co-resident: use it only
// with grids no larger than the number of SMs). Uses the slot's grid_counter, which returns to
// a multiple of gridDim after each use; `generation` counts uses within the same kernel (1, 2..).
__device__ __forceinline__ void grid_barrier(const PeerSlots& ps, unsigned int generation,
                                             int64_t timeout_ns, const char* phase) {
  __syncthreads();
  if (threadIdx.x == 0) {
    Slot* me = ps.slot[ps.rank];
    const unsigned int nb = gridDim.x * gridDim.y * gridDim.z;
    __threadfence();
    atomicAdd(&me->grid_counter, 1u);
    const unsigned int target = nb * generation;
    const uint64_t start = global_timer_ns();
    while (atomicAdd(&me->grid_counter, 0u) < target) {
      if ((int64_t)(global_timer_ns() - start) > timeout_ns) {
        printf("jax_ep: rank %d timed out in grid barrier of phase '%s'\n", ps.rank, phase);
        __trap();
      }
    }
    __threadfence();
  }
  __syncthreads();
}
// Return the grid counter to 0 once every block has passed its last grid_barrier (call from
// one thread of the last block, e.g. inside the end barrier's last block or a later kernel).
__device__ __forceinline__ void grid_barrier_reset(const PeerSlots& ps) {
  ps.slot[ps.rank]->grid_counter = 0;
}

}  // namespace jax_ep
