#include "runtime/fault.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>

namespace jax_ep {
namespace fault {
namespace {

std::mutex g_mu;
std::atomic<HostFaults*> g_host{nullptr};     // mapped host memory, never freed
DeviceFault* g_device[kMaxDevices] = {};      // device memory, never freed
std::atomic<bool> g_ready[kMaxDevices] = {};  // g_device[d] is set

// A record as the device wrote it: state first, then (after an acquire fence) the fields.
bool read_record(HostFaults* host, int d, FaultRecord* out) {
  const volatile FaultRecord* r = &host->device[d];
  if (r->state != 1) return false;
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(out, const_cast<const FaultRecord*>(r), sizeof(FaultRecord));
  out->phase[kFaultPhaseChars - 1] = '\0';
  return true;
}

}  // namespace

void ensure(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::runtime_error("jax_ep: device ordinal " + std::to_string(device) +
                             " is outside the runtime's tables");
  if (g_ready[device].load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_ready[device].load(std::memory_order_relaxed)) return;
  int prev = 0;
  check_cuda(cudaGetDevice(&prev), "cudaGetDevice", device);
  HostFaults* host = g_host.load(std::memory_order_relaxed);
  if (host == nullptr) {
    void* h = nullptr;
    // Portable: one allocation mapped into every device; UVA gives it one address everywhere.
    check_cuda(cudaHostAlloc(&h, sizeof(HostFaults), cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc(fault records)", device);
    std::memset(h, 0, sizeof(HostFaults));
    host = static_cast<HostFaults*>(h);
    g_host.store(host, std::memory_order_release);
  }
  check_cuda(cudaSetDevice(device), "cudaSetDevice", device);
  void* records = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&records, host, 0);
  DeviceFault init{};
  if (e == cudaSuccess) {
    HostFaults* mapped = static_cast<HostFaults*>(records);
    init.record = &mapped->device[device];
    init.aborted = &mapped->aborted;
  }
  void* p = nullptr;
  if (e == cudaSuccess) e = cudaMalloc(&p, sizeof(DeviceFault));
  if (e == cudaSuccess) e = copy_to_device_memory(p, &init, sizeof(DeviceFault));
  cudaSetDevice(prev);
  check_cuda(e, "setting up the fault record (cudaHostGetDevicePointer / cudaMalloc / copy)",
             device);
  g_device[device] = static_cast<DeviceFault*>(p);
  g_ready[device].store(true, std::memory_order_release);
}

DeviceFault* device_state(int device) {
  if (device < 0 || device >= kMaxDevices || !g_ready[device].load(std::memory_order_acquire))
    return nullptr;
  return g_device[device];
}

bool aborted() {
  HostFaults* host = g_host.load(std::memory_order_acquire);
  if (host == nullptr) return false;
  return *reinterpret_cast<const volatile unsigned int*>(&host->aborted) != 0;
}

std::vector<FaultRecord> records() {
  std::vector<FaultRecord> out;
  HostFaults* host = g_host.load(std::memory_order_acquire);
  if (host == nullptr) return out;
  for (int d = 0; d < kMaxDevices; ++d) {
    FaultRecord r;
    if (read_record(host, d, &r)) out.push_back(r);
  }
  return out;
}

std::string message() {
  if (!aborted()) return "";
  const std::vector<FaultRecord> rs = records();
  std::ostringstream os;
  os << "jax_ep: ";
  if (rs.empty()) {
    os << "a wait of this process gave up (its record is still being written)";
  } else {
    const FaultRecord& r = rs.front();
    const std::string phase(r.phase);
    const std::string op = phase.substr(0, phase.find(':'));
    const double limit = static_cast<double>(r.timeout_ns) * 1e-9;
    os << op << " timed out: rank " << r.rank << " of " << r.num_ranks << " waited " << limit
       << " s in phase '" << phase << "'";
    if (r.peer >= 0) os << " for rank " << r.peer;
    os << " (epoch " << r.epoch << ", seen " << r.seen << ")";
  }
  os << ". A peer did not arrive in time: it stopped, runs a different program, or is slower "
        "than the limit. Every jax_ep communication op of this process fails from now on (the "
        "ranks' states no longer agree); other JAX work still runs, so save what you need and "
        "restart the job. Raise JAX_EP_TIMEOUT_S if a peer can legitimately be that slow.";
  return os.str();
}

}  // namespace fault
}  // namespace jax_ep
