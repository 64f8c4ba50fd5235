// The peers mode and the virtual-rank mode (runtime/mode.h): one process, group tables of CUDA
// ordinals or of virtual ids on one device, workspaces and lease buffers in each entry's device
// memory (runtime/workspace.h).
#include <cuda_runtime.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "runtime/device.h"
#include "runtime/mode.h"
#include "runtime/virtual_ranks.h"
#include "runtime/workspace.h"

namespace jax_ep {
namespace {

// Bytes of live lease buffers per CUDA device: counted when a lease is published, uncounted when
// its buffers are freed. Never destroyed (see Reaper).
struct Bytes {
  std::mutex mu;
  std::map<int, int64_t> per_device;
};
Bytes& bytes() {
  static Bytes* b = new Bytes();
  return *b;
}

// Frees buffers off the caller's thread: XLA destroys an executable's state from whichever
// thread drops the executable, possibly one holding the Python GIL, and cudaFree waits for the
// device, which may be waiting on a host callback that needs the GIL. Never destroyed (its
// thread may outlive static destruction at exit; the process then frees everything).
class Reaper {
 public:
  // `counted`: bytes of p that bytes() counts (0: a buffer of a lease never published).
  void free_later(int device, void* p, size_t counted) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({device, p, counted});
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
        std::lock_guard<std::mutex> lock(bytes().mu);
        bytes().per_device[it.device] -= static_cast<int64_t>(it.bytes);
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

class PeersMode : public Mode {
 public:
  void init_groups(const std::vector<std::vector<int>>& table) const override {
    for (const std::vector<int>& g : table) init_group(g);
  }

  std::string self_id(int device, int64_t, int64_t* id) const override {
    *id = device;
    return {};
  }

  Workspace* workspace(const int64_t* members, int n, int r, bool* remote,
                       std::string* why) const override {
    *remote = false;
    const int d = static_cast<int>(members[r]);
    Workspace* ws = group_workspace(members, n, d);
    if (ws == nullptr) {
      std::ostringstream os;
      os << "jax_ep: no workspace on device " << d
         << " for this EP group (the lowering initialises it: was it skipped?)";
      *why = os.str();
    }
    return ws;
  }

  std::string not_a_member(int device, int64_t, const int64_t*, int64_t) const override {
    return "jax_ep: device " + std::to_string(device) + " is not in the EP group table of this op";
  }

  std::unique_lock<std::mutex> lease_guard() const override { return {}; }

  // A zeroed buffer per table entry (a CUDA ordinal, or a virtual rank's id).
  std::vector<int64_t> make_buffers(const LeaseRequest& r, int slot) const override {
    std::vector<int64_t> out;
    if (r.bytes == 0) return out;
    int prev = 0;
    cudaGetDevice(&prev);
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
        os << "jax_ep: allocating a call site's " << (r.push ? "receive" : "staging")
           << " buffer of " << r.bytes << " bytes (slot " << slot << ") on device " << d
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

  void published(const LeaseRequest& r) const override {
    if (r.bytes == 0) return;
    std::lock_guard<std::mutex> lock(bytes().mu);
    for (int64_t id : r.groups) bytes().per_device[id_device(static_cast<int>(id))] += r.bytes;
  }

  void free_buffers(const LeaseRequest& r, const std::vector<int64_t>& bufs,
                    bool published) const override {
    for (size_t i = 0; i < bufs.size(); ++i)
      reaper().free_later(id_device(static_cast<int>(r.groups[i])),
                          reinterpret_cast<void*>(static_cast<uintptr_t>(bufs[i])),
                          published ? r.bytes : 0);
  }

  int64_t buffer_bytes(int device) const override {
    std::lock_guard<std::mutex> lock(bytes().mu);
    int64_t n = 0;
    for (auto& kv : bytes().per_device)
      if (device < 0 || kv.first == device) n += kv.second;
    return n;
  }

  void flush_frees() const override { reaper().flush(); }
};

// The peers mode over the virtual ranks of one device: only this rank's id and the messages
// differ (the ids of a table name the device: workspaces, leases and set-up are the peers').
class VirtualRanksMode : public PeersMode {
 public:
  std::string self_id(int device, int64_t group_size, int64_t* id) const override {
    const VirtualRank* vr = virtual_rank();
    if (vr->num_ranks != group_size)
      return "jax_ep: the stacked operands name " + std::to_string(vr->num_ranks) +
             " virtual ranks, the EP group has " + std::to_string(group_size);
    *id = virtual_id(device, vr->rank);
    return {};
  }

  std::string not_a_member(int device, int64_t, const int64_t* groups, int64_t n) const override {
    std::ostringstream os;
    os << "jax_ep: the virtual ranks of this op were set up on device "
       << (n > 0 ? id_device(static_cast<int>(groups[0])) : -1) << " (at lowering), but it runs on"
       << " device " << device << "; the one-GPU multi-rank mode runs on one device";
    return os.str();
  }
};

}  // namespace

const Mode& peers_mode() {
  static const PeersMode* m = new PeersMode();
  return *m;
}

const Mode& virtual_ranks_mode() {
  static const VirtualRanksMode* m = new VirtualRanksMode();
  return *m;
}

}  // namespace jax_ep
