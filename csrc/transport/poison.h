// The outputs of an op whose wait gave up (docs/design.md#clean-timeouts): every byte of every
// result is kByte, so every floating result reads NaN and every int32 result reads kInt. The
// kernels' side is transport/poison.cuh; this part is plain C++ (the nanobind module exports the
// values: jax_ep._C.poison_byte, poison_int).
#pragma once
#include <cstdint>

namespace jax_ep::poison {

// All bits set: a NaN in float32, bfloat16, float16 and float8_e4m3fn alike (the ops' results
// move as bytes, whatever their dtype), and -1 in int32.
constexpr int kByte = 0xFF;
constexpr int32_t kInt = -1;

// The results a kernel fills when it finds its device failed: the launcher lists them.
constexpr int kMaxOutputs = 8;
struct Outputs {
  void* ptr[kMaxOutputs];
  int64_t bytes[kMaxOutputs];
  int n;
};

// Host: append a result of `bytes` bytes (none when p is null or bytes is not positive).
inline void add(Outputs& o, void* p, int64_t bytes) {
  if (p == nullptr || bytes <= 0 || o.n >= kMaxOutputs) return;
  o.ptr[o.n] = p;
  o.bytes[o.n] = bytes;
  ++o.n;
}

}  // namespace jax_ep::poison
