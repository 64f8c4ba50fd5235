#include "runtime/device.h"

#include <cuda_runtime.h>

#include <atomic>

#include "runtime/virtual_ranks.h"

namespace jax_ep {

int device_sm_count(int device) {
  static std::atomic<int> cache[kMaxDevices];  // 0: not read yet
  const bool cached = device >= 0 && device < kMaxDevices;
  int sms = cached ? cache[device].load(std::memory_order_relaxed) : 0;
  if (sms > 0) return sms;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cached) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

int sm_count(int device) {
  const int sms = device_sm_count(device);
  const VirtualRank* v = virtual_rank();
  if (v == nullptr || sms <= 0) return sms;
  return sms / v->num_ranks > 0 ? sms / v->num_ranks : 1;
}

}  // namespace jax_ep
