// Per-device workspace: a small block of device memory that every peer in the process can
// read and write (peer access). It holds, per call-site slot, the addresses each op publishes
// for its peers and the epoch flags that order the ranks. High-throughput data never goes
// through it (peers read each other's XLA buffers: pull design). The low-latency ops push their
// data into receive buffers of their call site, sized from the static shapes. Slots and buffers
// are leased to call sites while their executables live (runtime/lease.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

constexpr int kMaxRanks = 8;            // EP group size limit for the one-process (peer) transport
constexpr int kNumSlots = 1024;         // call-site slots, leased to call sites (runtime/lease.h)
constexpr int kFirstPushSlot = 256;     // slots [0, 256): pull ops (HT); [256, 1024): push (LL)
constexpr int kMaxPtrs = 8;             // addresses one op can publish
constexpr int kMaxLocalExperts = 1024;  // experts per rank of the low-latency ops
constexpr int kMaxLayoutRanks = 64;     // layout kernel: a token's ranks are one 64-bit mask
constexpr int kMaxNumBlocks = 4096;     // CTAs of the high-throughput kernels (num_blocks)
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

// Host side registry. Every EP group (its devices in axis order) owns one Workspace on each of
// its devices: slot epochs count the calls of that group only, so groups that share a device
// (a 2-GPU mesh and a 4-GPU mesh in one process, say) never see each other's epochs. The
// entries of a group are CUDA ordinals, or the ids of virtual ranks on one device
// (runtime/virtual_ranks.h): each id gets its own workspace and receive buffers.
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
