// The handlers of the one-GPU multi-rank mode (runtime/virtual_ranks.h, docs/testing.md): one
// custom call carries the operands and results of all R virtual ranks stacked along a leading
// axis, and runs the production handler body once per rank, on the rank's own stream, with every
// buffer sliced to that rank and the peer table naming the ranks' workspaces on this device.
// The residency of every launch is checked first (a dry run of rank 0), so that either all R
// ranks launch or none does.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "runtime/virtual_ranks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace vr {

// Views of rank r's slice of stacked buffers; owns the XLA_FFI_Buffer structs it hands out.
struct Slices {
  int rank = 0;
  int64_t num_ranks = -1;  // the leading dimension of the first buffer seen
  std::string error;
  std::deque<XLA_FFI_Buffer> store;

  const XLA_FFI_Buffer* slice(xla::ffi::DataType dt, void* data, xla::ffi::Span<const int64_t> dims,
                              size_t bytes) {
    if (num_ranks < 0 && !(dims.size() == 0)) num_ranks = dims[0];
    if ((dims.size() == 0) || dims[0] != num_ranks || num_ranks < 1) {
      if (error.empty())
        error =
            "every operand and result must be stacked over the virtual ranks (leading dimension " +
            std::to_string(num_ranks) + ")";
      num_ranks = num_ranks < 1 ? 1 : num_ranks;
    }
    XLA_FFI_Buffer b{};
    b.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    b.extension_start = nullptr;
    b.dtype = static_cast<XLA_FFI_DataType>(dt);
    const size_t per_rank = num_ranks > 0 ? bytes / static_cast<size_t>(num_ranks) : 0;
    b.data = static_cast<uint8_t*>(data) + per_rank * static_cast<size_t>(rank);
    b.rank = (dims.size() == 0) ? 0 : static_cast<int64_t>(dims.size()) - 1;
    b.dims = (dims.size() == 0) ? nullptr : const_cast<int64_t*>(dims.begin() + 1);
    store.push_back(b);
    return &store.back();
  }
};

template <typename T>
struct Slicer {  // attributes: the same for every rank
  static T apply(Slices&, T v) { return v; }
};
template <>
struct Slicer<xla::ffi::AnyBuffer> {
  static xla::ffi::AnyBuffer apply(Slices& s, xla::ffi::AnyBuffer b) {
    return xla::ffi::AnyBuffer(
        s.slice(b.element_type(), b.untyped_data(), b.dimensions(), b.size_bytes()));
  }
};
template <xla::ffi::DataType dt>
struct Slicer<xla::ffi::Buffer<dt>> {
  static xla::ffi::Buffer<dt> apply(Slices& s, xla::ffi::Buffer<dt> b) {
    return xla::ffi::Buffer<dt>(s.slice(dt, b.untyped_data(), b.dimensions(), b.size_bytes()));
  }
};
template <typename T>
struct Slicer<xla::ffi::Result<T>> {
  static xla::ffi::Result<T> apply(Slices& s, xla::ffi::Result<T> r) {
    return xla::ffi::Result<T>(Slicer<T>::apply(s, *r));
  }
};

inline xla::ffi::Error fail(const std::string& m) {
  return xla::ffi::Error::InvalidArgument("jax_ep (one-GPU multi-rank mode): " + m);
}

template <typename Fn, Fn impl>
struct Ranks;

// impl: a production handler body, (stream, device ordinal, operands..., attributes...).
template <typename... Ts, xla::ffi::Error (*impl)(cudaStream_t, int32_t, Ts...)>
struct Ranks<xla::ffi::Error (*)(cudaStream_t, int32_t, Ts...), impl> {
  static xla::ffi::Error call(cudaStream_t stream, int32_t device, Ts... xs) {
    // the device's rank streams, events and call counter are shared by every op
    std::lock_guard<std::mutex> lock(rank_streams_mutex(device));
    // Dry run of rank 0: shapes, attributes and the residency of every launch; nothing runs.
    // Slicing rank 0 also learns the rank count, the leading dimension of the stacked buffers
    // (all must agree; a braced list slices them in order).
    Slices probe;
    std::tuple<Ts...> rank0{Slicer<Ts>::apply(probe, xs)...};
    if (!probe.error.empty()) return fail(probe.error);
    if (probe.num_ranks < 1 || probe.num_ranks > kMaxRanks)
      return fail("the stacked operands name " + std::to_string(probe.num_ranks) + " ranks; 1 to " +
                  std::to_string(kMaxRanks) + " are supported");
    VirtualRank v;
    v.device = device;
    v.dry_run = true;
    v.num_ranks = static_cast<int>(probe.num_ranks);
    {
      VirtualRankScope scope(&v);
      xla::ffi::Error e = std::apply(
          [&](auto&&... a) { return impl(stream, device, std::forward<decltype(a)>(a)...); },
          std::move(rank0));
      if (e.failure()) return e;
      if (!v.error.empty()) return fail(v.error);
    }
    const int R = v.num_ranks;
    RankStreams* rs = nullptr;
    if (std::string m = fork_ranks(device, R, stream, &rs); !m.empty()) return fail(m);
    xla::ffi::Error first = xla::ffi::Error::Success();
    const unsigned int absent = absent_ranks();  // testing: ranks that do not run
    for (int r = 0; r < R; ++r) {
      if ((absent >> r) & 1u) continue;
      Slices s;
      s.rank = r;
      s.num_ranks = R;
      VirtualRank vr;
      vr.device = device;
      vr.rank = r;
      vr.num_ranks = R;
      VirtualRankScope scope(&vr);
      xla::ffi::Error e =
          impl(static_cast<cudaStream_t>(rank_stream(rs, r)), device, Slicer<Ts>::apply(s, xs)...);
      // Rank 0 passed every check above, so a failure here is a CUDA error: the other ranks
      // still launch (a rank left out would leave its peers waiting until the timeout).
      if (e.failure() && first.success()) first = std::move(e);
    }
    if (std::string m = join_ranks(rs, R, stream); !m.empty()) return fail(m);
    return first;
  }
};

}  // namespace vr
}  // namespace jax_ep

// The virtual-rank handler of a production handler body.
#define JAX_EP_VIRTUAL_RANKS(impl) (&::jax_ep::vr::Ranks<decltype(&impl), &impl>::call)

// A production handler `name` (command-buffer compatible) and its virtual-rank twin `name`Vr,
// both bound by `binding`.
#define JAX_EP_DEFINE_HANDLER_AND_VR(name, impl, binding)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding, {xla::ffi::Traits::kCmdBufferCompatible}); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Vr, JAX_EP_VIRTUAL_RANKS(impl), binding)
