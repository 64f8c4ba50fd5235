// Builds without NVSHMEM (CMakeLists.txt compiles this file instead of symmetric.cc, glue.cu
// and remote.cu): no per-process mode, hence no symmetric arena and no remote peers.
#include <stdexcept>
#include <string>
#include <vector>

#include "nvshmem/remote.h"
#include "nvshmem/symmetric.h"

namespace jax_ep {
namespace sym {

bool built() { return false; }
bool active() { return false; }
int my_pe() { return -1; }
int n_pes() { return 0; }
static void not_built() {
  throw std::runtime_error(
      "jax_ep: this build has no per-process (NVSHMEM) transport: rebuild with the "
      "nvidia-nvshmem-cu12/-cu13 wheel installed (pip install --no-build-isolation "
      "'.[cuda13]'), or run one process over all GPUs of the node");
}
void attach(size_t) { not_built(); }
std::vector<long long> self_test() {
  not_built();
  return {};
}
void init_groups(const std::vector<std::vector<int>>&) { not_built(); }
Workspace* group_workspace(const int64_t*, int, int, bool* remote, std::string* err) {
  *remote = false;
  *err = "no per-process transport in this build";
  return nullptr;
}
std::vector<unsigned long long> reserve(const std::vector<std::vector<int>>&, int, size_t, uint64_t,
                                        LedgerEntry*) {
  not_built();
  return {};
}
std::string check_lease(const LedgerEntry&, const std::vector<std::vector<int>>&, long long) {
  return {};
}
std::vector<int> remote_pes() { return {}; }
size_t arena_bytes() { return 0; }
size_t arena_used() { return 0; }

}  // namespace sym
}  // namespace jax_ep

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
