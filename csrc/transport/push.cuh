// Push protocol of the low-latency ops (DeepEP low-latency style, over peer memory).
//
// Each push call site's lease holds a receive buffer on every rank (runtime/lease.h), split in two
// halves by the parity p = e & 1 of the call's epoch e. A call has a send phase and a receive
// phase, run by one kernel (fused op) or by two (the send / receive split):
//   send    wait until every receiver q has freed our half p from call e - 2 (freed[q] >= e - 2,
//           written by q into OUR slot: normally long true), write rows into q's buffer, each
//           followed by its tags (the epoch e, release stores: kernels/low_latency/). The LL
//           dispatch also writes data_flag[p][r] = (e << 32) | rows (our token count) into q's
//           slot when the send starts: rows past it get no tags.
//   receive wait for each row's tags (local polls), read the rows from our own buffer into the
//           XLA outputs, then freed[r] = e in every sender's slot.
// The send phase takes e = send_epoch + 1. A receive in the same kernel uses the same e; a
// separate receive kernel (the split API) reads e from its send's result (the "ticket"), so the
// pair always agrees on e even when XLA reorders or software-pipelines the calls of a loop.
// No barrier at the start or the end: a rank never waits for a peer to finish reading, and
// nobody reads XLA buffers of another rank, so XLA may reuse them as soon as the kernel ends.
// Remote peers (PeerSlots::remote, per-process mode): the send phase writes their rows into this
// rank's scratch image of their buffer (the handler points buf[q] there), and NVSHMEM kernels
// (nvshmem/remote.h) put them after the send kernel, then (once the puts completed) the flag
// (dispatch: the receiver waits for it before it reads a remote sender's rows) or the row tags.
//
// Work is split into items taken from per-phase ticket counters by whole warps, so the warps
// that are resident take every item before any of them waits on a peer: no wait ever depends on
// a block that cannot be scheduled (XLA may run another kernel, e.g. NCCL, beside ours). The warp
// whose items complete a phase runs the phase's closing step (freed flags, stats).
// The last block to leave the kernel resets the tickets and counters and advances the epochs.
// Every wait gives up after timeout_ns (transport/peer.cuh: Patience), recording the rank, the
// peer and the phase; a send whose receiver never freed its half then sends nothing.
#pragma once
#include <cstdint>

#include "common/warp.h"
#include "transport/peer.cuh"
#include "transport/poison.cuh"

