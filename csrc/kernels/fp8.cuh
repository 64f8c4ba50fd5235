// Per-128-column-group FP8 (e4m3fn) quantisation, exactly as docs/ffi.md defines it, so the
// result is bit-identical to jax_ep/reference.py:quantize_fp8 (float32 operations only):
//   amax  = max(max_i |x_i|, 1e-4)
//   round_scale: scale = 2^ceil(log2(amax * (1/448))) on the bits of amax * (1/448) (exponent + 1
//   when
//                the mantissa is non-zero, mantissa 0);  q_i = e4m3(x_i * (1 / scale))
//   otherwise:   scale = amax * (1/448);                   q_i = e4m3(x_i * (448 / amax))
// e4m3 = round to nearest even, saturating to +-448 (the reference clips to +-448 first, which
// gives the same byte for every finite input).
// A group holding a NaN or an infinity: scale = NaN (0x7fc00000) and every byte 0x7f (NaN), so
// the whole group dequantises to NaN; a non-finite value never becomes a finite number.
// Every operation uses the explicit IEEE round-to-nearest intrinsics (__fdiv_rn, __fmul_rn,
// __frcp_rn) so the result does not depend on -use_fast_math / -prec-div / FMA contraction.
#pragma once
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/warp.h"

namespace jax_ep {
namespace fp8 {

constexpr int kGroup = 128;     // columns per scale
constexpr float kMax = 448.0f;  // largest finite e4m3fn
// scale = amax * float32(1/448) (not amax / 448): the form XLA computes for the reference too.
constexpr float kInvMax = 1.0f / 448.0f;
constexpr float kAmaxMin = 1e-4f;  // amax floor (float32 of 1e-4, as jnp.maximum(amax, 1e-4))
constexpr uint32_t kNanScaleBits = 0x7fc00000u;  // the scale of a non-finite group
constexpr uint32_t kNanBytes = 0x7f7f7f7fu;      // four e4m3fn NaN bytes

// max that keeps a NaN (fmaxf drops it): a NaN anywhere in the group reaches the scale.
__device__ __forceinline__ float max_keep_nan(float a, float b) {
  return (isnan(a) || a >= b) ? a : b;
}

// 2^ceil(log2(s)) for a positive normal float, on the bits (exact).
__device__ __forceinline__ float round_up_pow2(float s) {
  uint32_t b = __float_as_uint(s);
  if (b & 0x007fffffu) b = (b & 0xff800000u) + 0x00800000u;
  return __uint_as_float(b);
}

// From the group's max |x| (before the 1e-4 floor): the stored scale and the multiplier.
__device__ __forceinline__ void group_scale(float amax, bool round_scale, float* scale,
                                            float* inv) {
  if (!isfinite(amax)) {  // NaN or inf in the group
    *scale = *inv = __uint_as_float(kNanScaleBits);
    return;
  }
  amax = fmaxf(amax, kAmaxMin);
  if (round_scale) {
    const float s = round_up_pow2(__fmul_rn(amax, kInvMax));
    *scale = s;
    *inv = __frcp_rn(s);  // == 1.0f / s (exact for a power of two)
  } else {
    *scale = __fmul_rn(amax, kInvMax);
    *inv = __fdiv_rn(kMax, amax);
  }
}

// Two values -> two e4m3 bytes (first value in the low byte).
__device__ __forceinline__ uint32_t quantize2(float a, float b, float inv) {
  const float2 v = make_float2(__fmul_rn(a, inv), __fmul_rn(b, inv));
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3));
}

// Eight values -> eight e4m3 bytes in memory order.
__device__ __forceinline__ uint2 quantize8(const float (&v)[8], float inv) {
  uint2 q;
  q.x = quantize2(v[0], v[1], inv) | (quantize2(v[2], v[3], inv) << 16);
  q.y = quantize2(v[4], v[5], inv) | (quantize2(v[6], v[7], inv) << 16);
  return q;
}

// Eight bf16 (16 bytes, memory order) -> float (exact).
__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&v)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ float abs_max8(const float (&v)[8]) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max_keep_nan(m, fabsf(v[i]));
  return m;
}

// One 128-column group quantised by 8 lanes: each holds 16 consecutive bf16 (raw[0..1], lane
// `sub` of the eight = columns sub*16 .. sub*16+15), so a warp stores 512 contiguous e4m3 bytes
// per instruction (half as many stores as 8 columns per lane: the remote stores are the cost).
// The group amax is reduced over the eight lanes with shuffles, so all 32 lanes of the warp
// must call this; only lanes with `active` store their 16 e4m3 bytes to `q`. Returns the scale
// (every lane of the eight); the caller stores it.
__device__ __forceinline__ float quantise_group_slice(const uint4 (&raw)[2], bool round_scale,
                                                      bool active, int sub, uint4* q) {
  float v[8], w[8];
  bf16x8_to_float(raw[0], v);
  bf16x8_to_float(raw[1], w);
  float amax = max_keep_nan(abs_max8(v), abs_max8(w));
#pragma unroll
  for (int o = 4; o >= 1; o >>= 1) amax = max_keep_nan(amax, __shfl_xor_sync(kFull, amax, o));
  float scale, inv;
  group_scale(amax, round_scale, &scale, &inv);
  if (active) {
    if (isnan(scale)) {
      *q = make_uint4(kNanBytes, kNanBytes, kNanBytes, kNanBytes);
    } else {
      const uint2 a = quantize8(v, inv), b = quantize8(w, inv);
      *q = make_uint4(a.x, a.y, b.x, b.y);
    }
  }
  return scale;
}

}  // namespace fp8
}  // namespace jax_ep
