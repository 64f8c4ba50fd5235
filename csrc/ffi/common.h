// What every handler file shares: shape checks and their messages, the int32 limit of sizes
// that travel as int32, and the error builders (argument errors name the op, CUDA errors where
// they happened).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_ep {

// Sizes and row ids that the ops pass as int32 stay below this.
constexpr int64_t kInt32Max = (int64_t{1} << 31) - 1;

// True when `d` is exactly `want` (shape checks of the handlers).
inline bool dims_are(xla::ffi::Span<const int64_t> d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

// "[d0, d1, ...]" for error messages.
inline std::string dims_str(xla::ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}
inline std::string dims_str(std::initializer_list<int64_t> d) {
  std::string s = "[";
  size_t i = 0;
  for (int64_t v : d) s += (i++ ? ", " : "") + std::to_string(v);
  return s + "]";
}

// An argument error of `op`: "op: message".
inline xla::ffi::Error op_error(const char* op, const std::string& message) {
  return xla::ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// Success when `dims` is `want`, else "op: name must have shape [..], got [..]".
inline xla::ffi::Error expect_dims(const char* op, const char* name,
                                   xla::ffi::Span<const int64_t> dims,
                                   std::initializer_list<int64_t> want) {
  if (dims_are(dims, want)) return xla::ffi::Error::Success();
  return op_error(
      op, std::string(name) + " must have shape " + dims_str(want) + ", got " + dims_str(dims));
}

// Success when `dims` has `rank` dimensions, else "op: name must be <want>, got [..]".
inline xla::ffi::Error expect_rank(const char* op, const char* name,
                                   xla::ffi::Span<const int64_t> dims, size_t rank,
                                   const char* want) {
  if (dims.size() == rank) return xla::ffi::Error::Success();
  return op_error(op, std::string(name) + " must be " + want + ", got " + dims_str(dims));
}

// The last CUDA error as an internal error naming where it happened (Success when none).
inline xla::ffi::Error cuda_error(const char* where) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal,
                         std::string("jax_ep: ") + where + ": " + cudaGetErrorString(e));
}

}  // namespace jax_ep

// Return the error of `expr` when it failed.
#define JAX_EP_RETURN_IF_ERROR(expr) \
  do {                               \
    ::xla::ffi::Error _e = (expr);   \
    if (_e.failure()) return _e;     \
  } while (0)
