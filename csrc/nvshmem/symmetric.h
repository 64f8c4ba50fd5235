// Per-process mode (one JAX process per GPU): workspaces and data buffers live in one NVSHMEM
// symmetric allocation (the arena) that every PE makes at attach time. Sub-allocations are
// bump-allocated in the order the processes ask for them (workspaces as groups appear, slot
// buffers as call sites lease slots, runtime/lease.h); every process compiles the same programs
// in the same order (SPMD), so an offset names the same buffer on every PE. Peers reachable by
// loads and stores (NVLink / P2P) are addressed through nvshmem_ptr; the kernels then use the
// same code as in the one-process mode. The group table names PEs (process indices), not CUDA
// ordinals, in this mode.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/limits.h"  // Workspace, kNumSlots

namespace jax_ep {
namespace sym {

// True when the extension was compiled against NVSHMEM (CMake option JAX_EP_WITH_NVSHMEM and
// the wheel found; otherwise unbuilt.cc stands in for symmetric.cc).
bool built();
// True after attach(): the ops of this process run in per-process mode.
bool active();
int my_pe();
int n_pes();

// Attach to the NVSHMEM runtime that the caller (nvshmem4py) initialised in this process (through
// runtime/mode.h attach_per_process, which then sets up the fault record of this process's GPU):
// resolve its host library, register this module's NVSHMEM device state with it, allocate and
// zero the arena (collective: every PE calls it with the same size), then barrier. Throws
// std::runtime_error with a message saying what to do on failure. Idempotent.
void attach(size_t arena_bytes);
// Collective check that our kernels can call NVSHMEM device functions: each PE's kernel reads
// nvshmem_my_pe / nvshmem_n_pes on the device and nvshmem_int_p's a token into the next PE's
// cell; returns {device my_pe, device n_pes, token received, token expected, next PE mapped}.
std::vector<long long> self_test();

// Workspaces of every group of a table (PEs in axis order), in table order, new groups only.
void init_groups(const std::vector<std::vector<int>>& table);
// This process's address of rank r's workspace in the group `members[0..n)`. Null with
// *remote = true: rank r is not reachable by loads and stores (nvshmem/remote.h); null
// otherwise: unknown group, err names the reason.
Workspace* group_workspace(const int64_t* members, int n, int r, bool* remote, std::string* err);
// The lease ledger: every lease a process makes in per-process mode, numbered in the order it
// made them, in a ring of entries at a fixed place of its arena that peers read. Every process
// must make the same leases in the same order (same slot, same buffer offset, same call-site
// content); a lease is checked against every peer's entry of the same number before its
// program may run (docs/design.md#lease-ledger).
struct LedgerEntry {
  uint64_t number_plus1 = 0;  // the lease's number + 1 (0: never written)
  uint64_t chain = 0;         // hash of the contents of this lease and of every earlier one
  int64_t slot = -1;
  uint64_t offset = 0;  // arena offset of the lease's buffer
};
inline constexpr int kLedgerEntries = 4096;

// Symmetric buffer of at least `bytes` for a new lease of slot `slot` (the per-process mode,
// runtime/mode_per_process.cc): fresh arena memory (zero since attach; never reused, as a faster
// peer may already have written into it), at the same offset on every PE when every process
// leases in the same order.
// Returns, aligned with the flattened table, the addresses this process uses for each member
// of its own group, and 0 for the members of other groups. A member without load/store access
// gets instead this process's scratch image for it (the push ops' send area for that member,
// the pull ops' mirror of its staging buffer), with bit 0 set to say so.
// The lease is also written to the ledger (`content`: a hash of the call site's request), and
// *entry says what was written. bytes may be 0 (no buffer; the lease is still numbered).
std::vector<unsigned long long> reserve(const std::vector<std::vector<int>>& table, int slot,
                                        size_t bytes, uint64_t content, LedgerEntry* entry);
// Compares `mine` with the ledger entry of the same number of every other member of this
// process's groups in `table` (read by loads, or by NVSHMEM gets for members that loads do not
// reach), waiting up to timeout_ns for members that have not made that lease yet. Callers are
// serialised (runtime/mode_per_process.cc: one lease is made at a time). Returns "" when all agree,
// else a message naming the process and what differs (or that it did not get there in time).
std::string check_lease(const LedgerEntry& mine, const std::vector<std::vector<int>>& table,
                        long long timeout_ns);
// PEs this process reaches only through NVSHMEM operations (no load/store mapping, or all of
// them with JAX_EP_FORCE_REMOTE_PEERS=1): the ops then run the nvshmem/remote.h kernels.
std::vector<int> remote_pes();
size_t arena_bytes();
size_t arena_used();

}  // namespace sym
}  // namespace jax_ep
