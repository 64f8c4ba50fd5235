#include "runtime/lease.h"

#include <cuda_runtime.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "nvshmem/symmetric.h"
#include "runtime/device.h"
#include "runtime/virtual_ranks.h"
#include "runtime/workspace.h"
#include "testing/mutations.h"

namespace jax_ep {
namespace {

// The registry, the slot pool and the byte counts, under `mu`. Never destroyed: an executable
// that jaxlib destroys during static destruction at exit still releases its lease here.
struct Registry {
  std::mutex mu;
  std::map<uint64_t, std::weak_ptr<Lease>> leases;
  bool slot_used[kNumSlots] = {};
  std::map<int, int64_t> bytes;  // live one-process buffer bytes per CUDA device
  int64_t created = 0;
};
Registry& reg() {
  static Registry* r = new Registry();
  return *r;
}

// Frees buffers off the caller's thread: XLA destroys an executable's state from whichever
// thread drops the executable, possibly one holding the Python GIL, and cudaFree waits for the
// device, which may be waiting on a host callback that needs the GIL. Never destroyed (its
// thread may outlive static destruction at exit; the process then frees everything).
class Reaper {
 public:
  void free_later(int device, void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({device, p, bytes});
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
    cv_.notify_one();
  }
  void flush() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [this] { return queue_.empty() && busy_ == 0; });
  }

 private:
  struct Item {
    int device;
    void* p;
    size_t bytes;
  };
  void loop() {
    for (;;) {
      Item it;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        it = queue_.front();
        queue_.pop_front();
        ++busy_;
      }
      if (cudaSetDevice(it.device) == cudaSuccess) cudaFree(it.p);
      cudaGetLastError();  // at exit the runtime may be gone: nothing to report to
      {
        std::lock_guard<std::mutex> lock(reg().mu);
        reg().bytes[it.device] -= static_cast<int64_t>(it.bytes);
      }
      std::lock_guard<std::mutex> lock(mu_);
      --busy_;
      if (queue_.empty() && busy_ == 0) idle_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_;
  std::deque<Item> queue_;
  int busy_ = 0;
  bool started_ = false;
};
Reaper& reaper() {
  static Reaper* r = new Reaper();
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

// Returns the slot and one-process buffers taken for a lease that was not published.
void give_back(const LeaseRequest& r, int slot, const std::vector<int64_t>& bufs) {
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    reg().slot_used[slot] = false;
  }
  if (sym::active()) return;
  for (size_t i = 0; i < bufs.size(); ++i)
    reaper().free_later(id_device(static_cast<int>(r.groups[i])),
                        reinterpret_cast<void*>(static_cast<uintptr_t>(bufs[i])), 0);
}

// One-process mode: a zeroed buffer per table entry (a CUDA ordinal, or a virtual rank's id).
std::vector<int64_t> allocate_buffers(const LeaseRequest& r, int slot) {
  int prev = 0;
  cudaGetDevice(&prev);
  std::vector<int64_t> out;
  for (int64_t id : r.groups) {
    const int d = id_device(static_cast<int>(id));
    void* p = nullptr;
    cudaError_t e = cudaSetDevice(d);
    if (e == cudaSuccess) e = cudaMalloc(&p, r.bytes);
    if (e == cudaSuccess) e = zero_device_memory(p, r.bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (p != nullptr) cudaFree(p);
      for (size_t i = 0; i < out.size(); ++i)
        reaper().free_later(id_device(static_cast<int>(r.groups[i])),
                            reinterpret_cast<void*>(out[i]), 0);
      cudaSetDevice(prev);
      std::ostringstream os;
      os << "jax_ep: allocating a call site's " << (r.push ? "receive" : "staging") << " buffer of "
         << r.bytes << " bytes (slot " << slot << ") on device " << d
         << " failed: " << cudaGetErrorString(e)
         << ". It is sized from max_tokens_per_rank, the hidden size and top-k; leave that "
            "much GPU memory outside JAX's pool (XLA_PYTHON_CLIENT_MEM_FRACTION), or drop "
            "compiled programs that are no longer used.";
      throw std::runtime_error(os.str());
    }
    out.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)));
  }
  cudaSetDevice(prev);
  return out;
}

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
  // Per-process buffers are arena memory, never reused (nvshmem/symmetric.h): nothing to free.
  if (sym::active() || request.bytes == 0) return;
  for (size_t i = 0; i < bufs.size(); ++i)
    reaper().free_later(id_device(static_cast<int>(request.groups[i])),
                        reinterpret_cast<void*>(static_cast<uintptr_t>(bufs[i])), request.bytes);
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

