// Receive-buffer sizes of the low-latency ops that Python asks for at lowering (plain C++: the
// nanobind module includes it too). Defined in low_latency/geometry.cu.
#pragma once
#include <cstdint>

namespace jax_ep::ll {

// Bytes of a dispatch slot's receive buffer: [parity][source] areas of M rows and L counts.
int64_t dispatch_buffer_bytes(int64_t R, int64_t M, int64_t K, int64_t H, int64_t L, bool use_fp8);
// Bytes of a combine slot's receive buffer: rows, their tags, the weights and weight flags.
int64_t combine_buffer_bytes(int64_t R, int64_t M, int64_t K, int64_t H);

}  // namespace jax_ep::ll
