// The combine's 24-bit partial sums: a float column as its upper 16 bits (a bf16 row) and the
// next 8 bits (a second row of bytes), see combine.cu ("Combine").
#pragma once
#include "kernels/low_latency/common.cuh"

namespace jax_ep {
namespace ll {
namespace {

template <typename V>
struct LoOf;  // the low bytes (1 per column) of a vector V of bf16 columns
template <>
struct LoOf<uint4> {
  using T = uint2;
};
template <>
struct LoOf<uint2> {
  using T = unsigned int;
};
template <>
struct LoOf<unsigned int> {
  using T = unsigned short;
};
template <>
struct LoOf<unsigned short> {
  using T = unsigned char;
};

// float -> its bits rounded to the upper 24 (half away from zero; a NaN stays a NaN).
__device__ __forceinline__ unsigned int round24(float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return (u >> 8) | ((u & 0x7fffffu) != 0 ? 1u : 0u);
  return (u + 0x80u) >> 8;
}

// The low bytes as one integer (byte e: column e), and in / out of a vector register V (the
// receive keeps a partial's low bytes in the slot of its row batch).
__device__ __forceinline__ unsigned long long lo_bits(const uint2& l) {
  return l.x | (static_cast<unsigned long long>(l.y) << 32);
}
__device__ __forceinline__ unsigned long long lo_bits(unsigned int l) { return l; }
__device__ __forceinline__ unsigned long long lo_bits(unsigned short l) { return l; }
__device__ __forceinline__ unsigned long long lo_bits(unsigned char l) { return l; }
__device__ __forceinline__ void lo_make(unsigned long long b, uint2& l) {
  l = make_uint2(static_cast<unsigned int>(b), static_cast<unsigned int>(b >> 32));
}
__device__ __forceinline__ void lo_make(unsigned long long b, unsigned int& l) {
  l = static_cast<unsigned int>(b);
}
__device__ __forceinline__ void lo_make(unsigned long long b, unsigned short& l) {
  l = static_cast<unsigned short>(b);
}
__device__ __forceinline__ void lo_make(unsigned long long b, unsigned char& l) {
  l = static_cast<unsigned char>(b);
}
__device__ __forceinline__ void lo_park(unsigned long long b, uint4& v) {
  v.x = static_cast<unsigned int>(b);
  v.y = static_cast<unsigned int>(b >> 32);
}
__device__ __forceinline__ void lo_park(unsigned long long b, uint2& v) {
  v.x = static_cast<unsigned int>(b);
}
__device__ __forceinline__ void lo_park(unsigned long long b, unsigned int& v) {
  v = static_cast<unsigned int>(b);
}
__device__ __forceinline__ void lo_park(unsigned long long b, unsigned short& v) {
  v = static_cast<unsigned short>(b);
}
__device__ __forceinline__ unsigned long long lo_parked(const uint4& v) {
  return v.x | (static_cast<unsigned long long>(v.y) << 32);
}
__device__ __forceinline__ unsigned long long lo_parked(const uint2& v) { return v.x; }
__device__ __forceinline__ unsigned long long lo_parked(unsigned int v) { return v & 0xffffu; }
__device__ __forceinline__ unsigned long long lo_parked(unsigned short v) { return v & 0xffu; }

// Columns f (float) -> their 24-bit values: the upper 16 bits as a bf16 vector, the next 8 bits.
template <typename V>
__device__ __forceinline__ void split24(const float (&f)[sizeof(V) / 2], V& hi,
                                        typename LoOf<V>::T& lo) {
  constexpr int EPV = sizeof(V) / 2;
  float h[EPV];
  unsigned long long b = 0;
#pragma unroll
  for (int e = 0; e < EPV; ++e) {
    const unsigned int r = round24(f[e]);
    h[e] = __uint_as_float((r >> 8) << 16);  // a bf16 value: pack() keeps its bits
    b |= static_cast<unsigned long long>(r & 0xffu) << (8 * e);
  }
  pack(h, &hi);
  lo_make(b, lo);
}

// The inverse: hi (a bf16 vector) and the low bytes b -> the columns' float values.
template <typename V>
__device__ __forceinline__ void join24(const V& hi, unsigned long long b,
                                       float (&f)[sizeof(V) / 2]) {
  constexpr int EPV = sizeof(V) / 2;
  unpack(hi, f);
#pragma unroll
  for (int e = 0; e < EPV; ++e)
    f[e] = __uint_as_float(__float_as_uint(f[e]) |
                           (static_cast<unsigned int>((b >> (8 * e)) & 0xffu) << 8));
}

}  // namespace
}  // namespace ll
}  // namespace jax_ep
