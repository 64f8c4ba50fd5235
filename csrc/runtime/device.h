// Facts of a CUDA device that host code asks for on every call, read once per device.
#pragma once

namespace jax_ep {

// Multiprocessor count of `device` (0 when it cannot be read). Cached per device.
int sm_count(int device);

}  // namespace jax_ep
