// Peers without load/store access (per-process mode: other nodes, or every peer with
// JAX_EP_FORCE_REMOTE_PEERS=1): NVSHMEM transfers in kernels of their own, launched by the
// handlers around the op kernels on the same stream. The op kernels are the same for every peer
// (one code path per algorithm); for a remote peer they skip its memory and flags:
//   pull (high-throughput): pull_prologue exchanges "staged" flags with the remote peers and
//     gets each one's staging buffer into this rank's mirror of it (PeerSlots::stage then points
//     at the mirror), the op kernels run, pull_epilogue exchanges the end-of-call done flags.
//   push (low-latency): the send kernel writes a remote peer's rows into this rank's scratch
//     image of that peer's buffer; push_dispatch_rows / push_combine_rows put them (NVSHMEM
//     non-blocking puts), complete them (quiet), then put the data flag. After the receive
//     kernel, free_remote_senders puts the freed flag into each remote sender's slot.
// Flags travel as plain 64-bit puts, never atomics (one writer per flag), so the receive stays
// idempotent and transports without GPU atomics (UCX without GDRCopy) can carry them.
// Implemented in remote.cu (built only with NVSHMEM); without it every entry point returns an
// error, and remote peers cannot occur (they exist only in the per-process mode).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "transport/peer.cuh"

namespace jax_ep {
namespace remote {

// Pull, before the op kernels. ps.stage[rank]: this rank's staging buffer (symmetric);
// ps.stage[q] of a remote q: this rank's mirror of q's, which the prologue fills; bytes: the
// staged size (the same on every rank).
cudaError_t pull_prologue(const PeerSlots& ps, size_t bytes, int64_t timeout_ns,
                          cudaStream_t stream);
// Pull, after the op kernels (they closed the epoch).
cudaError_t pull_epilogue(const PeerSlots& ps, int64_t timeout_ns, cudaStream_t stream);

// Push, after the send kernel (its epoch is the slot's send_epoch). own_buf: this rank's
// receive buffer (symmetric: the same offsets on the remote PE); scratch[q]: the image of q's.
// Dispatch: in our area ([parity][r], area_bytes), the rows t < T of row_bytes whose header tag
// is the epoch, and the count block (count_bytes, after the M rows).
cudaError_t push_dispatch_rows(const PeerSlots& ps, uint8_t* own_buf, uint8_t* const* scratch,
                               int T, int M, int64_t row_bytes, int64_t area_bytes,
                               int64_t count_bytes, cudaStream_t stream);
// Combine: the rows named by recv_src / recv_slot ([L, R*M], counts recv_count [L]), at
// [parity][t][k] of row_bytes in the source's buffer, then (once they completed) their tags, at
// tags_offset (ll::combine_tags_offset), tags_per_row of them per row. A remote source gets
// whole rows, never partial sums (their weights would have to cross before the send).
cudaError_t push_combine_rows(const PeerSlots& ps, uint8_t* own_buf, uint8_t* const* scratch,
                              const int32_t* recv_src, const int32_t* recv_slot,
                              const int32_t* recv_count, int L, int M, int K, int64_t row_bytes,
                              int64_t tags_offset, int tags_per_row, cudaStream_t stream);
// Push, after the receive kernel: epoch32 is where that kernel read its epoch (int32).
cudaError_t free_remote_senders(const PeerSlots& ps, const int32_t* epoch32, cudaStream_t stream);

}  // namespace remote
}  // namespace jax_ep
