// Facts of a CUDA device that host code asks for on every call, read once per device.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace jax_ep {

// CUDA ordinals the per-device caches and tables of the runtime hold.
constexpr int kMaxDevices = 256;

// Multiprocessor count of `device` (0 when it cannot be read). Cached per device.
int device_sm_count(int device);

// Zero `bytes` of device memory of the current device and wait for that alone: a memset on a
// private stream, never a device-wide synchronisation. Set-up runs while the program is lowered,
// possibly while a running step waits on a host callback that needs the Python thread (which a
// device-wide wait would hold: a deadlock).
cudaError_t zero_device_memory(void* p, size_t bytes);
// Copy `bytes` from host memory to device memory of the current device, the same way.
cudaError_t copy_to_device_memory(void* dst, const void* src, size_t bytes);

// Set-up code: throw std::runtime_error "jax_ep: <what> failed on device <device>: <CUDA error>"
// when e is an error (after clearing it).
void check_cuda(cudaError_t e, const char* what, int device);

// The SMs one rank's kernels size their grids for: device_sm_count, or in the one-GPU
// multi-rank mode (runtime/virtual_ranks.h) the rank's share of them, at least 1.
int sm_count(int device);

}  // namespace jax_ep
