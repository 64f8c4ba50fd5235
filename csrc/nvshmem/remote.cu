// NVSHMEM kernels for peers without load/store access (see remote.h). Built into the NVSHMEM
// glue library (relocatable device code, linked with NVIDIA's device library), so the op
// kernels keep whole-program compilation. Slots and data buffers live in the symmetric arena:
// this rank's address of a slot field or buffer row is also its symmetric address on any PE.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <nvshmem.h>
#include <nvshmemx.h>
#include "nvshmem/remote.h"

namespace jax_ep {
namespace remote {
namespace {

constexpr int kThreads = 512;
constexpr size_t kGetChunk = size_t{1} << 20;  // bytes per blocking get of the pull prologue

// A flag (a 64-bit word of the slot, read by its owner with acquire loads) set on PE pe with an
// NVSHMEM put, not an atomic: NVSHMEM's UCX transport refuses 64-bit atomics without GDRCopy,
// and the flags need none (one writer each). Callers complete their data puts (quiet) first.
__device__ __forceinline__ void put_flag(unsigned long long* flag, unsigned long long v, int pe) {
  nvshmem_uint64_p(reinterpret_cast<uint64_t*>(flag), v, pe);
}

__global__ void __launch_bounds__(kThreads)
    pull_prologue_kernel(const __grid_constant__ PeerSlots ps, size_t bytes, int64_t timeout_ns) {
  Slot* me = ps.slot[ps.rank];
  const unsigned long long e = ld_volatile_u64(&me->epoch) + 1;
  const int q = threadIdx.x;
  __shared__ bool failed;  // a wait gave up before: get nothing
  if (q == 0) failed = device_failed(ps);
  __syncthreads();
  if (failed) return;
  bool waited = true;
  if (q < ps.num_ranks && is_remote(ps, q)) {
    // Our staging copy (stream-ordered before this kernel) is complete: q may read it.
    if (blockIdx.x == 0) {
      put_flag(&me->ready_from[ps.rank], e, ps.pe[q]);
      nvshmem_quiet();
    }
    waited = wait_flag_geq(ps, &me->ready_from[q], e, timeout_ns, q,
                           "ht_remote: wait for a remote peer's staged operands");
  }
  if (__syncthreads_or(!waited)) return;     // a wait gave up: get nothing
  const uint8_t* stage = ps.stage[ps.rank];  // symmetric: the same offset on every PE
  const size_t nchunks = (bytes + kGetChunk - 1) / kGetChunk;
  size_t c = 0;  // chunk c of the k-th remote peer: (k * nchunks + chunk) over the grid
  for (int s = 0; s < ps.num_ranks; ++s) {
    if (!is_remote(ps, s)) continue;
    for (size_t i = 0; i < nchunks; ++i, ++c) {
      if (c % gridDim.x != blockIdx.x) continue;
      const size_t off = i * kGetChunk;
      const size_t len = bytes - off < kGetChunk ? bytes - off : kGetChunk;
      uint8_t* mirror = const_cast<uint8_t*>(ps.stage[s]);  // ours (symmetric.h: bit 0)
      nvshmemx_getmem_block(mirror + off, stage + off, len, ps.pe[s]);
    }
  }
}

__global__ void pull_epilogue_kernel(const __grid_constant__ PeerSlots ps, int64_t timeout_ns) {
  Slot* me = ps.slot[ps.rank];
  const unsigned long long e = ld_volatile_u64(&me->epoch);  // closed by the end barrier
  const int q = threadIdx.x;
  if (q < ps.num_ranks && is_remote(ps, q)) {
    // Our mirror of q is read: q may overwrite its staging buffer (its next call).
    put_flag(&me->done[ps.rank], e, ps.pe[q]);
    nvshmem_quiet();
    wait_flag_geq(ps, &me->done[q], e, timeout_ns, q,
                  "ht_remote: wait for a remote peer to finish reading");
  }
}

// This rank's scratch image of every peer's buffer (what the send kernel wrote for it), by value.
struct Scratch {
  uint8_t* at[kMaxRanks];
};
Scratch scratch_of(const PeerSlots& ps, uint8_t* const* scratch) {
  Scratch s{};
  for (int q = 0; q < ps.num_ranks; ++q) s.at[q] = scratch[q];
  return s;
}

__device__ __forceinline__ int nth_remote(const PeerSlots& ps, int n) {
  for (int q = 0; q < ps.num_ranks; ++q)
    if (is_remote(ps, q) && n-- == 0) return q;
  return -1;
}

// Whole warp, after its data puts: complete them (the flag that follows must not overtake them).
__device__ __forceinline__ void complete_warp_puts(int lane) {
  __syncwarp();
  if (lane == 0) nvshmem_quiet();
  __syncwarp();
}

// Block b: the b-th remote peer q. Our area of q's buffer: the rows whose header tag is the
// epoch, then the count block.
__global__ void __launch_bounds__(kThreads)
    push_dispatch_kernel(const __grid_constant__ PeerSlots ps, uint8_t* own_buf,
                         const __grid_constant__ Scratch scr, int T, int M, int64_t row_bytes,
                         int64_t area_bytes, int64_t count_bytes, int dbg) {
  __shared__ unsigned int s_count;
  Slot* me = ps.slot[ps.rank];
  const int q = nth_remote(ps, blockIdx.x);
  if (q < 0) return;
  const unsigned long long e = ld_volatile_u64(&me->send_epoch);  // the send kernel's
  const int par = static_cast<int>(e & 1), R = ps.num_ranks, r = ps.rank;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t area = ((int64_t)par * R + r) * area_bytes;
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  for (int t = warp; t < T; t += kThreads / 32) {
    const int64_t off = area + (int64_t)t * row_bytes;
    const uint8_t* src = scr.at[q] + off;
    if (*reinterpret_cast<const volatile int*>(src) != static_cast<int>(e)) continue;
    nvshmemx_putmem_nbi_warp(own_buf + off, src, row_bytes, ps.pe[q]);
    if (lane == 0) atomicAdd(&s_count, 1u);
  }
  if (warp == 0) {
    const int64_t off = area + (int64_t)M * row_bytes;
    nvshmemx_putmem_nbi_warp(own_buf + off, scr.at[q] + off, count_bytes, ps.pe[q]);
  }
  complete_warp_puts(lane);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (dbg)
      printf("jax_ep debug: rank %d dispatch push to %d: epoch %llu, %u rows\n", r, q, e, s_count);
    // rows = T: the receiver scans our rows 0..T-1 (their tags say which were sent to it).
    put_flag(&me->data_flag[par][r], (e << 32) | static_cast<unsigned int>(T), ps.pe[q]);
    nvshmem_quiet();
  }
}

// One block: the rows named by recv_src / recv_slot whose source is remote, then (after they
// completed) their tags (int32 [parity][t][k][tags_per_row] at tags_offset,
// kernels/low_latency.cuh: one per column part, all set here).
__global__ void __launch_bounds__(kThreads)
    push_combine_kernel(const __grid_constant__ PeerSlots ps, uint8_t* own_buf,
                        const __grid_constant__ Scratch scr, const int32_t* recv_src,
                        const int32_t* recv_slot, const int32_t* recv_count, int L, int M, int K,
                        int64_t row_bytes, int64_t tags_offset, int tags_per_row, int dbg) {
  __shared__ unsigned int s_count[kMaxRanks];
  Slot* me = ps.slot[ps.rank];
  const unsigned long long e = ld_volatile_u64(&me->send_epoch);
  const int par = static_cast<int>(e & 1), R = ps.num_ranks, r = ps.rank;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t RM = (int64_t)R * M;
  int* tags = reinterpret_cast<int*>(own_buf + tags_offset);
  if (threadIdx.x < kMaxRanks) s_count[threadIdx.x] = 0;
  __syncthreads();
  for (int pass = 0; pass < 2; ++pass) {  // rows, then tags
    for (int l = 0; l < L; ++l) {
      const int n = min(max(recv_count[l], 0), static_cast<int>(RM));  // a handle's count
      for (int j = warp; j < n; j += kThreads / 32) {
        const int src = recv_src[(int64_t)l * RM + j];
        const int k = recv_slot[(int64_t)l * RM + j];
        if (src < 0 || src >= RM || k < 0 || k >= K) continue;  // as the send kernel skips it
        const int s = src / M, t = src - s * M;
        if (!is_remote(ps, s)) continue;
        const int64_t i = ((int64_t)par * M + t) * K + k;
        if (pass == 0) {
          nvshmemx_putmem_nbi_warp(own_buf + i * row_bytes, scr.at[s] + i * row_bytes, row_bytes,
                                   ps.pe[s]);
          if (lane == 0) atomicAdd(&s_count[s], 1u);
        } else if (lane < tags_per_row) {
          nvshmem_int_p(tags + i * tags_per_row + lane, static_cast<int>(e), ps.pe[s]);
        }
      }
    }
    complete_warp_puts(lane);  // pass 0: the rows are in place before any tag
    __syncthreads();
  }
  const int s = threadIdx.x;
  if (dbg && s < R && is_remote(ps, s))
    printf("jax_ep debug: rank %d combine push to %d: epoch %llu, %u rows\n", r, s, e, s_count[s]);
}

__global__ void free_senders_kernel(const __grid_constant__ PeerSlots ps, const int32_t* epoch32,
                                    int dbg) {
  Slot* me = ps.slot[ps.rank];
  const unsigned long long er =
      static_cast<unsigned int>(*reinterpret_cast<const volatile int32_t*>(epoch32));
  const int s = threadIdx.x;
  if (s < ps.num_ranks && is_remote(ps, s)) {
    if (dbg) printf("jax_ep debug: rank %d frees %d: epoch %llu\n", ps.rank, s, er);
    // The receive kernel before us read our buffer's rows of s: s may write that half again.
    put_flag(&me->freed[ps.rank], er, ps.pe[s]);
    nvshmem_quiet();
  }
}

int count_remote(const PeerSlots& ps) { return __builtin_popcount(ps.remote); }

// JAX_EP_DEBUG_REMOTE=1: the push and free kernels print what they did (diagnostic).
int debug() {
  static const int v = [] {
    const char* e = std::getenv("JAX_EP_DEBUG_REMOTE");
    return e != nullptr && e[0] == '1' ? 1 : 0;
  }();
  return v;
}

}  // namespace

cudaError_t pull_prologue(const PeerSlots& ps, size_t bytes, int64_t timeout_ns,
                          cudaStream_t stream) {
  const size_t chunks = (bytes + kGetChunk - 1) / kGetChunk * count_remote(ps);
  const int grid = static_cast<int>(chunks < 32 ? (chunks > 0 ? chunks : 1) : 32);
  pull_prologue_kernel<<<grid, kThreads, 0, stream>>>(ps, bytes, timeout_ns);
  return cudaGetLastError();
}

cudaError_t pull_epilogue(const PeerSlots& ps, int64_t timeout_ns, cudaStream_t stream) {
  pull_epilogue_kernel<<<1, 32, 0, stream>>>(ps, timeout_ns);
  return cudaGetLastError();
}

cudaError_t push_dispatch_rows(const PeerSlots& ps, uint8_t* own_buf, uint8_t* const* scratch,
                               int T, int M, int64_t row_bytes, int64_t area_bytes,
                               int64_t count_bytes, cudaStream_t stream) {
  push_dispatch_kernel<<<count_remote(ps), kThreads, 0, stream>>>(
      ps, own_buf, scratch_of(ps, scratch), T, M, row_bytes, area_bytes, count_bytes, debug());
  return cudaGetLastError();
}

cudaError_t push_combine_rows(const PeerSlots& ps, uint8_t* own_buf, uint8_t* const* scratch,
                              const int32_t* recv_src, const int32_t* recv_slot,
                              const int32_t* recv_count, int L, int M, int K, int64_t row_bytes,
                              int64_t tags_offset, int tags_per_row, cudaStream_t stream) {
  push_combine_kernel<<<1, kThreads, 0, stream>>>(ps, own_buf, scratch_of(ps, scratch), recv_src,
                                                  recv_slot, recv_count, L, M, K, row_bytes,
                                                  tags_offset, tags_per_row, debug());
  return cudaGetLastError();
}

cudaError_t free_remote_senders(const PeerSlots& ps, const int32_t* epoch32, cudaStream_t stream) {
  free_senders_kernel<<<1, 32, 0, stream>>>(ps, epoch32, debug());
  return cudaGetLastError();
}

}  // namespace remote
}  // namespace jax_ep
