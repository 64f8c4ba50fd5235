// Per-device workspace: a small block of device memory that every peer in the process can
// read and write (peer access). It holds, per call-site slot, the addresses each op publishes
// for its peers and the epoch flags that order the ranks. Data never goes through it: peers
// read each other's XLA buffers directly (pull design), so its size does not depend on shapes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

constexpr int kMaxRanks = 8;       // EP group size limit for the one-process (peer) transport
constexpr int kNumSlots = 64;      // call-site slots; each op names one (attribute "slot")
constexpr int kMaxPtrs = 8;        // addresses one op can publish
constexpr int kMaxLocalExperts = 1024;
constexpr int kMaxChunks = 128;    // per-source chunk flags of the push protocol (LL dispatch)
constexpr int kTraceSlots = 32;    // phase timestamps per slot (peer.cuh trace_mark, diagnostic)

// One slot. Flags are monotonically increasing epochs: never reset, so no cleaning kernel.
struct alignas(128) Slot {
  unsigned long long ptrs[kMaxPtrs];   // addresses published by this rank for the current call
  unsigned long long ready;            // epoch e: ptrs of call e are valid
  unsigned long long done[kMaxRanks];  // done[s] = last epoch in which rank s finished reading us
  unsigned long long epoch;            // epoch of the last finished call (touched by owner only)
  unsigned int block_counter;          // last-block-done counter (owner only), returns to 0
  unsigned int grid_counter;           // in-kernel grid barrier counter (owner only)
  int counters[kMaxLocalExperts];      // per-op scratch counters, left at 0 by every op
  // Push variant of the protocol (peer.cuh "push_*"; used by the LL kernels): peers WRITE into
  // our slot, we poll our own memory (one NVLink one-way trip instead of remote polling).
  unsigned long long in_ptrs[kMaxRanks][kMaxPtrs];       // in_ptrs[s]: addresses rank s published
  unsigned long long in_ready[kMaxRanks];                // epoch e: in_ptrs[s] of call e valid
  unsigned long long chunk_ready[kMaxRanks][kMaxChunks];  // epoch e: rank s's chunk c is ready
  // Work tickets of the op's own-side tasks (LL FP8 quantisation chunks): whichever blocks are
  // resident take them all before any block waits on a peer, so no wait ever depends on a block
  // that XLA could not schedule (another kernel holding SMs). Back to 0 at the op's end.
  unsigned int work_ticket;
  // Diagnostic phase tracer (peer.cuh trace_mark, index table there): %globaltimer ns of each
  // phase boundary of the last call on this slot, written by block 0 / the end barrier's last
  // block. Never reset: a mark not reached by the last call keeps an older value.
  unsigned long long trace[kTraceSlots];
};

struct Workspace {
  Slot slots[kNumSlots];
};

// Host side registry. Every EP group (its devices in axis order) owns one Workspace on each of
// its devices: slot epochs count the calls of that group only, so groups that share a device
// (a 2-GPU mesh and a 4-GPU mesh in one process, say) never see each other's epochs.
// init_group allocates them (once, zeroed) and enables peer access between the group's devices
// ("already enabled" counts as success). Idempotent; thread-safe.
void init_group(const std::vector<int>& devices);
// Workspace of `device` for the group `devices[0..n)`, or nullptr when init_group did not run.
Workspace* group_workspace(const int64_t* devices, int n, int device);
std::vector<int> runtime_devices();
int runtime_num_groups();
// Diagnostic: the kNumSlots * kTraceSlots phase timestamps (Slot::trace, ns) of the group's
// workspace on `device`, slot-major. Throws std::runtime_error when the group is unknown or a
// CUDA call fails. Synchronous copies: call it after the ops have finished.
std::vector<unsigned long long> read_traces(const std::vector<int>& group, int device);

}  // namespace jax_ep
