#include "runtime/virtual_ranks.h"

#include <cuda_runtime.h>

#include <atomic>
#include <mutex>
#include <sstream>

#include "runtime/device.h"

namespace jax_ep {
namespace {
thread_local const VirtualRank* t_virtual = nullptr;
std::atomic<unsigned int> g_absent{0};
}  // namespace

const VirtualRank* virtual_rank() { return t_virtual; }

void set_absent_ranks(unsigned int mask) { g_absent.store(mask, std::memory_order_relaxed); }
unsigned int absent_ranks() { return g_absent.load(std::memory_order_relaxed); }

VirtualRankScope::VirtualRankScope(VirtualRank* v) : prev_(t_virtual) { t_virtual = v; }
VirtualRankScope::~VirtualRankScope() { t_virtual = prev_; }

bool may_launch(const void* kernel, const char* name, int grid, int threads, size_t smem) {
  const VirtualRank* v = t_virtual;
  if (v == nullptr) return true;
  VirtualRank* mv = const_cast<VirtualRank*>(v);
  int per_sm = 0;
  const int sms = device_sm_count(v->device);
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
      cudaSuccess) {
    cudaGetLastError();
    per_sm = 0;
  }
  const long long need = static_cast<long long>(grid) * v->num_ranks;
  const long long have = static_cast<long long>(per_sm) * sms;
  if (need > have) {
    if (mv->error.empty()) {
      std::ostringstream os;
      os << "the one-GPU multi-rank mode runs all " << v->num_ranks << " ranks' grids at once, "
         << "and " << v->num_ranks << " x " << grid << " blocks of the " << name
         << " kernel cannot be resident on device " << v->device << " (" << sms << " SMs x "
         << per_sm << " blocks each = " << have
         << "); use fewer ranks or fewer blocks (jax_ep.set_num_blocks)";
      mv->error = os.str();
    }
    return false;
  }
  return !v->dry_run;
}

struct RankStreams {
  cudaStream_t streams[kMaxRanks];
  cudaEvent_t fork;
  cudaEvent_t join[kMaxRanks];
  unsigned int* calls;  // device: the virtual-rank calls so far, which pick each one's stagger
};

namespace {
std::mutex g_mu;
RankStreams* g_streams[kMaxDevices] = {};
std::mutex g_call_mu[kMaxDevices];

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Rank `rank`'s start of call c is held back by ((rank + c) mod R) / (R - 1) x kStaggerNs:
// the ranks arrive in a rotated order each call, and the waits on a late peer (flags, epochs,
// addresses) are exercised rather than left to the launch order. A timed sleep: it ends on its
// own.
__global__ void stagger_kernel(const unsigned int* calls, int rank, int num_ranks) {
  const unsigned long long ns =
      (rank + *calls) % num_ranks * kStaggerNs / static_cast<unsigned long long>(num_ranks - 1);
  const unsigned long long start = globaltimer();
  while (globaltimer() - start < ns) __nanosleep(1000);
}

__global__ void count_call_kernel(unsigned int* calls) { *calls += 1; }
}  // namespace

std::string prepare_rank_streams(int device) {
  if (device < 0 || device >= kMaxDevices) return "bad device";
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_streams[device] != nullptr) return "";
  int prev = 0;
  cudaGetDevice(&prev);
  auto* rs = new RankStreams{};
  cudaError_t e = cudaSetDevice(device);
  for (int r = 0; r < kMaxRanks && e == cudaSuccess; ++r) {
    e = cudaStreamCreateWithFlags(&rs->streams[r], cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&rs->join[r], cudaEventDisableTiming);
  }
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&rs->fork, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaMalloc(&rs->calls, sizeof(unsigned int));
  if (e == cudaSuccess) e = zero_device_memory(rs->calls, sizeof(unsigned int));
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("creating the rank streams: ") + cudaGetErrorString(e);
  }
  g_streams[device] = rs;
  return "";
}

std::mutex& rank_streams_mutex(int device) {
  return g_call_mu[device >= 0 && device < kMaxDevices ? device : 0];
}

std::string fork_ranks(int device, int num_ranks, void* stream, RankStreams** out) {
  if (device < 0 || device >= kMaxDevices || num_ranks < 1 || num_ranks > kMaxRanks)
    return "bad device or rank count";
  RankStreams* rs = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    rs = g_streams[device];
  }
  if (rs == nullptr)
    return "the rank streams of device " + std::to_string(device) +
           " were never set up (the jax_ep lowering of a virtual-rank call does it)";
  cudaError_t e = cudaEventRecord(rs->fork, static_cast<cudaStream_t>(stream));
  for (int r = 0; r < num_ranks && e == cudaSuccess; ++r) {
    e = cudaStreamWaitEvent(rs->streams[r], rs->fork, 0);
    if (e == cudaSuccess && num_ranks > 1) {
      stagger_kernel<<<1, 1, 0, rs->streams[r]>>>(rs->calls, r, num_ranks);
      e = cudaGetLastError();
    }
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("forking the rank streams: ") + cudaGetErrorString(e);
  }
  *out = rs;
  return "";
}

void* rank_stream(RankStreams* rs, int rank) { return rs->streams[rank]; }

std::string join_ranks(RankStreams* rs, int num_ranks, void* stream) {
  cudaError_t e = cudaSuccess;
  for (int r = 0; r < num_ranks && e == cudaSuccess; ++r) {
    e = cudaEventRecord(rs->join[r], rs->streams[r]);
    if (e == cudaSuccess)
      e = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), rs->join[r], 0);
  }
  if (e == cudaSuccess) {
    count_call_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(rs->calls);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("joining the rank streams: ") + cudaGetErrorString(e);
  }
  return "";
}

}  // namespace jax_ep
