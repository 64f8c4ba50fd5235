#include "runtime/workspace.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>

namespace jax_ep {
namespace {
std::mutex g_mu;
std::map<int, Workspace*> g_ws;

void check(cudaError_t e, const char* what, int dev) {
  if (e != cudaSuccess) {
    std::ostringstream os;
    os << "jax_ep: " << what << " failed on device " << dev << ": " << cudaGetErrorString(e);
    throw std::runtime_error(os.str());
  }
}
}  // namespace

void init_peer_runtime(const std::vector<int>& devices) {
  std::lock_guard<std::mutex> lock(g_mu);
  int prev = 0;
  cudaGetDevice(&prev);
  for (int d : devices) {
    if (g_ws.count(d)) continue;
    check(cudaSetDevice(d), "cudaSetDevice", d);
    void* p = nullptr;
    check(cudaMalloc(&p, sizeof(Workspace)), "cudaMalloc(workspace)", d);
    check(cudaMemset(p, 0, sizeof(Workspace)), "cudaMemset(workspace)", d);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", d);
    g_ws[d] = static_cast<Workspace*>(p);
  }
  for (int a : devices) {
    check(cudaSetDevice(a), "cudaSetDevice", a);
    for (int b : devices) {
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
}

Workspace* workspace_for(int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_ws.find(device);
  return it == g_ws.end() ? nullptr : it->second;
}

std::vector<int> runtime_devices() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<int> out;
  for (auto& kv : g_ws) out.push_back(kv.first);
  return out;
}

std::string runtime_description() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::ostringstream os;
  os << "peer transport, devices [";
  bool first = true;
  for (auto& kv : g_ws) {
    os << (first ? "" : ", ") << kv.first;
    first = false;
  }
  os << "], workspace " << sizeof(Workspace) << " bytes per device";
  return os.str();
}

}  // namespace jax_ep
