// Device-side synchronisation between the ranks of one EP group in one process.
// Every op follows the same protocol on its call-site slot, with epoch e = slot.epoch + 1:
//   1. publish: rank r writes the addresses its peers will read into its own slot, then
//      ready = e (system-scope release).
//   2. wait until every peer's ready >= e (acquire), then read their addresses (peer_ptr).
//   3. the op's work: loads from peer buffers (pull), stores to local outputs only.
//   4. end barrier (last block of the last kernel): write done[r] = e into every peer's slot,
//      wait until our own done[s] >= e for all s, then slot.epoch = e. After it nobody reads
//      our buffers any more, so XLA may reuse them, and the next call may publish again.
// Every wait stops after timeout_ns and traps with a message naming the rank and the phase.
#pragma once

// Planted bugs for the mutation check of the multi-rank suites (scripts/gpu_check.sh
// mutations, CMake variable JAX_EP_MUTATION), each in code every one-process run executes:
// 1, low-latency dispatch: a count or position word of the buffer half's previous use passes
// as this call's (word_older, kernels/low_latency.cu); 2, high-throughput: the wait for the
// peers' addresses accepts those of the previous call (publish_and_wait,
// kernels/high_throughput.cu); 3, the ready flag stored relaxed, with no fence after the
// addresses it publishes (publish, below); 4, low-latency: a row tag of the half's previous use
// passes (tag_older). 0 (every real build) changes no code.
#ifndef JAX_EP_MUTATION
#define JAX_EP_MUTATION 0
#endif
#include <cstdint>
#include <cstdio>

#include "runtime/workspace.h"
#include "transport/trace_marks.h"

namespace jax_ep {

// Addresses of this call-site's slot on every rank of the group (UVA: valid on all devices).
struct PeerSlots {
  Slot* slot[kMaxRanks];
  int num_ranks;
  int rank;
  // Per-process mode only (null otherwise): peers cannot read each other's XLA buffers, so each
  // rank copies its published operands into a symmetric staging buffer first; operand i of rank
  // s is then at stage[s] + stage_off[i] (see stage_operands in ffi/high_throughput.cc).
  const uint8_t* stage[kMaxRanks];
  unsigned long long stage_off[kMaxPtrs];
  // Per-process mode: bit q set when rank q is not reachable by loads and stores (another node,
  // or JAX_EP_FORCE_REMOTE_PEERS=1). Its slot[q] is null; the kernels never touch its memory:
  // NVSHMEM kernels (transport/remote.h) launched around them move its data and flags. pe[q]:
  // rank q's NVSHMEM PE.
  unsigned int remote;
  int pe[kMaxRanks];
};

__host__ __device__ __forceinline__ bool is_remote(const PeerSlots& ps, int q) {
  return (ps.remote >> q) & 1u;
}

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_sys_s32(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys_s32(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Relaxed system-scope accesses: for words that carry their own epoch (no data behind them).
// No "memory" clobber: nothing is ordered by them, and a clobber would make the compiler reload
// every value it read from memory (the kernel parameters, behind a reference in the out-of-line
// items) after each one, chaining those reloads into the loads that follow. volatile keeps
// each access (polls re-read) and their order among themselves.
__device__ __forceinline__ unsigned long long ld_relaxed_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_relaxed_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v));
}
__device__ __forceinline__ void st_relaxed_sys_s32(int* p, int v) {
  asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v));
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

// ---------------------------------------------------------------------------------------------
// Phase tracer (diagnostic, always on; costs one 8-byte store per mark, by one thread of the
// grid). trace_mark(ps, i): block 0, thread 0 stores %globaltimer (ns) into our slot's trace[i];
// trace_mark_last(ps, i): the same store by whichever thread calls it (the one thread that runs
// the end barrier's last-block logic). Host side: read_traces / jax_ep.runtime.phase_traces.
// A mark not reached in a call keeps the value of an earlier call. The indices, with what each
// records, are named in transport/trace_marks.h (trace::k...; the low-latency kernels' per-warp
// points, with the diag attribute, are trace::kDiag...).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void trace_mark_last(const PeerSlots& ps, int i) {
  ps.slot[ps.rank]->trace[i] = global_timer_ns();
}
__device__ __forceinline__ void trace_mark(const PeerSlots& ps, int i) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0)
    trace_mark_last(ps, i);
}

