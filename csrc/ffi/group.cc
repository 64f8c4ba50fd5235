#include "ffi/group.h"

#include <string>

#include "runtime/fault.h"
#include "runtime/mode.h"

namespace jax_ep {

namespace ffi = xla::ffi;

ffi::Error resolve_group(int device, ffi::Span<const int64_t> groups, int64_t group_size,
                         int64_t slot, GroupInfo* out) {
  if (group_size < 1 || group_size > kMaxRanks)
    return ffi::Error::InvalidArgument("jax_ep: EP group size " + std::to_string(group_size) +
                                       " is outside [1, " + std::to_string(kMaxRanks) + "]");
  if (slot < 0 || slot >= kNumSlots)
    return ffi::Error::InvalidArgument("jax_ep: slot out of range");
  // A wait of this process gave up (runtime/fault.h): no communication op runs any more.
  if (fault::aborted()) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, fault::message());
  out->peers.fault = fault::device_state(device);
  if (out->peers.fault == nullptr)
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jax_ep: no fault record on device " + std::to_string(device) +
            " (set up with the EP group's workspace, init_group or sym::attach: was it skipped?)");
  // The table names CUDA ordinals, PEs or virtual ranks: the process mode says which entry is
  // this rank, and where each member's workspace is (runtime/mode.h).
  const Mode& mode = current_mode();
  int64_t self = -1;
  if (std::string why = mode.self_id(device, group_size, &self); !why.empty())
    return ffi::Error::InvalidArgument(why);
  const int64_t n = static_cast<int64_t>(groups.size());
  for (int64_t i = 0; i < n; ++i) {
    if (groups[i] != self) continue;
    const int64_t g = i / group_size;
    out->device = device;
    out->group = static_cast<int>(g);
    out->peers.num_ranks = static_cast<int>(group_size);
    out->peers.rank = static_cast<int>(i % group_size);
    const int64_t* members = groups.begin() + g * group_size;
    for (int r = 0; r < group_size; ++r) {
      std::string why;
      bool remote = false;
      Workspace* ws = mode.workspace(members, static_cast<int>(group_size), r, &remote, &why);
      out->peers.pe[r] = static_cast<int>(members[r]);
      if (remote) {  // reached through NVSHMEM kernels (nvshmem/remote.h), never directly
        out->peers.remote |= 1u << r;
        out->peers.slot[r] = nullptr;
        continue;
      }
      if (ws == nullptr) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
      out->peers.slot[r] = &ws->slots[slot];
    }
    return ffi::Error::Success();
  }
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    mode.not_a_member(device, self, groups.begin(), n));
}

ffi::Error decode_peer_row(const char* op, const char* what, ffi::Span<const int64_t> table,
                           ffi::Span<const int64_t> groups, const GroupInfo& gi, uint8_t** out) {
  const int R = gi.peers.num_ranks;
  if (table.size() != groups.size())
    return ffi::Error::InvalidArgument(std::string(op) + ": the " + what + " table must name " +
                                       "one buffer per entry of the group table");
  const int64_t* row = table.begin() + static_cast<int64_t>(gi.group) * R;
  for (int q = 0; q < R; ++q) {
    const uint64_t v = static_cast<uint64_t>(row[q]);
    if (((v & 1u) != 0) != is_remote(gi.peers, q))
      return ffi::Error::Internal(std::string(op) + ": " + what +
                                  " and peer tables disagree on rank " + std::to_string(q));
    out[q] = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(v & ~uint64_t{1}));
    if (out[q] == nullptr)
      return ffi::Error::InvalidArgument(std::string(op) + ": missing " + what);
  }
  return ffi::Error::Success();
}

}  // namespace jax_ep
