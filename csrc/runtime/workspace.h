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

#include "common/limits.h"  // the limits, Slot and Workspace

namespace jax_ep {

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
