// One-GPU multi-rank mode (docs/testing.md): the R ranks of an EP group as R "virtual ranks" on
// one device, each with its own workspace and buffers there, running the production kernels.
// Only the peer table (group-table ids below) and the launch (one stream per rank, residency
// checked first: ffi/virtual_ranks.h) differ from a real group. Plain C++: host code only.
#pragma once
#include <cstddef>
#include <string>

#include "runtime/workspace.h"

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

// The gate in front of every communication kernel launch. Outside the mode: true. In it: the
// ranks wait on each other, so all R grids must be resident at once; false (and the reason
// recorded in the VirtualRank) when R grids of `grid` blocks of `kernel` cannot be, and false
// in a dry run.
bool may_launch(const void* kernel, const char* name, int grid, int threads, size_t smem);

// The start of the ranks is staggered on purpose: call c holds rank r back by
// ((r + c) mod R) / (R - 1) x kStaggerNs (a timed sleep on its stream), so that the ranks arrive
// in a different order every call and each is the late peer in turn (docs/testing.md).
constexpr unsigned long long kStaggerNs = 40000;

// One stream per virtual rank on `device`, and the events that fork them from and join them
// to the caller's stream; created once. fork_ranks also queues each rank's stagger. Returns an
// error message, empty on success.
struct RankStreams;
std::string fork_ranks(int device, int num_ranks, void* stream, RankStreams** out);
void* rank_stream(RankStreams* rs, int rank);
std::string join_ranks(RankStreams* rs, int num_ranks, void* stream);

}  // namespace jax_ep
