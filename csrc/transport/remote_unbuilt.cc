// Builds without NVSHMEM: no per-process mode, hence no remote peers (see remote.h).
#include "transport/remote.h"

namespace jax_ep {
namespace remote {

cudaError_t pull_prologue(const PeerSlots&, size_t, int64_t, cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t pull_epilogue(const PeerSlots&, int64_t, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t push_dispatch_rows(const PeerSlots&, uint8_t*, uint8_t* const*, int, int, int64_t,
                               int64_t, int64_t, cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t push_combine_rows(const PeerSlots&, uint8_t*, uint8_t* const*, const int32_t*,
                              const int32_t*, const int32_t*, int, int, int, int64_t, int64_t, int,
                              cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t free_remote_senders(const PeerSlots&, const int32_t*, cudaStream_t) {
  return cudaErrorNotSupported;
}

}  // namespace remote
}  // namespace jax_ep
