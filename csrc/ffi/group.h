// Decoding of the attributes every communication op carries: the EP group table (CUDA device
// ordinals of every group, in axis order, computed from the shard_map mesh at lowering time),
// the call-site slot and the timeout. Gives the kernel-side PeerSlots of this device's group.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "ffi/common.h"
#include "transport/peer.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

struct GroupInfo {
  PeerSlots peers{};
  int device = -1;
  int group = -1;  // row of the group table holding this device
};

// groups: flattened [num_groups * group_size]; returns an error naming what is wrong.
xla::ffi::Error resolve_group(int device, xla::ffi::Span<const int64_t> groups, int64_t group_size,
                              int64_t slot, GroupInfo* out);

// An address table that names one buffer per entry of the group table (a call-site lease's
// buffers: the LL receive buffers, the HT staging buffers of per-process mode,
// runtime/lease.h): the R addresses of out->group's row, bit 0 cleared.
// Bit 0 set marks a remote peer (nvshmem/symmetric.h), whose address is this rank's image of its
// buffer; it must agree with gi.peers. `what` names the buffer in the errors.
xla::ffi::Error decode_peer_row(const char* op, const char* what,
                                xla::ffi::Span<const int64_t> table,
                                xla::ffi::Span<const int64_t> groups, const GroupInfo& gi,
                                uint8_t** out);

}  // namespace jax_ep
