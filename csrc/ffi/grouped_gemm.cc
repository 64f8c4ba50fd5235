// jax_ep_grouped_gemm: grouped GEMMs for the experts (no communication). See docs/ffi.md and
// csrc/kernels/gemm/grouped_gemm.h.
#include <cuda_runtime.h>

#include <string>

#include "ffi/group.h"
#include "ffi/handlers.h"
#include "kernels/gemm/grouped_gemm.h"
#include "runtime/device.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jax_ep::dims_str;
namespace gemm = jax_ep::gemm;

namespace {

ffi::Error bad(const std::string& m) { return jax_ep::op_error("jax_ep_grouped_gemm", m); }

#define JAX_EP_EXPECT_DIMS(buf, name, ...) \
  JAX_EP_RETURN_IF_ERROR(                  \
      jax_ep::expect_dims("jax_ep_grouped_gemm", name, (buf).dimensions(), {__VA_ARGS__}))

ffi::Error GroupedGemmImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs,
                           ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                           ffi::Buffer<ffi::F32> lhs_scales, ffi::Buffer<ffi::F32> rhs_scales,
                           ffi::Buffer<ffi::S32> row_counts, ffi::AnyBuffer acc,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::U8>> ws,
                           int64_t mode, bool rhs_kn, bool small_m, bool zero_padding,
                           bool accumulate) {
  gemm::Call c;
  gemm::GemmShape& s = c.s;
  if (mode < 0 || mode > 2) return bad("mode must be 0, 1 or 2, got " + std::to_string(mode));
  s.mode = static_cast<gemm::Mode>(mode);
  s.rhs_kn = rhs_kn;
  s.small_m = small_m;
  s.zero_padding = zero_padding;
  s.accumulate = accumulate;
  const ffi::DataType et = lhs.element_type();
  ffi::DataType out_type = et;
  if (et == ffi::DataType::BF16) {
    s.dtype = gemm::Dtype::kBF16;
  } else if (et == ffi::DataType::F16) {
    s.dtype = gemm::Dtype::kF16;
  } else if (et == ffi::DataType::F8E4M3FN) {
    s.dtype = gemm::Dtype::kFP8;
    out_type = ffi::DataType::BF16;
  } else {
    return bad("lhs must be bfloat16, float16 or float8_e4m3fn");
  }
  if (rhs.element_type() != et) return bad("rhs must have lhs's dtype");
  if (out->element_type() != out_type)
    return bad(std::string("out must be ") +
               (out_type == ffi::DataType::BF16 ? "bfloat16" : "float16"));

  const auto dl = lhs.dimensions(), dr = rhs.dimensions();
  const auto dsz = sizes.dimensions();
  if (dsz.size() != 1) return bad("group_sizes must be [G], got " + dims_str(dsz));
  s.G = dsz[0];
  if (s.mode == gemm::Mode::kMasked) {
    if (dl.size() != 3) return bad("lhs must be [G, C, K], got " + dims_str(dl));
    s.M = dl[1];
    s.K = dl[2];
    if (dl[0] != s.G)
      return bad("lhs must be [G=" + std::to_string(s.G) + ", C, K], got " + dims_str(dl));
  } else {
    if (dl.size() != 2) return bad("lhs must be [M, K], got " + dims_str(dl));
    s.M = dl[0];
    s.K = dl[1];
  }
  if (s.mode == gemm::Mode::kTransposed) {
    if (dr.size() != 2 || dr[0] != s.M)
      return bad("rhs must be [M=" + std::to_string(s.M) + ", N], got " + dims_str(dr));
    s.N = dr[1];
    JAX_EP_EXPECT_DIMS(*out, "out", s.G, s.K, s.N);
  } else {
    if (dr.size() != 3 || dr[0] != s.G || dr[rhs_kn ? 1 : 2] != s.K)
      return bad(std::string("rhs must be ") + (rhs_kn ? "[G, K, N]" : "[G, N, K]") + " with G=" +
                 std::to_string(s.G) + ", K=" + std::to_string(s.K) + ", got " + dims_str(dr));
    s.N = dr[rhs_kn ? 2 : 1];
    if (s.mode == gemm::Mode::kMasked) {
      JAX_EP_EXPECT_DIMS(*out, "out", s.G, s.M, s.N);
    } else {
      JAX_EP_EXPECT_DIMS(*out, "out", s.M, s.N);
    }
  }
  if (auto why = gemm::unsupported(s); !why.empty()) return bad(why);
  if (s.dtype == gemm::Dtype::kFP8) {
    const int64_t KB = s.K / gemm::kFp8Block, NB = s.N / gemm::kFp8Block;
    if (s.mode == gemm::Mode::kMasked) {
      JAX_EP_EXPECT_DIMS(lhs_scales, "lhs_scales", s.G, s.M, KB);
    } else {
      JAX_EP_EXPECT_DIMS(lhs_scales, "lhs_scales", s.M, KB);
    }
    JAX_EP_EXPECT_DIMS(rhs_scales, "rhs_scales", s.G, KB, NB);
  }
  if (row_counts.element_count() > 0) {
    if (s.mode != gemm::Mode::kTransposed)
      return bad("row_counts applies to mode 2 (the weight gradient) only; pass [0]");
    JAX_EP_EXPECT_DIMS(row_counts, "row_counts", s.G);
    c.row_counts = row_counts.typed_data();
  }
  if (accumulate) {
    if (acc.element_type() != out->element_type()) return bad("acc must have out's dtype");
    JAX_EP_EXPECT_DIMS(acc, "acc", s.G, s.K, s.N);
  } else if (acc.element_count() > 0) {
    return bad("acc applies with accumulate only; pass [0]");
  }
  c.device = device;
  c.sm_count = jax_ep::sm_count(device);
  if (c.sm_count <= 0)
    return bad("cannot read the multiprocessor count of device " + std::to_string(device));
  const size_t need = gemm::workspace_bytes(s, c.sm_count);
  if (ws->element_count() < need)
    return bad("workspace has " + std::to_string(ws->element_count()) + " bytes, needs " +
               std::to_string(need) + " (sized for a device with fewer SMs?)");
  c.lhs = lhs.untyped_data();
  c.rhs = rhs.untyped_data();
  c.sizes = sizes.typed_data();
  c.lhs_scales = lhs_scales.typed_data();
  c.rhs_scales = rhs_scales.typed_data();
  c.out = out->untyped_data();
  c.workspace = ws->untyped_data();
  c.workspace_bytes = ws->element_count();
  // accumulate: out starts as acc. XLA aliases the two (one buffer); a copy when it did not.
  if (accumulate && acc.untyped_data() != c.out) {
    const cudaError_t e = cudaMemcpyAsync(c.out, acc.untyped_data(), acc.size_bytes(),
                                          cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return bad(std::string("copying acc into out: ") + cudaGetErrorString(e));
  }
  if (auto err = gemm::run(c, stream); !err.empty())
    return ffi::Error(ffi::ErrorCode::kInternal, "jax_ep_grouped_gemm: " + err);
  return jax_ep::cuda_error("jax_ep_grouped_gemm launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGroupedGemm, GroupedGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // lhs
                                  .Arg<ffi::AnyBuffer>()         // rhs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes / counts [G]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lhs_scales (FP8; else [0])
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rhs_scales (FP8; else [0])
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_counts (mode 2; or [0])
                                  .Arg<ffi::AnyBuffer>()         // acc (accumulate; or [0])
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::U8>>()   // workspace
                                  .Attr<int64_t>("mode")
                                  .Attr<bool>("rhs_kn")
                                  .Attr<bool>("small_m")
                                  .Attr<bool>("zero_padding")
                                  .Attr<bool>("accumulate"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
