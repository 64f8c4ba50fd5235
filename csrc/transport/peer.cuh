// The peer table of one EP group in one process (PeerSlots: every rank's call-site slot and
// buffers), the bounded waits on peer flags, and the phase tracer. The protocols built on it:
// transport/pull.cuh (the high-throughput ops) and transport/push.cuh (the low-latency ops).
// Every wait stops after timeout_ns and traps with a message naming the rank and the phase.
#pragma once
// Planted bugs for the mutation check of the multi-rank suites (scripts/gpu_check.sh
// mutations, CMake variable JAX_EP_MUTATION), each in code every one-process run executes:
// 1, low-latency dispatch: a count or position word of the buffer half's previous use passes
// as this call's (word_older, kernels/low_latency/common.cuh); 2, high-throughput: the wait for
// the peers' addresses accepts those of the previous call (publish_and_wait,
// kernels/high_throughput.cu); 3, the ready flag stored relaxed, with no fence after the addresses
// it publishes (publish, transport/pull.cuh); 4, low-latency: a row tag of the half's previous use
// passes (tag_older). 5 and 6 are call-site lease bugs (runtime/lease.cc); 7, low-latency
// combine: a row of y named by a tampered handle is read without the bound (combine_send_item).
// 0 (every real build) changes no code.
#ifndef JAX_EP_MUTATION
#define JAX_EP_MUTATION 0
#endif
#include <cstdint>
#include <cstdio>

#include "runtime/workspace.h"
#include "transport/ordering.cuh"
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
  // NVSHMEM kernels (nvshmem/remote.h) launched around them move its data and flags. pe[q]:
  // rank q's NVSHMEM PE.
  unsigned int remote;
  int pe[kMaxRanks];
};

__host__ __device__ __forceinline__ bool is_remote(const PeerSlots& ps, int q) {
  return (ps.remote >> q) & 1u;
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

}  // namespace jax_ep
