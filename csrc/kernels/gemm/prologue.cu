// The small kernels around a grouped GEMM that need no CUTLASS: the FP8 row-scale transpose and
// the zero fill of the output rows no group covers.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/gemm/workspace.h"

namespace jax_ep::gemm {
namespace {

constexpr int kThreads = 256;

// FP8: each group's row scales, [rows, K/128] row-major as the dispatch writes them, into the
// K-block-major layout that CUTLASS's SM90 blockwise mainloop reads ([K/128, rows] per group,
// at the same offset).
__global__ void __launch_bounds__(kThreads)
    transpose_scales_kernel(const float* __restrict__ src, Carved w, int KB) {
  const long long g = blockIdx.y;
  const long long base = w.start[g] * KB;
  const long long rows = w.rows[g];
  const long long n = rows * KB;
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    const long long r = i / KB, kb = i - r * KB;
    w.sfa_t[base + kb * rows + r] = src[base + i];
  }
}

// Zeros, in 16-byte stores, of [begin, end) bytes of each segment y: contiguous, the rows past
// the last group; masked, the rows past each group's count; transposed, the [K, N] block of each
// group without rows.
__global__ void __launch_bounds__(kThreads)
    zero_fill_kernel(char* out, Carved w, Mode mode, long long M, long long row_bytes,
                     long long group_bytes, long long G) {
  const long long y = blockIdx.y;
  long long b0 = 0, b1 = 0;
  if (mode == Mode::kContiguous) {
    b0 = w.start[G] * row_bytes;
    b1 = M * row_bytes;
  } else if (mode == Mode::kMasked) {
    b0 = (y * M + w.rows[y]) * row_bytes;
    b1 = (y + 1) * M * row_bytes;
  } else if (w.rows[y] == 0) {
    b0 = y * group_bytes;
    b1 = b0 + group_bytes;
  }
  uint4* p = reinterpret_cast<uint4*>(out);
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (long long i = b0 / 16 + blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x;
       i < b1 / 16; i += static_cast<long long>(gridDim.x) * kThreads)
    p[i] = z;
}

}  // namespace

std::string launch_prologue(const Call& c, const Carved& w, cudaStream_t stream) {
  const GemmShape& s = c.s;
  const int sms = std::max(c.sm_count, 1);
  if (s.dtype == Dtype::kFP8) {
    const int gx = static_cast<int>(std::max<long long>(1, std::min<long long>(64, 4 * sms / s.G)));
    transpose_scales_kernel<<<dim3(gx, static_cast<unsigned>(s.G)), kThreads, 0, stream>>>(
        c.lhs_scales, w, static_cast<int>(s.K / kFp8Block));
  }
  const long long row_bytes = s.N * kOutBytes;
  const long long group_bytes = s.K * s.N * kOutBytes;
  if ((s.mode == Mode::kMasked && !s.zero_padding) || s.accumulate) return {};
  const long long ny = s.mode == Mode::kContiguous ? 1 : s.G;
  const int gx = static_cast<int>(std::max<long long>(1, std::min<long long>(1024, 4 * sms / ny)));
  zero_fill_kernel<<<dim3(gx, static_cast<unsigned>(ny)), kThreads, 0, stream>>>(
      static_cast<char*>(c.out), w, s.mode, s.M, row_bytes, group_bytes, s.G);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string()
                          : std::string("prologue launch: ") + cudaGetErrorString(e);
}

}  // namespace jax_ep::gemm
