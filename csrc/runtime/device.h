// Facts of a CUDA device that host code asks for on every call, read once per device.
#pragma once

namespace jax_ep {

// CUDA ordinals the per-device caches and tables of the runtime hold.
constexpr int kMaxDevices = 256;

// Multiprocessor count of `device` (0 when it cannot be read). Cached per device.
int device_sm_count(int device);

// The SMs one rank's kernels size their grids for: device_sm_count, or in the one-GPU
// multi-rank mode (runtime/virtual_ranks.h) the rank's share of them, at least 1.
int sm_count(int device);

}  // namespace jax_ep
