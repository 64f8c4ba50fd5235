// The peer table of one EP group in one process (PeerSlots: every rank's call-site slot and
// buffers), the bounded waits on peer flags, and the phase tracer. The protocols built on it:
// transport/pull.cuh (the high-throughput ops) and transport/push.cuh (the low-latency ops).
// Every wait gives up after timeout_ns without trapping (runtime/fault.h): it records the rank,
// the peer and the phase, and the kernels end; the host turns the record into an error. What
// the kernels read and write of the runtime's memory (Slot, DeviceFault) is common/limits.h.
#pragma once
#include <cstdint>
#include <cstdio>

#include "common/limits.h"
#include "testing/mutations.h"
#include "transport/ordering.cuh"
#include "transport/trace_marks.h"

// The out-of-line parts of the waits: a call keeps the callers' registers. A kernel that also
// issues warpgroup MMAs defines JAX_EP_WAITS_INLINE before including this header: ptxas
// serializes every wgmma of a kernel that makes a function call, so there the waits are inlined
// and the timeout record is not printed (the host raises it as an error anyway).
#ifdef JAX_EP_WAITS_INLINE
#define JAX_EP_WAIT_FN __forceinline__
#else
#define JAX_EP_WAIT_FN __noinline__
#endif

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
  // This device's fault state (common/limits.h, runtime/fault.h): what a wait that gives up
  // writes.
  DeviceFault* fault;
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
// trace_max(ps, i): the latest %globaltimer at which any caller reached point i (atomicMax into
// trace[i]; a later call's times are larger, so each call's marks replace the last one's).
__device__ __forceinline__ void trace_max(const PeerSlots& ps, int i) {
  atomicMax(&ps.slot[ps.rank]->trace[i], static_cast<unsigned long long>(global_timer_ns()));
}

// ---------------------------------------------------------------------------------------------
// Bounded waits (docs/design.md#clean-timeouts). A wait first tests its condition; only when
// that fails does it start a Patience and poll. Each poll that still fails asks gives_up(): true
// after timeout_ns (the first such wait of the device records why), or once another wait of the
// process gave up (read from host memory, first after kAbortPollNs of waiting, then every
// kAbortPollNs). A wait that gives up marks its device failed and returns false; its caller
// must then not use what the wait was guarding (a peer's address, a row count) as valid.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned int ld_volatile_u32(const unsigned int* p) {
  return *reinterpret_cast<const volatile unsigned int*>(p);
}

// Whether a wait on this device gave up (latched): the high-throughput kernels test it first.
__device__ __forceinline__ bool device_failed(const PeerSlots& ps) {
  return ld_volatile_u32(&ps.fault->failed) != 0;
}

// What a wait needs of its peer table to give up. The out-of-line waits take it by value: a
// reference to a kernel parameter that is not __grid_constant__ (the high-throughput kernels')
// would copy the whole table into local memory (a ~300-byte stack frame per thread).
struct Waiter {
  DeviceFault* fault;
  int rank, num_ranks;
};
__device__ __forceinline__ Waiter waiter(const PeerSlots& ps) {
  return Waiter{ps.fault, ps.rank, ps.num_ranks};
}

// What a wait that gives up reports: the phase ("<op>: <what>"), the peer waited for (-1: not
// known at the wait), the epoch it waited for and the value it saw last.
struct WaitSite {
  const char* phase;
  int peer;
  unsigned long long epoch, seen;
};

