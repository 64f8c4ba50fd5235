// The one way a communication kernel is launched: every launcher of kernels/ (the
// high-throughput, low-latency and fused ones) goes through launch_gated() here, or through
// may_launch() for kernels that must launch together, and never launches a communication kernel
// with <<<>>> unguarded. The gate (common/launch_gate.h, defined by the runtime) is what lets
// the one-GPU multi-rank mode check that all R ranks' grids fit on the device before any
// launches; outside that mode it lets everything through. Launchers take their sizes (grids,
// SM counts) as arguments and include no runtime header: kernels/ depends on common/ and
// transport/ only.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "common/launch_gate.h"

namespace jax_ep {

// Launches `grid` blocks of `kernel` (threads per block, `smem` bytes of dynamic shared memory)
// on `stream` with `args`, when the gate lets it through. Returns whether it launched (false:
// gated, the reason is recorded by the gate); a launch error is left for cudaGetLastError.
template <typename... Params, typename... Args>
bool launch_gated(void (*kernel)(Params...), const char* name, int grid, int threads, size_t smem,
                  cudaStream_t stream, Args&&... args) {
  if (!may_launch(reinterpret_cast<const void*>(kernel), name, grid, threads, smem)) return false;
  kernel<<<grid, threads, smem, stream>>>(std::forward<Args>(args)...);
  return true;
}

}  // namespace jax_ep
