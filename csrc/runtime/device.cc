#include "runtime/device.h"

#include <cuda_runtime.h>

#include <atomic>

namespace jax_ep {

int sm_count(int device) {
  constexpr int kMaxDevices = 256;
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

}  // namespace jax_ep
