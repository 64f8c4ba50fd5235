// Low-latency buffer sizes on the host (declared in kernels/low_latency.cuh; the Python side
// asks for them through the extension).
#include "kernels/low_latency.cuh"
#include "kernels/low_latency/common.cuh"

namespace jax_ep {
namespace ll {

int64_t dispatch_header_bytes(int64_t K) { return align16(4 * kDispatchTags + 12 * K); }
int64_t dispatch_row_bytes(int64_t K, int64_t H, bool use_fp8) {
  return dispatch_header_bytes(K) + align16(use_fp8 ? H + 4 * (H / 128) : 2 * H);
}
int64_t dispatch_count_bytes(int64_t L) { return align16(8 * L); }
int64_t dispatch_area_bytes(int64_t M, int64_t K, int64_t H, int64_t L, bool use_fp8) {
  return M * dispatch_row_bytes(K, H, use_fp8) + dispatch_count_bytes(L);
}
int64_t dispatch_buffer_bytes(int64_t R, int64_t M, int64_t K, int64_t H, int64_t L, bool use_fp8) {
  return 2 * R * dispatch_area_bytes(M, K, H, L, use_fp8);
}
int64_t combine_buffer_bytes(int64_t R, int64_t M, int64_t K, int64_t H) {
  return combine_wflags_offset(R, M, K, H) + align16(2 * R * 4);  // rows, tags, weights, flags
}

}  // namespace ll
}  // namespace jax_ep
