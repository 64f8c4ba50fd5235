// Warp-wide constants. A leaf: it includes no other header of the project, so every floor
// (transport, kernels, ...) may include it.
#pragma once

namespace jax_ep {

// Every lane of a warp: the member mask of a whole-warp shuffle, ballot or vote.
constexpr unsigned kFull = 0xffffffffu;

}  // namespace jax_ep
