// Low-latency (decode) dispatch / combine: push protocol (transport/push.cuh), one kernel per op,
// or two (send, receive) for the split API. Kernels in low_latency/; handlers in
// ffi/low_latency.cc; contract in docs/ffi.md; how they work in docs/kernels.md.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ll_sizes.h"  // dispatch_buffer_bytes, combine_buffer_bytes
#include "transport/push.cuh"

namespace jax_ep {
namespace ll {

constexpr int kThreads = 512;  // 16 warps per block; one CTA per SM on 3/4 of the SMs

// Receive-buffer layout. Dispatch: [parity][src rank s] areas (dispatch_area_bytes), each M rows
// of dispatch_row_bytes then a count block. A row: a header (int tags[kDispatchTags], uint64
// pos[K], int topk_ids[K], padded to 16 bytes) then the payload (FP8: H e4m3 bytes, then G float32
// scales; BF16: 2H bytes), padded to 16 bytes. Row t of sender s holds token t of this call when
// every tag is the call's epoch (low 32 bits; each sender warp releases its tags after its part
// of the row), and was skipped (no expert of t here) when tags[0] is the epoch's complement; a
// row past s's token count (in s's data flag, written at the start of its send) keeps older
// tags. pos[k] of a slot k that names a local expert first is (epoch << 32) | the token's place
// among s's tokens for that expert (other pos words are stale). The count block: uint64 [L],
// (epoch << 32) | s's number of tokens per local expert. Words that carry their epoch need no
// ordering: the receiver polls them until the epoch is its own.
// Combine: [parity][token t][slot k] rows of 2H bytes, then int32 tags
// [parity][t][k][kCombineParts] (the epoch of the call whose column part of row (t, k) is in
// place), then float32 weights [parity][source s][t][k] (s's topk_weights, written by s at the
// start of its combine, for the expert-side pre-reduction), then int32 weight flags [parity][s]
// (the epoch of s's weights). Row (t, k) holds the bf16 output of the expert named first by
// slot k, or the two halves of a partial sum (low_latency/combine.cu, "Combine").
// Tags per dispatch row: a row is sent by up to kDispatchTags warps (its parts); part p releases
// the tags i with i % parts == p once its stores are out, so all of them say the row is in.
constexpr int kDispatchTags = 4;
int64_t dispatch_header_bytes(int64_t K);
int64_t dispatch_row_bytes(int64_t K, int64_t H, bool use_fp8);
int64_t dispatch_count_bytes(int64_t L);
// One (parity, source) area: M rows, then the count block.
int64_t dispatch_area_bytes(int64_t M, int64_t K, int64_t H, int64_t L, bool use_fp8);
// Column parts of a combine row: each is sent by its own warp and has its own tag.
constexpr int kCombineParts = 4;
// Stride of the combine's rows (bf16, padded to 16 bytes), and where their tags, the weights and
// the weight flags start: kernels, handlers and the NVSHMEM push (nvshmem/remote.h).
__host__ __device__ inline int64_t combine_row_bytes(int64_t H) {
  return (2 * H + 15) & ~int64_t{15};
}
__host__ __device__ inline int64_t combine_tags_offset(int64_t M, int64_t K, int64_t H) {
  return 2 * M * K * combine_row_bytes(H);
}
__host__ __device__ inline int64_t combine_weights_offset(int64_t M, int64_t K, int64_t H) {
  return combine_tags_offset(M, K, H) + ((2 * M * K * kCombineParts * 4 + 15) & ~int64_t{15});
}
__host__ __device__ inline int64_t combine_wflags_offset(int64_t R, int64_t M, int64_t K,
                                                         int64_t H) {
  return combine_weights_offset(M, K, H) + ((2 * R * M * K * 4 + 15) & ~int64_t{15});
}

struct DispatchParams {
  PeerSlots ps;
  uint8_t* buf[kMaxRanks];  // this slot's receive buffer on every rank (UVA)
  int mode;                 // push::Mode
  // send side (mode & kModeSend)
  const void* x;            // [T, H] bf16
  const int32_t* topk_idx;  // [T, K]
  int32_t* stats;           // [2]: num_invalid, send epoch (the split's ticket)
  // receive side (mode & kModeRecv)
  const int32_t* ticket;  // receive-only kernel: the send's stats (epoch in [1]); else null
  void* recv_x;           // [L, R*M, H] bf16, or e4m3 with use_fp8
  float* recv_scales;     // [L, R*M, G]
  int32_t* recv_count;    // [L]
  int32_t* recv_src;      // [L, R*M]: s * M + t, -1 past the count
  int32_t* recv_slot;     // [L, R*M]: first top-k slot of (s, t) naming the expert, -1 past
  int32_t* src_rows;      // [R*M, K]: row l * R*M + j of slot k of (s, t) naming local
                          //   expert l, else -1 (the combine's pre-reduction reads it)
  int T, H, K, E, L, M, G;
  int use_fp8, round_scale;
  int diag;  // JAX_EP_LL_DIAG=1: per-warp diagnostic timestamps (diag_max)
  int64_t hdr_bytes, row_bytes, area_bytes;
  int64_t timeout_ns;
  poison::Outputs outputs;  // set by launch_dispatch: the results of this kernel's phases
};

struct CombineParams {
  PeerSlots ps;
  uint8_t* buf[kMaxRanks];
  int mode;
  // send side (expert rank)
  const void* y;              // [L, R*M, H] bf16
  const int32_t* recv_src;    // [L, R*M]
  const int32_t* recv_slot;   // [L, R*M]
  const int32_t* recv_count;  // [L]
  const int32_t* src_rows;    // [R*M, K] (DispatchParams::src_rows)
  int32_t* ticket;            // [1] or null: the send op's result (its epoch), for the receive
  // both sides: the send writes the weights to the expert ranks, the receive reduces with them.
  // The rows read are the dispatch's (dispatch_idx, the handle's ids); a slot whose topk_idx
  // differs from it weighs 0 (combine_weight), so a changed topk_idx never waits for a row
  // that was not sent.
  const int32_t* topk_idx;      // [T, K]
  const float* topk_weights;    // [T, K]
  const int32_t* dispatch_idx;  // [T, K]
  // receive side (source rank)
  const int32_t* ticket_in;  // receive-only kernel: the send's ticket; else null
  void* out;                 // [T, H] bf16
  int T, H, K, E, L, M;
  // Pre-reduce on the expert rank when at least this many of a token's slots name its experts
  // (>= 2; larger than K: never). The same on every rank (both sides decide from it).
  int min_partial;
  int diag;  // JAX_EP_LL_DIAG=1: per-warp diagnostic timestamps (diag_max)
  int64_t timeout_ns;
  poison::Outputs outputs;  // set by launch_combine: the results of this kernel's phases
};

// Blocks of the LL dispatch / combine kernels of a rank that has `sms` SMs (runtime/device.h
// sm_count: the device's, or a virtual rank's share): three quarters of them / all but
// kCombineFreeSms (see low_latency/combine.cu); 0 when sms is 0 (a CUDA error).
int dispatch_grid_size(int sms);
int combine_grid_size(int sms);
cudaError_t launch_dispatch(const DispatchParams& p, int grid, cudaStream_t stream);
cudaError_t launch_combine(const CombineParams& p, int grid, cudaStream_t stream);

}  // namespace ll
}  // namespace jax_ep