// True for the first caller in this process (per translation unit): one timeout report when
// many threads time out together. Never reset: a trap leaves the CUDA context unusable anyway.
static __device__ int g_timeout_reported = 0;
__device__ __forceinline__ bool first_timeout_report() {
  return *reinterpret_cast<volatile int*>(&g_timeout_reported) == 0 &&
         atomicExch(&g_timeout_reported, 1) == 0;
}

// Spin until *flag >= target; trap after timeout_ns naming rank / peer / phase.
__device__ __forceinline__ void wait_flag_geq(const unsigned long long* flag,
                                              unsigned long long target, int64_t timeout_ns,
                                              int rank, int peer, const char* phase) {
  if (ld_acquire_sys(flag) >= target) return;
  const uint64_t start = global_timer_ns();
  while (ld_acquire_sys(flag) < target) {
    if ((int64_t)(global_timer_ns() - start) > timeout_ns) {
      printf(
          "jax_ep: rank %d timed out after %lld s in phase '%s' waiting for rank %d "
          "(epoch %llu, seen %llu). A peer did not arrive: check that every rank runs the "
          "same program (JAX_EP_TIMEOUT_S sets the limit).\n",
          rank, (long long)(timeout_ns / 1000000000LL), phase, peer, target, ld_acquire_sys(flag));
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
#if JAX_EP_MUTATION == 3  // planted bug 3: the flag unordered with the addresses before it
  st_relaxed_sys(&me->ready, e);
#else
  __threadfence_system();
  st_release_sys(&me->ready, e);
#endif
}

// Address number i that rank s published for this call (valid once its ready >= e).
template <typename T>
__device__ __forceinline__ T* peer_ptr(const PeerSlots& ps, int s, int i) {
  if (ps.stage[s] != nullptr) return reinterpret_cast<T*>(ps.stage[s] + ps.stage_off[i]);
  return reinterpret_cast<T*>(ld_volatile_u64(&ps.slot[s]->ptrs[i]));
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

// Step 4, whole block calls it at the very end of the op's last kernel. The last block to
// arrive signals done to all peers FIRST (lane s -> peer s, in parallel), then runs last_fn()
// (which must not read peer memory: it overlaps the peers' done flags in flight; it is the place
// to call grid_barrier_reset), then waits for the peers' done flags (lane s polls done[s], in
// parallel), then closes the epoch. last_fn runs with all threads of the last block,
// block-uniformly; every other block of the grid has finished its work when it runs.
// trace >= 0: marks trace (all blocks arrived) and trace + 1 (peers' done seen), last block.
template <typename LastFn>
__device__ __forceinline__ void end_barrier(const PeerSlots& ps, unsigned long long e,
                                            int64_t timeout_ns, const char* phase, LastFn&& last_fn,
                                            int trace = -1) {
  __syncthreads();
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    __threadfence();
    Slot* me = ps.slot[ps.rank];
    unsigned int prev = atomicAdd(&me->block_counter, 1u);
    is_last = (prev == gridDim.x * gridDim.y * gridDim.z - 1);
    if (is_last) {
      __threadfence();  // acquire: see what the other blocks wrote
      if (trace >= 0) trace_mark_last(ps, trace);
    }
  }
  __syncthreads();
  if (is_last) {
    Slot* me = ps.slot[ps.rank];
    if (threadIdx.x < 32) {
      if (threadIdx.x == 0) me->block_counter = 0;
      if ((int)threadIdx.x < ps.num_ranks && !is_remote(ps, threadIdx.x)) {
        __threadfence_system();
        st_release_sys(&ps.slot[threadIdx.x]->done[ps.rank], e);
      }
    }
    last_fn();
    __syncthreads();
    if (threadIdx.x < 32) {
      if ((int)threadIdx.x < ps.num_ranks && !is_remote(ps, threadIdx.x))
        wait_flag_geq(&me->done[threadIdx.x], e, timeout_ns, ps.rank, threadIdx.x, phase);
      __syncwarp();
      if (threadIdx.x == 0) {
        if (trace >= 0) trace_mark_last(ps, trace + 1);
        me->epoch = e;
        __threadfence_system();
      }
    }
  }
  __syncthreads();
}

// end_barrier without a hook (non-template: preferred for a plain trace index).
__device__ __forceinline__ void end_barrier(const PeerSlots& ps, unsigned long long e,
                                            int64_t timeout_ns, const char* phase, int trace = -1) {
  end_barrier(ps, e, timeout_ns, phase, []() {}, trace);
}

}  // namespace jax_ep
