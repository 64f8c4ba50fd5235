#include "runtime/workspace.h"

#include "runtime/device.h"
#include "runtime/fault.h"
#include "runtime/virtual_ranks.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>

namespace jax_ep {
namespace {
std::mutex g_mu;
std::map<std::vector<int>, std::map<int, Workspace*>> g_groups;

}  // namespace

void init_group(const std::vector<int>& devices) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_groups.count(devices)) return;
  int prev = 0;
  cudaGetDevice(&prev);
  std::map<int, Workspace*> ws;
  for (int id : devices) {  // a CUDA ordinal, or a virtual rank's id (virtual_ranks.h)
    const int d = id_device(id);
    check_cuda(cudaSetDevice(d), "cudaSetDevice", d);
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, sizeof(Workspace)), "cudaMalloc(workspace)", d);
    check_cuda(zero_device_memory(p, sizeof(Workspace)), "zeroing the workspace", d);
    ws[id] = static_cast<Workspace*>(p);
    fault::ensure(d);
  }
  std::vector<int> devs;
  for (int id : devices)
    if (std::find(devs.begin(), devs.end(), id_device(id)) == devs.end())
      devs.push_back(id_device(id));
  for (int a : devs) {
    check_cuda(cudaSetDevice(a), "cudaSetDevice", a);
    for (int b : devs) {
      if (a == b) continue;
      int can = 0;
      check_cuda(cudaDeviceCanAccessPeer(&can, a, b), "cudaDeviceCanAccessPeer", a);
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
        check_cuda(e, "cudaDeviceEnablePeerAccess", a);
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
  check_cuda(cudaGetDevice(&prev), "cudaGetDevice", device);
  std::vector<unsigned long long> out(static_cast<size_t>(kNumSlots) * kTraceSlots, 0ull);
  cudaError_t err = cudaSetDevice(id_device(device));
  for (int s = 0; s < kNumSlots && err == cudaSuccess; ++s)
    err = cudaMemcpy(out.data() + static_cast<size_t>(s) * kTraceSlots, ws->slots[s].trace,
                     sizeof(unsigned long long) * kTraceSlots, cudaMemcpyDeviceToHost);
  cudaSetDevice(prev);
  check_cuda(err, "read_traces (cudaSetDevice / cudaMemcpy)", device);
  return out;
}

}  // namespace jax_ep
