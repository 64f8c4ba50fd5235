// Call-site leases: what one call site of a compiled program owns while that program lives.
//
// A lease is one workspace slot (its epoch counters and flags, the same index in the workspace
// of every EP group of the call site's table) and, when the op needs one, a data buffer per
// entry of the table (the low-latency receive buffers; the staging buffers of the
// high-throughput ops in per-process mode). The FFI instantiate stage of every communication
// handler takes a lease for its call site (ffi/site_state.h), and XLA destroys that state with
// the executable: the slot goes back to the pool and the buffers are freed. So two call sites
// that can be in flight together never share a slot or a buffer, however many call sites or
// programs a process compiles (docs/design.md#call-site-leases).
//
// A lease is keyed by the `site` attribute the lowering gives each call site (the two halves of
// a split op carry the same one): call sites naming one site share its lease, which lives while
// any of them does (an executable compiled twice from one lowering shares it too; the layout is
// the same, and the epochs order the calls).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace jax_ep {

struct LeaseRequest {
  uint64_t site = 0;            // the lowering's call-site id
  std::vector<int64_t> groups;  // flattened group table [num_groups * group_size]
  int group_size = 0;
  bool push = false;         // slot range: push (low-latency) or pull (high-throughput)
  size_t bytes = 0;          // data buffer per table entry; 0: none
  long long timeout_ns = 0;  // per-process mode: bound of the wait for the peers' leases (the
                             // op's timeout_ns attribute, from JAX_EP_TIMEOUT_S)
};

// Per-process mode: this process's lease disagrees with a peer's lease of the same number, or
// the peer did not make it in time (nvshmem/symmetric.h, the lease ledger).
struct LeaseDisagreement : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Mode;  // runtime/mode.h

struct Lease {
  LeaseRequest request;
  int slot = -1;               // index of Workspace::slots, the same in every group's workspace
  std::vector<int64_t> bufs;   // aligned with request.groups (empty when request.bytes == 0)
  const Mode* mode = nullptr;  // the process mode that made the buffers, and frees them
  ~Lease();
};

// The lease of r.site: the live one when another call site holds it (it must then name the same
// table, kind and size: a lowering bug otherwise), else a new one, whose buffers the process
// mode makes (runtime/mode.h). Throws std::runtime_error naming what is missing: no free slot
// (the message gives the limit), or device memory; in per-process mode a new lease is first
// compared with the peers' (LeaseDisagreement).
std::shared_ptr<const Lease> acquire_lease(const LeaseRequest& r);

struct LeaseStats {
  int64_t live = 0;          // leases alive
  int64_t free_push = 0;     // push slots not leased
  int64_t free_pull = 0;     // pull slots not leased
  int64_t buffer_bytes = 0;  // bytes of live data buffers the process mode allocated, all devices
  int64_t created = 0;       // leases made since start
};
LeaseStats lease_stats();
// Bytes of live data buffers the process mode allocated on one CUDA device (the peers mode's:
// the per-process arena is not counted here).
int64_t lease_buffer_bytes(int device);
// Wait until the buffers of released leases are freed (they are freed on a thread of their own,
// never on the thread that drops an executable). For tests and memory reports.
void flush_buffer_frees();

}  // namespace jax_ep
