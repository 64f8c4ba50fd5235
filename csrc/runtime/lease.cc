#include "runtime/lease.h"

#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "common/limits.h"
#include "runtime/mode.h"
#include "testing/mutations.h"

namespace jax_ep {
namespace {

// The registry and the slot pool, under `mu`. Never destroyed: an executable that jaxlib
// destroys during static destruction at exit still releases its lease here.
struct Registry {
  std::mutex mu;
  std::map<uint64_t, std::weak_ptr<Lease>> leases;
  bool slot_used[kNumSlots] = {};
  int64_t created = 0;
};
Registry& reg() {
  static Registry* r = new Registry();
  return *r;
}

int take_slot(bool push) {  // caller holds reg().mu; -1 when none is free
  const int lo = push ? kFirstPushSlot : 0, hi = push ? kNumSlots : kFirstPushSlot;
  if (JAX_EP_PLANTED(kOnePushSlot) && push) return kFirstPushSlot;
  for (int s = lo; s < hi; ++s)
    if (!reg().slot_used[s]) {
      reg().slot_used[s] = true;
      return s;
    }
  return -1;
}

// Returns the slot and buffers taken for a lease that was not published.
void give_back(const Mode& mode, const LeaseRequest& r, int slot,
               const std::vector<int64_t>& bufs) {
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    reg().slot_used[slot] = false;
  }
  mode.free_buffers(r, bufs, /*published=*/false);
}

bool same_request(const LeaseRequest& a, const LeaseRequest& b) {
  return a.groups == b.groups && a.group_size == b.group_size && a.push == b.push &&
         a.bytes == b.bytes;
}

}  // namespace

Lease::~Lease() {
  std::lock_guard<std::mutex> lock(reg().mu);
  auto it = reg().leases.find(request.site);
  if (it != reg().leases.end() && it->second.expired()) reg().leases.erase(it);
  if (JAX_EP_PLANTED(kLeaseKeepsSlot)) return;
  if (slot >= 0) reg().slot_used[slot] = false;
  if (mode != nullptr) mode->free_buffers(request, bufs, /*published=*/true);
}

// The live lease of r.site, or null. Caller holds reg().mu. *mismatch: it names another table,
// kind or size (the error is raised by the caller after unlocking: dropping the last reference
// of a lease locks the registry).
std::shared_ptr<Lease> live_lease(const LeaseRequest& r, bool* mismatch) {
  auto it = reg().leases.find(r.site);
  if (it == reg().leases.end()) return nullptr;
  std::shared_ptr<Lease> live = it->second.lock();
  *mismatch = live != nullptr && !same_request(live->request, r);
  return live;
}

void throw_mismatch() {
  throw std::runtime_error(
      "jax_ep: two call sites share a site id but differ in group table, kind or buffer size "
      "(the halves of a split op, and split sends sharing a pair name, must agree)");
}

std::shared_ptr<const Lease> acquire_lease(const LeaseRequest& r) {
  // The process mode makes the buffers (runtime/mode.h); per-process, one lease at a time.
  const Mode& mode = current_mode();
  std::unique_lock<std::mutex> making = mode.lease_guard();
  int slot = -1;
  {
    std::shared_ptr<Lease> live;
    bool mismatch = false;
    {
      std::lock_guard<std::mutex> lock(reg().mu);
      live = live_lease(r, &mismatch);
      if (live == nullptr) slot = take_slot(r.push);
    }
    if (mismatch) throw_mismatch();
    if (live != nullptr) return live;
    if (slot < 0) {
      std::ostringstream os;
      os << "jax_ep: no free " << (r.push ? "low-latency" : "high-throughput")
         << " workspace slot: the " << (r.push ? kNumSlots - kFirstPushSlot : kFirstPushSlot)
         << " slots of that kind are held by call sites of compiled programs that are still "
            "alive (each call site holds one while its executable lives). Drop programs that "
            "are no longer used (jax.clear_caches() drops JAX's cached ones).";
      throw std::runtime_error(os.str());
    }
  }
  // Buffers outside the lock (allocation and zeroing take a while; per-process, the check
  // against the peers' leases waits for their compiles).
  std::vector<int64_t> bufs;
  try {
    bufs = mode.make_buffers(r, slot);
  } catch (...) {
    give_back(mode, r, slot, {});  // make_buffers frees what it made before failing
    throw;
  }
  std::shared_ptr<Lease> live;
  bool mismatch = false, ours = false;
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    // Another thread may have made the lease of this site meanwhile (one lowering compiled
    // twice at once): then that one is the site's, and our slot and buffers go back.
    live = live_lease(r, &mismatch);
    if (live == nullptr) {
      auto lease = std::make_shared<Lease>();
      lease->request = r;
      lease->slot = slot;
      lease->bufs = std::move(bufs);
      lease->mode = &mode;
      mode.published(r);
      ++reg().created;
      reg().leases[r.site] = lease;
      live = lease;
      ours = true;
    }
  }
  if (!ours) {
    give_back(mode, r, slot, bufs);
    if (mismatch) throw_mismatch();
  }
  return live;
}

LeaseStats lease_stats() {
  std::lock_guard<std::mutex> lock(reg().mu);
  LeaseStats s;
  for (auto& kv : reg().leases) s.live += kv.second.expired() ? 0 : 1;
  for (int i = 0; i < kNumSlots; ++i)
    if (!reg().slot_used[i]) ++(i < kFirstPushSlot ? s.free_pull : s.free_push);
  s.buffer_bytes = current_mode().buffer_bytes(-1);
  s.created = reg().created;
  return s;
}

int64_t lease_buffer_bytes(int device) { return current_mode().buffer_bytes(device); }

void flush_buffer_frees() { current_mode().flush_frees(); }

}  // namespace jax_ep