// Per-process mode: leases are made one at a time, each checked against the peers' before it
// is published (so no call site gets an unchecked lease, and a race of two threads over one
// site costs no ledger number); the first failed check is kept, since every later lease number
// is then unchecked or off too.
std::mutex& making_mu() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::string& ledger_failure() {  // under making_mu()
  static std::string* s = new std::string();
  return *s;
}

std::shared_ptr<const Lease> acquire_lease(const LeaseRequest& r) {
  std::unique_lock<std::mutex> making;
  if (sym::active()) {
    making = std::unique_lock<std::mutex>(making_mu());
    if (!ledger_failure().empty())
      throw LeaseDisagreement(
          "jax_ep: an earlier compile of this process failed the check of its jax_ep call "
          "sites against its peers', so no later one can be checked; restart the job. The "
          "first failure: " +
          ledger_failure());
  }
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
  // Buffers outside the lock (allocation and zeroing take a while).
  std::vector<int64_t> bufs;
  std::vector<std::vector<int>> table;  // per-process mode: the PEs of each group
  sym::LedgerEntry entry;
  try {
    if (sym::active()) {
      // Every per-process lease is numbered in the ledger, with or without a buffer.
      for (size_t i = 0; i < r.groups.size(); i += static_cast<size_t>(r.group_size))
        table.emplace_back(r.groups.begin() + static_cast<std::ptrdiff_t>(i),
                           r.groups.begin() + static_cast<std::ptrdiff_t>(i + r.group_size));
      std::vector<unsigned long long> addrs =
          sym::reserve(table, slot, r.bytes, content_hash(r), &entry);
      if (r.bytes > 0)
        for (unsigned long long v : addrs) bufs.push_back(static_cast<int64_t>(v));
    } else if (r.bytes > 0) {
      bufs = allocate_buffers(r, slot);
    }
  } catch (...) {
    give_back(r, slot, {});  // the allocations free what they made before failing
    throw;
  }
  // Per-process mode: the peers must have made the same lease (same number, slot, offset and
  // call sites so far) before this one is published and its program may run. This waits for
  // the peers' compiles (not under the registry's lock).
  if (sym::active() && !JAX_EP_PLANTED(kLedgerUnread)) {
    const std::string why = sym::check_lease(entry, table, r.timeout_ns);
    if (!why.empty()) {
      give_back(r, slot, bufs);  // per-process: the slot only (arena memory is never reused)
      ledger_failure() = why;
      throw LeaseDisagreement(why);
    }
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
      if (r.bytes > 0 && !sym::active())
        for (int64_t id : r.groups) reg().bytes[id_device(static_cast<int>(id))] += r.bytes;
      ++reg().created;
      reg().leases[r.site] = lease;
      live = lease;
      ours = true;
    }
  }
  if (!ours) {
    give_back(r, slot, bufs);
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
  for (auto& kv : reg().bytes) s.buffer_bytes += kv.second;
  s.created = reg().created;
  return s;
}

int64_t lease_buffer_bytes(int device) {
  std::lock_guard<std::mutex> lock(reg().mu);
  auto it = reg().bytes.find(device);
  return it == reg().bytes.end() ? 0 : it->second;
}

void flush_buffer_frees() { reaper().flush(); }

}  // namespace jax_ep
