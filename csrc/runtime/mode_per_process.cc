// The per-process mode (runtime/mode.h): one process per GPU, group tables of NVSHMEM PEs,
// workspaces and lease buffers in the symmetric arena (nvshmem/symmetric.h), every lease
// checked against the peers' (the lease ledger, docs/design.md#lease-ledger).
#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "nvshmem/symmetric.h"
#include "runtime/device.h"
#include "runtime/fault.h"
#include "runtime/mode.h"
#include "runtime/virtual_ranks.h"
#include "testing/mutations.h"

namespace jax_ep {
namespace {

// What the ledger compares across processes: a hash (FNV-1a) of everything a lease is made of.
uint64_t content_hash(const LeaseRequest& r) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 0x100000001b3ull;
  };
  mix(r.push ? 1 : 0);
  mix(r.bytes);
  mix(static_cast<uint64_t>(r.group_size));
  for (int64_t g : r.groups) mix(static_cast<uint64_t>(g));
  return h;
}

// Leases are made one at a time, each checked against the peers' before it is published (so
// no call site gets an unchecked lease, and a race of two threads over one site costs no ledger
// number); the first failed check is kept, since every later lease number is then unchecked or
// off too.
std::mutex& making_mu() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::string& ledger_failure() {  // under making_mu()
  static std::string* s = new std::string();
  return *s;
}

class PerProcessMode : public Mode {
 public:
  void init_groups(const std::vector<std::vector<int>>& table) const override {
    sym::init_groups(table);
  }

  std::string self_id(int, int64_t, int64_t* id) const override {
    if (virtual_rank() != nullptr) return "jax_ep: the one-GPU multi-rank mode runs in one process";
    *id = sym::my_pe();
    return {};
  }

  Workspace* workspace(const int64_t* members, int n, int r, bool* remote,
                       std::string* why) const override {
    std::string err;
    Workspace* ws = sym::group_workspace(members, n, r, remote, &err);
    if (ws == nullptr && !*remote) *why = "jax_ep: PE " + std::to_string(sym::my_pe()) + ": " + err;
    return ws;
  }

  std::string not_a_member(int, int64_t self, const int64_t*, int64_t) const override {
    return "jax_ep: PE " + std::to_string(self) + " is not in the EP group table of this op";
  }

  std::unique_lock<std::mutex> lease_guard() const override {
    std::unique_lock<std::mutex> making(making_mu());
    if (!ledger_failure().empty())
      throw LeaseDisagreement(
          "jax_ep: an earlier compile of this process failed the check of its jax_ep call "
          "sites against its peers', so no later one can be checked; restart the job. The "
          "first failure: " +
          ledger_failure());
    return making;
  }

  // Every lease is numbered in the ledger, with or without a buffer; the peers must have made
  // the same lease (same number, slot, offset and call sites so far) before this one is
  // published and its program may run. This waits for the peers' compiles (under lease_guard,
  // not under the registry's lock).
  std::vector<int64_t> make_buffers(const LeaseRequest& r, int slot) const override {
    std::vector<std::vector<int>> table;  // the PEs of each group
    for (size_t i = 0; i < r.groups.size(); i += static_cast<size_t>(r.group_size))
      table.emplace_back(r.groups.begin() + static_cast<std::ptrdiff_t>(i),
                         r.groups.begin() + static_cast<std::ptrdiff_t>(i + r.group_size));
    sym::LedgerEntry entry;
    std::vector<unsigned long long> addrs =
        sym::reserve(table, slot, r.bytes, content_hash(r), &entry);
    std::vector<int64_t> bufs;
    if (r.bytes > 0)
      for (unsigned long long v : addrs) bufs.push_back(static_cast<int64_t>(v));
    if (!JAX_EP_PLANTED(kLedgerUnread)) {
      const std::string why = sym::check_lease(entry, table, r.timeout_ns);
      if (!why.empty()) {
        ledger_failure() = why;
        throw LeaseDisagreement(why);
      }
    }
    return bufs;
  }

  void published(const LeaseRequest&) const override {}
  // Arena memory is never reused (nvshmem/symmetric.h): nothing to free.
  void free_buffers(const LeaseRequest&, const std::vector<int64_t>&, bool) const override {}
  int64_t buffer_bytes(int) const override { return 0; }  // arena: sym::arena_used()
  void flush_frees() const override {}
};

}  // namespace

const Mode& per_process_mode() {
  static const PerProcessMode* m = new PerProcessMode();
  return *m;
}

void attach_per_process(size_t arena_bytes) {
  sym::attach(arena_bytes);
  // The fault record of this process's GPU (the one attach registered): the waits of its
  // kernels write it. Set-up, like attach: before any op of the mode is lowered.
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice", device);
  fault::ensure(device);
}

}  // namespace jax_ep
