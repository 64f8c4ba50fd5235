// One-GPU multi-rank mode (docs/testing.md): the R ranks of an EP group as R "virtual ranks" on
// one device, each with its own workspace and buffers there, running the production kernels.
// Only the peer table (group-table ids below) and the launch (one stream per rank, residency
// checked first: ffi/virtual_ranks.h) differ from a real group. Plain C++: host code only.
#pragma once
#include <cstddef>
#include <mutex>
#include <string>

#include "common/launch_gate.h"
#include "common/limits.h"

namespace jax_ep {

// Group-table id of virtual rank `rank` on CUDA device `device`: negative, so never a CUDA
// ordinal nor a PE. The workspace registry (workspace.h) keys its buffers by these ids.
constexpr int virtual_id(int device, int rank) { return -(1 + device * kMaxRanks + rank); }
// The CUDA device an entry of a group table lives on: an ordinal is its own device.
constexpr int id_device(int id) { return id >= 0 ? id : (-id - 1) / kMaxRanks; }

// The virtual rank a handler is running as, set by the virtual-rank handlers around each call
// of the production handler body (thread-local; none outside the mode).
struct VirtualRank {
  int device = -1;
  int rank = 0;
  int num_ranks = 1;
  bool dry_run = false;  // check the residency of every launch, launch nothing
  std::string error;     // the first launch that cannot be resident
};
const VirtualRank* virtual_rank();

class VirtualRankScope {
 public:
  explicit VirtualRankScope(VirtualRank* v);
  ~VirtualRankScope();
  VirtualRankScope(const VirtualRankScope&) = delete;
  VirtualRankScope& operator=(const VirtualRankScope&) = delete;

 private:
  const VirtualRank* prev_;
};

// The launch gate of this mode, may_launch (common/launch_gate.h), is defined in
// virtual_ranks.cc: it checks the residency of all R grids of the virtual ranks' launches.

// The start of the ranks is staggered on purpose: call c holds rank r back by
// ((r + c) mod R) / (R - 1) x kStaggerNs (a timed sleep on its stream), c counting the
// virtual-rank calls of the device (on the device, so scans and CUDA graphs advance it too).
// The ranks thus arrive in a rotated order; an op that is every n-th call of its program sees
// every n-th rotation (docs/testing.md).
constexpr unsigned long long kStaggerNs = 40000;

// One stream per virtual rank on a device, the events that fork them from and join them to the
// caller's stream, and the call counter: made by prepare_rank_streams, at set-up (init_group of
// a group with virtual ids), never while a handler runs (which may be recorded into a command
// buffer). Each returns an error message, empty on success.
struct RankStreams;
std::string prepare_rank_streams(int device);
// The lock a virtual-rank call holds from fork_ranks to join_ranks: the device's streams,
// events and counter are shared by every op.
std::mutex& rank_streams_mutex(int device);
// fork_ranks also queues each rank's stagger; join_ranks counts the call.
std::string fork_ranks(int device, int num_ranks, void* stream, RankStreams** out);
void* rank_stream(RankStreams* rs, int rank);
std::string join_ranks(RankStreams* rs, int num_ranks, void* stream);

// Testing (jax_ep.testing.absent_ranks): the virtual ranks that do not run, bit r for rank r,
// as if their process had stopped before the op; their peers' waits then give up
// (runtime/fault.h). Read when an op runs; 0 (the default): every rank runs.
void set_absent_ranks(unsigned int mask);
unsigned int absent_ranks();

}  // namespace jax_ep
