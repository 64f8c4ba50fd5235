// jax_ep_ll_dispatch / jax_ep_ll_combine: decode, check shapes, one kernel launch each.
// Contract: docs/ffi.md. Kernels: kernels/low_latency.cu.
#include <cuda_runtime.h>

#include <string>

#include "ffi/group.h"
#include "ffi/handlers.h"
#include "kernels/low_latency.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jax_ep::dims_str;

namespace {

bool dims_are(ffi::Span<const int64_t> d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

constexpr int64_t kIntMax = (int64_t{1} << 31) - 1;

ffi::Error LlDispatchImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::S32> topk_idx, ffi::Result<ffi::AnyBuffer> recv_x,
                          ffi::Result<ffi::Buffer<ffi::F32>> recv_scales,
                          ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                          ffi::Result<ffi::Buffer<ffi::S32>> recv_src,
                          ffi::Result<ffi::Buffer<ffi::S32>> src_to_row,
                          ffi::Result<ffi::Buffer<ffi::S32>> stats,
                          ffi::Result<ffi::AnyBuffer> staging, ffi::Span<const int64_t> groups,
                          int64_t group_size, int64_t slot, int64_t timeout_ns,
                          int64_t num_blocks, int64_t num_experts, int64_t max_tokens,
                          bool use_fp8, bool round_scale) {
  auto bad = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_ep_ll_dispatch: " + m);
  };
  jax_ep::GroupInfo gi;
  if (ffi::Error err = jax_ep::resolve_group(device, groups, group_size, slot, &gi); err.failure())
    return err;
  const int64_t R = group_size, M = max_tokens, E = num_experts;
  if (E < R || E % R != 0 || E > (1 << 30))
    return bad("num_experts (" + std::to_string(E) + ") must be a positive multiple of the group "
               "size (" + std::to_string(R) + ")");
  const int64_t L = E / R;
  if (L > jax_ep::kMaxLocalExperts)
    return bad("experts per rank " + std::to_string(L) + " exceeds " +
               std::to_string(jax_ep::kMaxLocalExperts));
  const auto dx = x.dimensions(), di = topk_idx.dimensions();
  if (dx.size() != 2) return bad("x must be [T, H], got " + dims_str(dx));
  const int64_t T = dx[0], H = dx[1];
  if (di.size() != 2 || di[0] != T) return bad("topk_idx must be [T, K], got " + dims_str(di));
  const int64_t K = di[1];
  if (M < 0 || T > M)
    return bad("T = " + std::to_string(T) + " exceeds max_tokens = " + std::to_string(M));
  if (R * M > kIntMax / 2 || T * K > kIntMax || H > kIntMax / 4 || K > (1 << 20) ||
      L * R * M > kIntMax)
    return bad("shapes too large");
  if (use_fp8 && H % 128 != 0) return bad("use_fp8 needs H % 128 == 0, got H = " + std::to_string(H));
  const int64_t G = use_fp8 ? H / 128 : 0;
  const auto want_x = use_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16;
  if (recv_x->element_type() != want_x)
    return bad(std::string("recv_x must be ") + (use_fp8 ? "float8_e4m3fn" : "bfloat16"));
  if (!dims_are(recv_x->dimensions(), {L, R * M, H}))
    return bad("recv_x must be [L, R*M, H], got " + dims_str(recv_x->dimensions()));
  if (!dims_are(recv_scales->dimensions(), {L, R * M, G}))
    return bad("recv_scales must be [L, R*M, G], got " + dims_str(recv_scales->dimensions()));
  if (!dims_are(recv_count->dimensions(), {L}))
    return bad("recv_count must be [L], got " + dims_str(recv_count->dimensions()));
  if (!dims_are(recv_src->dimensions(), {L, R * M}))
    return bad("recv_src must be [L, R*M], got " + dims_str(recv_src->dimensions()));
  if (!dims_are(src_to_row->dimensions(), {R, M, L}))
    return bad("src_to_row must be [R, M, L], got " + dims_str(src_to_row->dimensions()));
  if (stats->element_count() != 2) return bad("stats must be [2]");
  const int64_t S = use_fp8 ? H + 4 * G : 2 * H;
  if (staging->size_bytes() < static_cast<size_t>(M * S))
    return bad("staging must hold [M, S] bytes with S = " + std::to_string(S));

  (void)num_blocks;  // LL dispatch uses every SM (latency-bound); see kernels/low_latency.cuh
  const int grid = jax_ep::ll::dispatch_grid(device, static_cast<int>(K));
  if (grid < 1) return jax_ep::cuda_error("jax_ep_ll_dispatch: occupancy query");