namespace jax_ep {
namespace push {

enum Phase { kSend = 0, kRecv = 1, kNumPhases = 2 };
enum Mode { kModeSend = 1, kModeRecv = 2, kModeBoth = 3 };

// Epoch of this call's send phase (owner counter, advanced by leave_kernel).
__device__ __forceinline__ unsigned long long send_epoch(const PeerSlots& ps) {
  return ld_volatile_u64(&ps.slot[ps.rank]->send_epoch) + 1;
}
// Epoch of a receive: the send's, from the ticket a separate send kernel wrote (split), or this
// kernel's own send epoch (fused).
__device__ __forceinline__ unsigned long long recv_epoch(const PeerSlots& ps,
                                                         const int32_t* ticket_epoch) {
  if (ticket_epoch == nullptr) return send_epoch(ps);
  return static_cast<unsigned int>(*reinterpret_cast<const volatile int32_t*>(ticket_epoch));
}

// Whole warp, between items of `phase` (n items): report `fin` finished items (0 before the
// warp's first item, then 1) and take the next ticket, in one atomic on the phase's work word
// ((tickets << 32) | finished); the same values in every lane. A ticket >= n ends the warp's
// phase, and the warp whose report completes n (always on such a take: every ticket was taken
// by then) is the phase's closer.
// No fence before the report: a fence waits until the warp's stores are acknowledged (~1 us
// for local ones, ~3 us for stores to peers at R = 4), and nothing needs that. The closers rely
// only on the items' reads of our buffer being over (signal_freed): every load of an item feeds
// an instruction issued before the report (a copy's stores, a row's tag test), and a warp issues
// in order, so its loads have returned when its report is issued. This is the hardware's order,
// not one the PTX memory model promises for relaxed accesses. A fenced report measured +0.8 us
// on the LL dispatch at R = 4 (docs/design.md#no-fences).
struct Take {
  int it;       // the ticket: item `it` when < n
  bool closer;  // this report completed the phase
};
__device__ __forceinline__ Take next_item(Slot* me, int phase, int n, int fin, int lane) {
  unsigned long long w = 0;
  __syncwarp();
  if (lane == 0) w = atomicAdd(&me->work[phase], (1ull << 32) | static_cast<unsigned int>(fin));
  w = __shfl_sync(kFull, w, 0);
  const bool closer = fin != 0 && static_cast<int>(w & 0xffffffffu) + fin == n;
  return Take{static_cast<int>(w >> 32), closer};
}

// Thread 0 of a block, at the start of a phase: the first tickets of all of the block's warps
// (warp w gets the returned value + w), taken by one atomic for the block where a take per warp
// would queue one atomic per warp of the grid (~1500-2000) on the phase's work word. Only a
// resident block takes tickets, so every ticket still goes to a running warp. Publish it to the
// block's warps (shared memory and a barrier) before they use it.
__device__ __forceinline__ unsigned int take_block_tickets(Slot* me, int phase, int warps) {
  return static_cast<unsigned int>(
      atomicAdd(&me->work[phase], static_cast<unsigned long long>(warps) << 32) >> 32);
}

// Whole warp of a send phase: its first item from the block's tickets (first: what thread 0's
// take_block_tickets returned), every later one from next_item.
__device__ __forceinline__ Take send_take(Slot* me, unsigned int first, int warp, int n, int fin,
                                          int lane) {
  return fin == 0 ? Take{static_cast<int>(first) + warp, false}
                  : next_item(me, kSend, n, fin, lane);
}

// One thread per sender s: wait for s's data flag of epoch e (our own slot); false when the
// wait gave up.
__device__ __forceinline__ bool wait_data(const PeerSlots& ps, int s, int p, unsigned long long e,
                                          int64_t timeout_ns, const char* phase) {
  const unsigned long long* f = &ps.slot[ps.rank]->data_flag[p][s];
  unsigned long long v = ld_acquire_sys(f);
  if ((v >> 32) < e) {
    Patience wait;
    while (((v = ld_acquire_sys(f)) >> 32) < e)
      if (wait.gives_up(ps, timeout_ns, WaitSite{phase, s, e, v >> 32})) return false;
  }
  return true;
}

// One thread per receiver q: wait until q freed our half of call e - 2; false when the wait
// gave up (then nothing may be written into q's half).
__device__ __forceinline__ bool wait_freed(const PeerSlots& ps, int q, unsigned long long e,
                                           int64_t timeout_ns, const char* phase) {
  if (e <= 2) return true;
  return wait_flag_geq(ps, &ps.slot[ps.rank]->freed[q], e - 2, timeout_ns, q, phase);
}

// Thread q (< R) at the start of a send phase: our row count for q, (e << 32) | rows (the LL
// dispatch releases each row by its own tags; rows >= `rows` get none). Relaxed: the word
// carries its epoch and nothing is ordered behind it. A remote q gets it from
// remote::push_dispatch_rows after the puts of our rows instead.
__device__ __forceinline__ void signal_data(const PeerSlots& ps, int q, int p, unsigned long long e,
                                            unsigned int rows) {
  if (is_remote(ps, q)) return;
  st_relaxed_sys(&ps.slot[q]->data_flag[p][ps.rank], (e << 32) | rows);
}

// Lane s (< R) of the closing warp of a receive phase: we are done reading s's rows of call e.
// A remote s is freed by remote::free_remote_senders after this kernel instead. Relaxed: every
// warp's reads of our buffer returned before its report (next_item), and the closer saw every
// report; a release store would first wait for the closer's own stores (~1 us on the path out).
__device__ __forceinline__ void signal_freed(const PeerSlots& ps, int s, unsigned long long e) {
  if (is_remote(ps, s)) return;
  st_relaxed_sys(&ps.slot[s]->freed[ps.rank], e);
}

// Whole block, at the very end of the kernel: the last block out resets the tickets and item
// counts and, when the kernel ran a send phase, advances the send epoch. No fences: every block
// counts itself out after its warps' last take returned (they left their loops on its value)
// and after it read send_epoch, so the resets cannot overtake them; the next kernel on the
// stream sees them by kernel order. At R = 4 the fence before the count cost the dispatch
// ~0.3 us, the last block's two fences ~0.6 us (the combine ~1.4 us; docs/design.md#no-fences).
// Then, when a wait on the device gave up, that block fills the kernel's results (`outputs`,
// transport/poison.cuh): one load of the latch, after the count returned, on the healthy path.
__device__ __forceinline__ void leave_kernel(const PeerSlots& ps, int mode, unsigned long long es,
                                             const poison::Outputs& outputs) {
  __syncthreads();
  bool poison = false;
  if (threadIdx.x == 0) {
    Slot* me = ps.slot[ps.rank];
    const unsigned int prev = atomicAdd(&me->exit_counter, 1u);
    if (prev == gridDim.x * gridDim.y * gridDim.z - 1) {
      for (int i = 0; i < kNumPhases; ++i) me->work[i] = 0;
      me->exit_counter = 0;
      if (mode & kModeSend) me->send_epoch = es;
      poison = poison::device_gave_up(ps);
    }
  }
  poison::fill_if(poison, outputs);
}

}  // namespace push
}  // namespace jax_ep
