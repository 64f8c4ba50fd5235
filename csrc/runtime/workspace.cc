#include "runtime/workspace.h"

#include "runtime/device.h"
#include "runtime/virtual_ranks.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace jax_ep {
namespace {
std::mutex g_mu;
std::map<std::vector<int>, std::map<int, Workspace*>> g_groups;
struct SlotBuffer {
  std::vector<unsigned long long> ptrs;  // per device of the group, group order
  size_t bytes = 0;
};
// Keyed by (group, slot, layout): a buffer only ever holds rows of one layout (see
// reserve_slot_buffer).
std::map<std::tuple<std::vector<int>, int, std::string>, SlotBuffer> g_slot_buffers;
std::map<int, size_t> g_buffer_bytes;  // per device, including superseded buffers

void check(cudaError_t e, const char* what, int dev) {
  if (e != cudaSuccess) {
    std::ostringstream os;
    os << "jax_ep: " << what << " failed on device " << dev << ": " << cudaGetErrorString(e);
    throw std::runtime_error(os.str());
  }
}
}  // namespace

void init_group(const std::vector<int>& devices) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_groups.count(devices)) return;
  int prev = 0;
  cudaGetDevice(&prev);
  std::map<int, Workspace*> ws;
  for (int id : devices) {  // a CUDA ordinal, or a virtual rank's id (virtual_ranks.h)
    const int d = id_device(id);
    check(cudaSetDevice(d), "cudaSetDevice", d);
    void* p = nullptr;
    check(cudaMalloc(&p, sizeof(Workspace)), "cudaMalloc(workspace)", d);
    check(zero_device_memory(p, sizeof(Workspace)), "zeroing the workspace", d);
    ws[id] = static_cast<Workspace*>(p);
  }
  std::vector<int> devs;
  for (int id : devices)
    if (std::find(devs.begin(), devs.end(), id_device(id)) == devs.end())
      devs.push_back(id_device(id));
  for (int a : devs) {
    check(cudaSetDevice(a), "cudaSetDevice", a);
    for (int b : devs) {
      if (a == b) continue;
      int can = 0;
      check(cudaDeviceCanAccessPeer(&can, a, b), "cudaDeviceCanAccessPeer", a);
      if (!can) {
        std::ostringstream os;
        os << "jax_ep: device " << a << " cannot access device " << b
           << " as a peer; the one-process transport needs peer access (NVLink or PCIe P2P)";
        throw std::runtime_error(os.str());
      }
      cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // someone (XLA) enabled it already: fine
      } else {
        check(e, "cudaDeviceEnablePeerAccess", a);
      }
    }
  }
  cudaSetDevice(prev);
  for (int id : devices)  // the one-GPU multi-rank mode: the device's rank streams, once
    if (id < 0) {
      const std::string m = prepare_rank_streams(id_device(id));
      if (!m.empty()) throw std::runtime_error("jax_ep: " + m);
    }
  g_groups[devices] = ws;
}

Workspace* group_workspace(const int64_t* devices, int n, int device) {
  std::vector<int> key(devices, devices + n);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_groups.find(key);
  if (it == g_groups.end()) return nullptr;
  auto jt = it->second.find(device);
  return jt == it->second.end() ? nullptr : jt->second;
}

std::vector<int> runtime_devices() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<int> out;
  for (auto& g : g_groups)
    for (auto& kv : g.second)
      if (std::find(out.begin(), out.end(), id_device(kv.first)) == out.end())
        out.push_back(id_device(kv.first));
  std::sort(out.begin(), out.end());
  return out;
}

int runtime_num_groups() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int>(g_groups.size());
}

std::vector<unsigned long long> read_traces(const std::vector<int>& group, int device) {
  Workspace* ws = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_groups.find(group);
    if (it != g_groups.end()) {
      auto jt = it->second.find(device);
      if (jt != it->second.end()) ws = jt->second;
    }
  }
  if (ws == nullptr) {
    std::ostringstream os;
    os << "jax_ep: read_traces: no workspace for device " << device << " in group [";
    for (size_t i = 0; i < group.size(); ++i) os << (i ? ", " : "") << group[i];
    os << "] (no op of that group ran in this process?)";
    throw std::runtime_error(os.str());
  }
  int prev = 0;
  check(cudaGetDevice(&prev), "cudaGetDevice", device);
  std::vector<unsigned long long> out(static_cast<size_t>(kNumSlots) * kTraceSlots, 0ull);
  cudaError_t err = cudaSetDevice(id_device(device));
  for (int s = 0; s < kNumSlots && err == cudaSuccess; ++s)
    err = cudaMemcpy(out.data() + static_cast<size_t>(s) * kTraceSlots, ws->slots[s].trace,
                     sizeof(unsigned long long) * kTraceSlots, cudaMemcpyDeviceToHost);
  cudaSetDevice(prev);
  check(err, "read_traces (cudaSetDevice / cudaMemcpy)", device);
  return out;
}

std::vector<unsigned long long> reserve_slot_buffer(const std::vector<int>& group, int slot,
                                                    size_t bytes, const std::string& layout) {
  std::lock_guard<std::mutex> lock(g_mu);
  SlotBuffer& sb = g_slot_buffers[{group, slot, layout}];
  if (sb.bytes >= bytes && sb.ptrs.size() == group.size()) return sb.ptrs;
  // Superseded buffers are kept: a compiled executable (or CUDA graph) may still name them.
  int prev = 0;
  cudaGetDevice(&prev);
  std::vector<unsigned long long> ptrs;
  for (int id : group) {
    const int d = id_device(id);
    void* p = nullptr;
    cudaError_t e = cudaSetDevice(d);
    if (e == cudaSuccess) e = cudaMalloc(&p, bytes);
    if (e == cudaSuccess) e = zero_device_memory(p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      cudaSetDevice(prev);
      std::ostringstream os;
      os << "jax_ep: allocating the low-latency receive buffer of " << bytes << " bytes (slot "
         << slot << ") on device " << d << " failed: " << cudaGetErrorString(e)
         << ". It is sized from max_tokens_per_rank, the hidden size and top-k; leave that "
            "much GPU memory outside JAX's pool (XLA_PYTHON_CLIENT_MEM_FRACTION).";
      throw std::runtime_error(os.str());
    }
    ptrs.push_back(reinterpret_cast<unsigned long long>(p));
    g_buffer_bytes[d] += bytes;
  }
  cudaSetDevice(prev);
  sb.ptrs = ptrs;
  sb.bytes = bytes;
  return ptrs;
}

size_t slot_buffer_bytes(int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_buffer_bytes.find(device);
  return it == g_buffer_bytes.end() ? 0 : it->second;
}

}  // namespace jax_ep