  jax_ep::ll::DispatchParams p{};
  p.ps = gi.peers;
  p.x = x.untyped_data();
  p.topk_idx = topk_idx.typed_data();
  p.recv_x = recv_x->untyped_data();
  p.recv_scales = recv_scales->typed_data();
  p.recv_count = recv_count->typed_data();
  p.recv_src = recv_src->typed_data();
  p.src_to_row = src_to_row->typed_data();
  p.stats = stats->typed_data();
  p.staging = static_cast<uint8_t*>(staging->untyped_data());
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.K = static_cast<int>(K);
  p.E = static_cast<int>(E);
  p.L = static_cast<int>(L);
  p.M = static_cast<int>(M);
  p.G = static_cast<int>(G);
  p.use_fp8 = use_fp8 ? 1 : 0;
  p.round_scale = round_scale ? 1 : 0;
  p.timeout_ns = timeout_ns;
  jax_ep::ll::launch_dispatch(p, grid, stream);
  return jax_ep::cuda_error("jax_ep_ll_dispatch launch");
}

ffi::Error LlCombineImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> y,
                         ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                         ffi::Buffer<ffi::S32> src_to_row, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                         ffi::Span<const int64_t> groups, int64_t group_size, int64_t slot,
                         int64_t timeout_ns, int64_t num_blocks, int64_t num_experts) {
  (void)num_blocks;  // grid follows the shape (no grid barrier in combine)
  auto bad = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_ep_ll_combine: " + m);
  };
  jax_ep::GroupInfo gi;
  if (ffi::Error err = jax_ep::resolve_group(device, groups, group_size, slot, &gi); err.failure())
    return err;
  const int64_t R = group_size, E = num_experts;
  if (E < R || E % R != 0 || E > (1 << 30))
    return bad("num_experts (" + std::to_string(E) + ") must be a positive multiple of the group "
               "size (" + std::to_string(R) + ")");
  const int64_t L = E / R;
  const auto ds = src_to_row.dimensions();
  if (ds.size() != 3 || ds[0] != R || ds[2] != L)
    return bad("src_to_row must be [R, M, L], got " + dims_str(ds));
  const int64_t M = ds[1];
  const auto dy = y.dimensions();
  if (dy.size() != 3 || dy[0] != L || dy[1] != R * M)
    return bad("y must be [L, R*M, H], got " + dims_str(dy));
  const int64_t H = dy[2];
  const auto di = topk_idx.dimensions();
  if (di.size() != 2) return bad("topk_idx must be [T, K], got " + dims_str(di));
  const int64_t T = di[0], K = di[1];
  if (T > M) return bad("T exceeds max_tokens");
  if (!dims_are(topk_weights.dimensions(), {T, K}))
    return bad("topk_weights must be [T, K], got " + dims_str(topk_weights.dimensions()));
  if (!dims_are(out->dimensions(), {T, H}))
    return bad("out must be [T, H], got " + dims_str(out->dimensions()));
  if (R * M > kIntMax / 2 || T * K > kIntMax || H > kIntMax / 4 || K > 2048 ||
      T * ((H + 255) / 256) > kIntMax)
    return bad("shapes too large");

  jax_ep::ll::CombineParams p{};
  p.ps = gi.peers;
  p.y = y.untyped_data();
  p.topk_idx = topk_idx.typed_data();
  p.topk_weights = topk_weights.typed_data();
  p.src_to_row = src_to_row.typed_data();
  p.out = out->untyped_data();
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.K = static_cast<int>(K);
  p.E = static_cast<int>(E);
  p.L = static_cast<int>(L);
  p.M = static_cast<int>(M);
  p.timeout_ns = timeout_ns;
  jax_ep::ll::launch_combine(p, stream);
  return jax_ep::cuda_error("jax_ep_ll_combine launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlDispatch, LlDispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [T, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_idx [T, K]
                                  .Ret<ffi::AnyBuffer>()          // recv_x [L, R*M, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // recv_scales [L, R*M, G]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // recv_count [L]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // recv_src [L, R*M]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // src_to_row [R, M, L]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // stats [2]
                                  .Ret<ffi::AnyBuffer>()          // staging [M, S] u8
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("num_blocks")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("max_tokens")
                                  .Attr<bool>("use_fp8")
                                  .Attr<bool>("round_scale"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlCombine, LlCombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // y [L, R*M, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_idx [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src_to_row [R, M, L]
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out [T, H]
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("num_blocks")
                                  .Attr<int64_t>("num_experts"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
