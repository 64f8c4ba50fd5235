// The limits of the extension and the shapes of the memory the runtime makes for the kernels:
// the workspace (one Slot per call-site slot, in every EP group's workspace on each of its
// devices) and the fault records the waits write. A leaf: it includes no other header of the
// project, so every floor (transport, kernels, nvshmem, runtime, ffi) may include it and none
// has to include another floor for these facts. The registry of workspaces is
// runtime/workspace.h; the fault records' host side is runtime/fault.h.
#pragma once

namespace jax_ep {

constexpr int kMaxRanks = 8;            // EP group size limit for the one-process (peer) transport
constexpr int kNumSlots = 1024;         // call-site slots, leased to call sites (runtime/lease.h)
constexpr int kFirstPushSlot = 256;     // slots [0, 256): pull ops (HT); [256, 1024): push (LL)
constexpr int kMaxPtrs = 8;             // addresses one op can publish
constexpr int kMaxLocalExperts = 1024;  // experts per rank of the low-latency ops
constexpr int kMaxLayoutRanks = 64;     // layout kernel: a token's ranks are one 64-bit mask
constexpr int kMaxPositionExperts = 1024;  // expert_positions: per-warp counts in smem
constexpr int kPositionSlicePairs = 2048;  // expert_positions: the pairs of one block
constexpr int kMaxNumBlocks = 4096;        // CTAs of the high-throughput kernels (num_blocks)
// (module.cc exports these limits; jax_ep.runtime.limits() checks them at trace time)
constexpr int kTraceSlots = 32;  // phase timestamps per slot (peer.cuh trace_mark, diagnostic)

// One slot. Flags are monotonically increasing epochs: never reset, so no cleaning kernel.
struct alignas(128) Slot {
  unsigned long long ptrs[kMaxPtrs];   // addresses published by this rank for the current call
  unsigned long long ready;            // epoch e: ptrs of call e are valid
  unsigned long long done[kMaxRanks];  // done[s] = last epoch in which rank s finished reading us
  unsigned long long epoch;            // pull ops: epoch of the last finished call (owner only)
  unsigned int block_counter;          // last-block-done counter (owner only), returns to 0
  unsigned int grid_counter;           // in-kernel grid barrier counter (owner only)
  // Push protocol (transport/push.cuh; the LL kernels). Peers WRITE these flags into our slot
  // and we poll our own memory. Data lands in the slot's receive buffer, double-buffered by the
  // parity of the epoch, so back-to-back calls need no barrier.
  unsigned long long data_flag[2][kMaxRanks];  // [parity][s]: (epoch << 32) | rows, from sender s
  unsigned long long freed[kMaxRanks];         // [q]: last epoch whose data receiver q has read
  unsigned long long send_epoch;               // owner: epoch of the last send phase
  // Peers without load/store access (per-process mode, nvshmem/remote.h) write the flags
  // above with NVSHMEM puts, after their data puts completed (quiet). Pull: a remote peer s sets
  // ready_from[s] = e when its staged operands of call e can be read (its done[] flags serve
  // the end of the call).
  unsigned long long ready_from[kMaxRanks];
  // Work per phase (send, receive): (tickets taken << 32) | items finished, one word so that a
  // warp reports its finished item and takes its next ticket in one atomic. Whichever warps are
  // resident take every ticket before any of them waits on a peer, so no wait ever depends on a
  // block that XLA could not schedule (another kernel holding SMs). Reset by the last block out.
  unsigned long long work[2];
  unsigned int exit_counter;
  // Diagnostic phase tracer (peer.cuh trace_mark, index table there): %globaltimer ns of each
  // phase boundary of the last call on this slot, written by block 0 / the end barrier's last
  // block. Never reset: a mark not reached by the last call keeps an older value.
  unsigned long long trace[kTraceSlots];
};

struct Workspace {
  Slot slots[kNumSlots];
};

// Waits that give up (runtime/fault.h, docs/design.md#clean-timeouts): what the kernels write.
constexpr int kFaultPhaseChars = 96;

// Why the first wait that timed out on one device gave up. Host memory mapped into every
// device; written once by that device (state last), read by the host.
struct FaultRecord {
  int state;                 // 0: none; 1: complete
  int rank;                  // the waiting rank (a virtual rank in the one-GPU multi-rank mode)
  int peer;                  // the rank it waited for (-1: not known at the wait)
  int num_ranks;             // the EP group's size
  unsigned long long epoch;  // the epoch it waited for
  unsigned long long seen;   // the value it last saw
  long long timeout_ns;
  char phase[kFaultPhaseChars];  // "<op>: <phase>", NUL-terminated
};

// Per device, in device memory: the kernels' view.
struct DeviceFault {
  unsigned int failed;    // a wait on this device gave up: the high-throughput kernels end at once
  unsigned int claim;     // the first timed-out wait on this device writes the record
  FaultRecord* record;    // this device's record (mapped host memory)
  unsigned int* aborted;  // HostFaults::aborted (runtime/fault.h; mapped host memory)
};

// How long a wait polls before it also reads the process's `aborted` flag, and how often after.
constexpr long long kAbortPollNs = 1000000;

}  // namespace jax_ep
