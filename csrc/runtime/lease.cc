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

// Planted bugs of the mutation check (scripts/gpu_check.sh lease-mutations; 0 in real builds):
// 5: a released lease keeps its slot and buffers (memory never comes back);
// 6: every push lease takes the first push slot (call sites share epochs and pending sends).
#ifndef JAX_EP_MUTATION
#define JAX_EP_MUTATION 0
#endif

namespace jax_ep {
namespace {

std::mutex g_mu;  // the registry, the slot pool and the byte counts
std::map<uint64_t, std::weak_ptr<Lease>> g_leases;
bool g_slot_used[kNumSlots] = {};
std::map<int, int64_t> g_bytes;  // live one-process buffer bytes per CUDA device
int64_t g_created = 0;

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
        std::lock_guard<std::mutex> lock(g_mu);
        g_bytes[it.device] -= static_cast<int64_t>(it.bytes);
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

int take_slot(bool push) {  // caller holds g_mu; -1 when none is free
  const int lo = push ? kFirstPushSlot : 0, hi = push ? kNumSlots : kFirstPushSlot;
  if (JAX_EP_MUTATION == 6 && push) return kFirstPushSlot;
  for (int s = lo; s < hi; ++s)
    if (!g_slot_used[s]) {
      g_slot_used[s] = true;
      return s;
    }
  return -1;
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

bool same_request(const LeaseRequest& a, const LeaseRequest& b) {
  return a.groups == b.groups && a.group_size == b.group_size && a.push == b.push &&
         a.bytes == b.bytes;
}

}  // namespace

Lease::~Lease() {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_leases.find(request.site);
  if (it != g_leases.end() && it->second.expired()) g_leases.erase(it);
  if (JAX_EP_MUTATION == 5) return;
  if (slot >= 0) g_slot_used[slot] = false;
  // Per-process buffers are slot-owned symmetric memory (nvshmem/symmetric.h): nothing to free.
  if (sym::active() || request.bytes == 0) return;
  for (size_t i = 0; i < bufs.size(); ++i)
    reaper().free_later(id_device(static_cast<int>(request.groups[i])),
                        reinterpret_cast<void*>(static_cast<uintptr_t>(bufs[i])), request.bytes);
}

std::shared_ptr<const Lease> acquire_lease(const LeaseRequest& r) {
  int slot = -1;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_leases.find(r.site);
    if (it != g_leases.end())
      if (std::shared_ptr<Lease> live = it->second.lock()) {
        if (!same_request(live->request, r))
          throw std::runtime_error(
              "jax_ep: two call sites share a site id but differ in group table, kind or "
              "buffer size (the halves of a split op, and split sends sharing a pair name, must "
              "agree)");
        return live;
      }
    slot = take_slot(r.push);
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
  std::vector<int64_t> bufs;
  try {
    if (r.bytes > 0 && sym::active()) {
      std::vector<std::vector<int>> table;
      for (size_t i = 0; i < r.groups.size(); i += static_cast<size_t>(r.group_size))
        table.emplace_back(r.groups.begin() + static_cast<std::ptrdiff_t>(i),
                           r.groups.begin() + static_cast<std::ptrdiff_t>(i + r.group_size));
      for (unsigned long long v : sym::reserve(table, slot, r.bytes))
        bufs.push_back(static_cast<int64_t>(v));
    } else if (r.bytes > 0) {
      bufs = allocate_buffers(r, slot);
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_slot_used[slot] = false;
    throw;
  }
  auto lease = std::make_shared<Lease>();
  lease->request = r;
  lease->slot = slot;
  lease->bufs = std::move(bufs);
  std::lock_guard<std::mutex> lock(g_mu);
  if (r.bytes > 0 && !sym::active())
    for (int64_t id : r.groups) g_bytes[id_device(static_cast<int>(id))] += r.bytes;
  ++g_created;
  g_leases[r.site] = lease;
  return lease;
}

LeaseStats lease_stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  LeaseStats s;
  for (auto& kv : g_leases) s.live += kv.second.expired() ? 0 : 1;
  for (int i = 0; i < kNumSlots; ++i)
    if (!g_slot_used[i]) ++(i < kFirstPushSlot ? s.free_pull : s.free_push);
  for (auto& kv : g_bytes) s.buffer_bytes += kv.second;
  s.created = g_created;
  return s;
}

int64_t lease_buffer_bytes(int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_bytes.find(device);
  return it == g_bytes.end() ? 0 : it->second;
}

void flush_buffer_frees() { reaper().flush(); }

}  // namespace jax_ep
