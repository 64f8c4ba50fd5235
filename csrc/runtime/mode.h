// The process mode: how the ranks of an EP group find each other. The one seam between the modes
// and the code that resolves groups (ffi/group.cc), makes the call-site leases' buffers
// (runtime/lease.cc) and sets groups up (module_runtime.cc: _C.init_groups); none of it asks
// which mode runs. (The virtual-rank mode's launch gate and SM share stay with it, in
// runtime/virtual_ranks.cc and runtime/device.cc: the launchers reach them through
// kernels/launch.cuh and the handlers' grid sizes.) The modes:
//
//   peers          one process over all GPUs of a node. Group tables name CUDA ordinals; each
//                  entry's workspace and lease buffers are device memory of that GPU, reached by
//                  the others through peer access (runtime/workspace.h).
//   virtual ranks  the R ranks of a group on one GPU (runtime/virtual_ranks.h, docs/testing.md):
//                  the peers mode, with tables naming virtual ids and every launch gated. Only
//                  inside a virtual-rank call (the _vr handlers); its set-up and leases are the
//                  peers mode's (the ids say which device).
//   per-process    one process per GPU, after sym::attach (nvshmem/symmetric.h). Tables name
//                  NVSHMEM PEs; workspaces and lease buffers live in the symmetric arena, every
//                  lease is checked against the peers' (the lease ledger).
//
// A new way of reaching peers (several nodes) is a new implementation of Mode, chosen by
// current_mode(). Host code only: the kernels never see the mode, only the PeerSlots that
// group resolution builds from it.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/limits.h"
#include "runtime/lease.h"

namespace jax_ep {

class Mode {
 public:
  virtual ~Mode() = default;
  // ---- Groups: set-up (lowering) and resolution (every handler call).
  // The workspaces of every group of `table` (rows: a group's entries in axis order), once per
  // group: the lowering calls it before an op of those groups is compiled. Throws
  // std::runtime_error naming what failed. Set-up only: never while a handler runs.
  virtual void init_groups(const std::vector<std::vector<int>>& table) const = 0;
  // This rank's entry in the group tables of an op running on CUDA device `device`, whose
  // groups have group_size ranks. Returns "" and sets *id, or an argument error (the op's
  // groups cannot run in this mode), the whole message.
  virtual std::string self_id(int device, int64_t group_size, int64_t* id) const = 0;
  // This process's address of the workspace of rank r of the group members[0..n) (a row of an
  // op's group table that holds self_id). Null with *remote set: rank r is reached only through
  // NVSHMEM kernels (nvshmem/remote.h). Null otherwise: the group was never set up, and *why is
  // the whole message.
  virtual Workspace* workspace(const int64_t* members, int n, int r, bool* remote,
                               std::string* why) const = 0;
  // The message when no entry of the group table groups[0..n) is `self` on `device`.
  virtual std::string not_a_member(int device, int64_t self, const int64_t* groups,
                                   int64_t n) const = 0;

  // ---- Lease buffers (runtime/lease.h; the slot pool and the registry are the same in every
  // mode). A lease is made while lease_guard() is held: make_buffers, then published or
  // free_buffers(published = false). Its destructor calls free_buffers(published = true).
  // Per-process: one lease at a time, in order; throws LeaseDisagreement once a lease failed
  // its check against the peers (every later one would be unchecked).
  virtual std::unique_lock<std::mutex> lease_guard() const = 0;
  // The buffers of a new lease of `slot`: r.bytes for each entry of r.groups, aligned with it
  // (empty when the mode makes none, e.g. r.bytes == 0). Throws std::runtime_error naming what
  // failed, after freeing what it made; per-process: LeaseDisagreement when a peer's lease of
  // the same number differs, or does not come in r.timeout_ns.
  virtual std::vector<int64_t> make_buffers(const LeaseRequest& r, int slot) const = 0;
  // The lease of r with buffers from make_buffers is now the site's (called under the lease
  // registry's lock).
  virtual void published(const LeaseRequest& r) const = 0;
  // Gives back the buffers of a lease: a released one (published), or one made but never
  // published (lost a race, or failed later). Never throws, never waits for the device.
  virtual void free_buffers(const LeaseRequest& r, const std::vector<int64_t>& bufs,
                            bool published) const = 0;
  // Bytes of the live lease buffers this mode allocated on CUDA device `device` (-1: all).
  virtual int64_t buffer_bytes(int device) const = 0;
  // Waits until the buffers given back so far are freed (tests, memory reports).
  virtual void flush_frees() const = 0;
};

// The mode of the calling thread: per-process once this process attached to NVSHMEM; else the
// virtual-rank mode inside a virtual-rank call (runtime/virtual_ranks.h, VirtualRankScope);
// else peers. A handler asks once per call.
const Mode& current_mode();

// The implementations (runtime/mode_peers.cc, runtime/mode_per_process.cc).
const Mode& peers_mode();
const Mode& virtual_ranks_mode();
const Mode& per_process_mode();

// Enters the per-process mode: attaches to the NVSHMEM runtime of this process (sym::attach,
// collective; idempotent), then sets up the fault record of this process's GPU. Throws
// std::runtime_error saying what to do.
void attach_per_process(size_t arena_bytes);

}  // namespace jax_ep
