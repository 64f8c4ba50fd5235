// Buffer sizes of the high-throughput ops that Python asks for (plain C++: the nanobind module
// includes it too).
#pragma once
#include <cstdint>

namespace jax_ep::ht {

// int32 words of the dispatch's scratch result for R ranks and T tokens (the layout kernel's
// per-chunk counts and offsets): the one definition, exported as jax_ep._C.ht_scratch_words.
inline int64_t ht_scratch_words(int64_t R, int64_t T) { return R * T + R * R + 64; }

}  // namespace jax_ep::ht
