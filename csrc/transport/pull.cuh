// The pull protocol of the high-throughput ops, on the peer table (transport/peer.cuh).
// Every op follows the same protocol on its call-site slot, with epoch e = slot.epoch + 1:
//   1. publish: rank r writes the addresses its peers will read into its own slot, then
//      ready = e (system-scope release).
//   2. wait until every peer's ready >= e (acquire), then read their addresses (peer_ptr).
//   3. the op's work: loads from peer buffers (pull), stores to local outputs only.
//   4. end barrier (last block of the last kernel): write done[r] = e into every peer's slot,
//      wait until our own done[s] >= e for all s, then slot.epoch = e. After it nobody reads
//      our buffers any more, so XLA may reuse them, and the next call may publish again.
#pragma once
#include "testing/mutations.h"
#include "transport/peer.cuh"

namespace jax_ep {

// The epoch of the call now starting on this slot (owner-only counter, stable within a call).
__device__ __forceinline__ unsigned long long call_epoch(const PeerSlots& ps) {
  return ld_volatile_u64(&ps.slot[ps.rank]->epoch) + 1;
}

// Step 1 (one thread): publish n addresses for this call.
__device__ __forceinline__ void publish(const PeerSlots& ps, const void* const* ptrs, int n,
                                        unsigned long long e) {
  Slot* me = ps.slot[ps.rank];
  for (int i = 0; i < n; ++i) me->ptrs[i] = reinterpret_cast<unsigned long long>(ptrs[i]);
  if constexpr (JAX_EP_PLANTED(kReadyUnfenced)) {
    st_relaxed_sys(&me->ready, e);
  } else {
    __threadfence_system();
    st_release_sys(&me->ready, e);
  }
}

// Address number i that rank s published for this call (valid once its ready >= e).
template <typename T>
__device__ __forceinline__ T* peer_ptr(const PeerSlots& ps, int s, int i) {
  if (ps.stage[s] != nullptr) return reinterpret_cast<T*>(ps.stage[s] + ps.stage_off[i]);
  return reinterpret_cast<T*>(ld_volatile_u64(&ps.slot[s]->ptrs[i]));
}

// The polling part of grid_barrier, out of line: the callers keep their registers.
static __device__ JAX_EP_WAIT_FN bool grid_wait_slow(Waiter me, unsigned int* counter,
                                                     unsigned int target, int64_t timeout_ns,
                                                     const char* phase) {
  Patience wait;
  unsigned int v;
  while ((v = atomicAdd(counter, 0u)) < target)
    if (wait.gives_up(me, timeout_ns, WaitSite{phase, -1, target, v})) return false;
  return true;
}

// In-kernel barrier among the blocks of one grid (all blocks must be co-resident: use it only
// with grids no larger than the number of SMs). Uses the slot's grid_counter, which returns to
// a multiple of gridDim after each use; `generation` counts uses within the same kernel (1, 2..).
// False (in every thread of the block) when the wait gave up: the block must end.
__device__ __forceinline__ bool grid_barrier(const PeerSlots& ps, unsigned int generation,
                                             int64_t timeout_ns, const char* phase) {
  __shared__ bool passed;
  __syncthreads();
  if (threadIdx.x == 0) {
    Slot* me = ps.slot[ps.rank];
    const unsigned int nb = gridDim.x * gridDim.y * gridDim.z;
    __threadfence();
    atomicAdd(&me->grid_counter, 1u);
    const unsigned int target = nb * generation;
    passed = atomicAdd(&me->grid_counter, 0u) >= target ||
             grid_wait_slow(waiter(ps), &me->grid_counter, target, timeout_ns, phase);
    __threadfence();
  }
  __syncthreads();
  return passed;
}
// Return the grid counter to 0 once every block has passed its last grid_barrier (call from
// one thread of the last block, e.g. inside the end barrier's last block or a later kernel).
__device__ __forceinline__ void grid_barrier_reset(const PeerSlots& ps) {
  ps.slot[ps.rank]->grid_counter = 0;
}

// Step 4, whole block calls it at the very end of the op's last kernel. The last block to
// arrive signals done to all peers FIRST (lane s -> peer s, in parallel), then runs last_fn()
// (which must not read peer memory: it overlaps the peers' done flags in flight; it is the place
// to call grid_barrier_reset), then waits for the peers' done flags (lane s polls done[s], in
// parallel), then closes the epoch. last_fn runs with all threads of the last block,
// block-uniformly; every other block of the grid has finished its work when it runs.
// trace >= 0: marks trace (all blocks arrived) and trace + 1 (peers' done seen), last block.
// blocks: how many blocks of the grid call it (0: all of them; the others must not touch the
// slot's block counter).
template <typename LastFn>
__device__ __forceinline__ void end_barrier(const PeerSlots& ps, unsigned long long e,
                                            int64_t timeout_ns, const char* phase, LastFn&& last_fn,
                                            int trace = -1, unsigned int blocks = 0);

// end_barrier in two steps, for blocks with work of their own after their reads of peers'
// buffers: end_arrive (whole block, every calling block) is true in the last block to arrive,
// which has then signalled done to all peers; that block calls end_wait (whole block) once its
// own work is done: it waits for the peers' done flags and closes the epoch.
__device__ __forceinline__ bool end_arrive(const PeerSlots& ps, unsigned long long e,
                                           int trace = -1, unsigned int blocks = 0) {
  __syncthreads();
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    __threadfence();
    Slot* me = ps.slot[ps.rank];
    unsigned int prev = atomicAdd(&me->block_counter, 1u);
    const unsigned int n = blocks > 0 ? blocks : gridDim.x * gridDim.y * gridDim.z;
    is_last = (prev == n - 1);
    if (is_last) {
      __threadfence();  // acquire: see what the other blocks wrote
      if (trace >= 0) trace_mark_last(ps, trace);
    }
  }
  __syncthreads();
  const bool last = is_last;
  if (last && threadIdx.x < 32) {
    Slot* me = ps.slot[ps.rank];
    if (threadIdx.x == 0) me->block_counter = 0;
    if ((int)threadIdx.x < ps.num_ranks && !is_remote(ps, threadIdx.x)) {
      __threadfence_system();
      st_release_sys(&ps.slot[threadIdx.x]->done[ps.rank], e);
    }
  }
  return last;
}
__device__ __forceinline__ void end_wait(const PeerSlots& ps, unsigned long long e,
                                         int64_t timeout_ns, const char* phase, int trace = -1) {
  __syncthreads();
  if (threadIdx.x < 32) {
    Slot* me = ps.slot[ps.rank];
    if ((int)threadIdx.x < ps.num_ranks && !is_remote(ps, threadIdx.x))
      wait_flag_geq(ps, &me->done[threadIdx.x], e, timeout_ns, threadIdx.x, phase);
    __syncwarp();
    if (threadIdx.x == 0) {
      if (trace >= 0) trace_mark_last(ps, trace + 1);
      me->epoch = e;
      __threadfence_system();
    }
  }
}

template <typename LastFn>
__device__ __forceinline__ void end_barrier(const PeerSlots& ps, unsigned long long e,
                                            int64_t timeout_ns, const char* phase, LastFn&& last_fn,
                                            int trace, unsigned int blocks) {
  if (end_arrive(ps, e, trace, blocks)) {
    last_fn();
    end_wait(ps, e, timeout_ns, phase, trace);
  }
  __syncthreads();
}

// end_barrier without a hook (non-template: preferred for a plain trace index).
__device__ __forceinline__ void end_barrier(const PeerSlots& ps, unsigned long long e,
                                            int64_t timeout_ns, const char* phase, int trace = -1) {
  end_barrier(ps, e, timeout_ns, phase, []() {}, trace);
}

}  // namespace jax_ep
