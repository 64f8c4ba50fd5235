// The gate in front of every communication kernel launch: declared here, for the launchers
// (kernels/launch.cuh, the one header they launch through), and defined by the runtime
// (runtime/virtual_ranks.cc), which knows whether the calling thread runs a virtual rank. A
// leaf: no other header of the project, no CUDA header.
#pragma once
#include <cstddef>

namespace jax_ep {

// Whether `grid` blocks of `kernel` (threads per block, dynamic shared memory bytes `smem`;
// `name` for the message) may launch now. Outside the one-GPU multi-rank mode: true. In it the
// ranks wait on each other, so all R grids must be resident at once: false (and the reason
// recorded in the calling rank's VirtualRank, runtime/virtual_ranks.h) when R such grids cannot
// be, and false in the dry run that checks every launch of a call before any rank launches.
// Host code; never fails otherwise.
bool may_launch(const void* kernel, const char* name, int grid, int threads, size_t smem);

}  // namespace jax_ep