// The wait gives up: mark the device failed; on a timeout, the first waiter of the device
// writes the record (state last) and prints it, and the process's aborted flag is raised.
static __device__ JAX_EP_WAIT_FN void give_up(Waiter me, int64_t timeout_ns, bool timed_out,
                                              WaitSite w) {
  DeviceFault* f = me.fault;
  *reinterpret_cast<volatile unsigned int*>(&f->failed) = 1u;
  if (timed_out) {
    if (atomicCAS(&f->claim, 0u, 1u) == 0u) {
      volatile FaultRecord* r = f->record;
      r->rank = me.rank;
      r->peer = w.peer;
      r->num_ranks = me.num_ranks;
      r->epoch = w.epoch;
      r->seen = w.seen;
      r->timeout_ns = timeout_ns;
      int i = 0;
      for (; i < kFaultPhaseChars - 1 && w.phase[i] != '\0'; ++i) r->phase[i] = w.phase[i];
      r->phase[i] = '\0';
      __threadfence_system();
      r->state = 1;
      // Only the writer raises the process's flag, after the record: the host never sees the
      // flag without a record to name (a timed-out loser of the claim leaves both to it).
      __threadfence_system();
      *reinterpret_cast<volatile unsigned int*>(f->aborted) = 1u;
#ifndef JAX_EP_WAITS_INLINE
      printf(
          "jax_ep: rank %d timed out after %lld s in phase '%s' (waiting for rank %d, -1: not "
          "known; epoch %llu, seen %llu). A peer did not arrive: check that every rank runs the "
          "same program (JAX_EP_TIMEOUT_S sets the limit). The op's kernels end; every later "
          "jax_ep communication op of this process raises an error.\n",
          me.rank, (long long)(timeout_ns / 1000000000LL), w.phase, w.peer, w.epoch, w.seen);
#endif
    }
  }
  __threadfence_system();
  if constexpr (JAX_EP_PLANTED(kTimeoutTraps)) {
    if (timed_out) __trap();
  }
}

struct Patience {
  uint64_t start, next_poll;
  __device__ __forceinline__ Patience()
      : start(global_timer_ns()), next_poll(start + kAbortPollNs) {}
  // Called after each poll that failed: whether the wait must stop (then it gave up).
  __device__ __forceinline__ bool gives_up(Waiter me, int64_t timeout_ns, WaitSite w) {
    const uint64_t now = global_timer_ns();
    const bool timed_out = static_cast<int64_t>(now - start) > timeout_ns;
    if (!timed_out) {
      if (now < next_poll) return false;
      next_poll = now + kAbortPollNs;
      if (ld_volatile_u32(me.fault->aborted) == 0u) return false;
    }
    give_up(me, timeout_ns, timed_out, w);
    return true;
  }
  __device__ __forceinline__ bool gives_up(const PeerSlots& ps, int64_t timeout_ns, WaitSite w) {
    return gives_up(waiter(ps), timeout_ns, w);
  }
};

// Wait until load() >= target, for a counter of the running call (it carries no epoch; WaitSite
// reports the target as the epoch); false when the wait gave up. Inline: the fused kernels'
// counters (kernels/fused/).
template <class Load>
__device__ __forceinline__ bool wait_count_geq(Waiter me, int64_t timeout_ns, const char* phase,
                                               int peer, long long target, Load&& load) {
  long long v = load();
  if (v >= target) return true;
  Patience wait;
  while ((v = load()) < target)
    if (wait.gives_up(me, timeout_ns,
                      WaitSite{phase, peer, static_cast<unsigned long long>(target),
                               static_cast<unsigned long long>(v)}))
      return false;
  return true;
}

// The polling part of wait_flag_geq, out of line: the callers keep their registers.
static __device__ JAX_EP_WAIT_FN bool wait_flag_slow(Waiter me, const unsigned long long* flag,
                                                     unsigned long long target, int64_t timeout_ns,
                                                     int peer, const char* phase) {
  Patience wait;
  unsigned long long v;
  while ((v = ld_acquire_sys(flag)) < target)
    if (wait.gives_up(me, timeout_ns, WaitSite{phase, peer, target, v})) return false;
  return true;
}

// Wait until *flag >= target; false when the wait gave up (peer: the rank it waits for).
__device__ __forceinline__ bool wait_flag_geq(const PeerSlots& ps, const unsigned long long* flag,
                                              unsigned long long target, int64_t timeout_ns,
                                              int peer, const char* phase) {
  if (ld_acquire_sys(flag) >= target) return true;
  return wait_flag_slow(waiter(ps), flag, target, timeout_ns, peer, phase);
}

}  // namespace jax_ep
