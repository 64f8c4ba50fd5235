// Decoding of the attributes every communication op carries: the EP group table (CUDA device
// ordinals of every group, in axis order, computed from the shard_map mesh at lowering time),
// the call-site slot and the timeout. Gives the kernel-side PeerSlots of this device's group.
#pragma once
#include <cstdint>
#include <string>

#include "transport/peer.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

struct GroupInfo {
  PeerSlots peers{};
  int device = -1;
  int group = -1;  // row of the group table holding this device
};

// groups: flattened [num_groups * group_size]; returns an error naming what is wrong.
xla::ffi::Error resolve_group(int device, xla::ffi::Span<const int64_t> groups,
                              int64_t group_size, int64_t slot, GroupInfo* out);

// "[d0, d1, ...]" for error messages.
inline std::string dims_str(xla::ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline xla::ffi::Error cuda_error(const char* where) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal,
                         std::string("jax_ep: ") + where + ": " + cudaGetErrorString(e));
}

}  // namespace jax_ep
