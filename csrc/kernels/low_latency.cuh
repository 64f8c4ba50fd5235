// Low-latency (decode) dispatch / combine: push protocol (transport/push.cuh), one kernel per op,
// or two (send, receive) for the split API. Kernels in low_latency.cu; handlers in
// ffi/low_latency.cc; contract in docs/ffi.md; how they work in docs/kernels.md.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "transport/push.cuh"

namespace jax_ep {
namespace ll {

constexpr int kThreads = 512;  // 16 warps per block; one CTA per SM on 3/4 of the SMs

// Receive-buffer layout. Dispatch: [parity][src rank s] areas (dispatch_area_bytes), each M rows
// of dispatch_row_bytes then a count block. A row: a header (int epoch tag, int topk_ids[K], int
// pos[K], padded to 16 bytes) then the payload (FP8: H e4m3 bytes, then G float32 scales; BF16:
// 2H bytes), padded to 16 bytes. Row t of sender s holds token t when its tag is this call's
// epoch (a token not sent to us keeps an older tag); pos[k] of a slot k that names a local expert
// first is the token's place among s's tokens for that expert (other pos words are stale). The
// count block: int32 [L], s's number of tokens per local expert. Combine: [parity][token t][slot
// k] rows of 2H bytes (bf16 expert output of the expert named first by slot k), then int32 tags
// [parity][t][k]: the epoch of the call whose row (t, k) is in place.
int64_t dispatch_header_bytes(int64_t K);
int64_t dispatch_row_bytes(int64_t K, int64_t H, bool use_fp8);
int64_t dispatch_count_bytes(int64_t L);
// One (parity, source) area: M rows, then the count block.
int64_t dispatch_area_bytes(int64_t M, int64_t K, int64_t H, int64_t L, bool use_fp8);
int64_t dispatch_buffer_bytes(int64_t R, int64_t M, int64_t K, int64_t H, int64_t L,
                              bool use_fp8);
// Stride of the combine's rows (bf16, padded to 16 bytes), and where their tags start (after
// the rows of both parities): kernels, handlers and the NVSHMEM push (transport/remote.h).
__host__ __device__ inline int64_t combine_row_bytes(int64_t H) {
  return (2 * H + 15) & ~int64_t{15};
}
__host__ __device__ inline int64_t combine_tags_offset(int64_t M, int64_t K, int64_t H) {
  return 2 * M * K * combine_row_bytes(H);
}
int64_t combine_buffer_bytes(int64_t M, int64_t K, int64_t H);

struct DispatchParams {
  PeerSlots ps;
  uint8_t* buf[kMaxRanks];    // this slot's receive buffer on every rank (UVA)
  int mode;                   // push::Mode
  // send side (mode & kModeSend)
  const void* x;              // [T, H] bf16
  const int32_t* topk_idx;    // [T, K]
  int32_t* stats;             // [2]: num_invalid, send epoch (the split's ticket)
  // receive side (mode & kModeRecv)
  const int32_t* ticket;      // receive-only kernel: the send's stats (epoch in [1]); else null
  void* recv_x;               // [L, R*M, H] bf16, or e4m3 with use_fp8
  float* recv_scales;         // [L, R*M, G]
  int32_t* recv_count;        // [L]
  int32_t* recv_src;          // [L, R*M]: s * M + t, -1 past the count
  int32_t* recv_slot;         // [L, R*M]: first top-k slot of (s, t) naming the expert, -1 past
  int T, H, K, E, L, M, G;
  int use_fp8, round_scale;
  int diag;                   // JAX_EP_LL_DIAG=1: per-warp diagnostic timestamps (diag_max)
  int64_t hdr_bytes, row_bytes, area_bytes;
  int64_t timeout_ns;
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
  int32_t* ticket;            // [1] or null: the send op's result (its epoch), for the receive
  // receive side (source rank)
  const int32_t* ticket_in;   // receive-only kernel: the send's ticket; else null
  const int32_t* topk_idx;    // [T, K]
  const float* topk_weights;  // [T, K]
  void* out;                  // [T, H] bf16
  int T, H, K, E, L, M;
  int diag;                   // JAX_EP_LL_DIAG=1: per-warp diagnostic timestamps (diag_max)
  int64_t timeout_ns;
};

// Blocks of the LL kernels on `device` (half its SMs: see low_latency.cu); 0 on a CUDA error.
int grid_size(int device);
cudaError_t launch_dispatch(const DispatchParams& p, int grid, cudaStream_t stream);
cudaError_t launch_combine(const CombineParams& p, int grid, cudaStream_t stream);

}  // namespace ll
}  // namespace jax_ep
