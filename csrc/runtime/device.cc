#include "runtime/device.h"

#include <cuda_runtime.h>

#include <atomic>
#include <sstream>
#include <stdexcept>

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

namespace {
// Run `op` on a private stream and wait for that stream alone.
template <typename Op>
cudaError_t on_private_stream(Op&& op) {
  cudaStream_t s = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = op(s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (s != nullptr) {
    const cudaError_t d = cudaStreamDestroy(s);
    if (e == cudaSuccess) e = d;
  }
  return e;
}
}  // namespace

cudaError_t zero_device_memory(void* p, size_t bytes) {
  return on_private_stream([&](cudaStream_t s) { return cudaMemsetAsync(p, 0, bytes, s); });
}

void check_cuda(cudaError_t e, const char* what, int device) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  std::ostringstream os;
  os << "jax_ep: " << what << " failed on device " << device << ": " << cudaGetErrorString(e);
  throw std::runtime_error(os.str());
}

cudaError_t copy_to_device_memory(void* dst, const void* src, size_t bytes) {
  return on_private_stream(
      [&](cudaStream_t s) { return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s); });
}

}  // namespace jax_ep
