// jax_ep._C (module.h): test and debug hooks. The planted bug of the build
// (testing/mutations.h), absent virtual ranks, the fused kernels' tile order for its tests, and
// a native backtrace on SIGSEGV.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <csignal>
#include <execinfo.h>
#include <unistd.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/fused/tile_order.h"
#include "module.h"
#include "runtime/virtual_ranks.h"
#include "testing/mutations.h"

namespace nb = nanobind;

namespace jax_ep {

// JAX_EP_DEBUG: native backtrace on SIGSEGV (Python's faulthandler shows Python frames only).
static void segv_backtrace(int) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(139);
}

void bind_testing(nb::module_& m) {
  m.def(
      "planted_bug", []() { return jax_ep::mutation::kPlanted; },
      "The planted bug this build carries for the mutation check (csrc/testing/mutations.h); "
      "0 in every real build.");
  m.def("set_absent_virtual_ranks", &jax_ep::set_absent_ranks, nb::arg("mask"),
        "Testing: virtual ranks (bit r) that do not run, as if their process had stopped.");
  m.def(
      "fused_tile_order",
      [](const std::vector<int>& block_start, int col_blocks, int group, int chunk_blocks) {
        if (block_start.size() < 2)
          throw nb::value_error("fused_tile_order: block_start needs L + 1 >= 2 entries");
        for (size_t l = 0; l < block_start.size(); ++l)
          if (l == 0 ? block_start[0] != 0 : block_start[l] < block_start[l - 1])
            throw nb::value_error("fused_tile_order: block_start must start at 0 and not decrease");
        if (col_blocks < 1 || group < 1 || chunk_blocks < 0)
          throw nb::value_error(
              "fused_tile_order: col_blocks and group must be positive, chunk_blocks not "
              "negative");
        const int L = static_cast<int>(block_start.size()) - 1;
        // the kernels' int arithmetic: every tile id and group * col_blocks fit an int
        constexpr int64_t kMax = std::numeric_limits<int>::max();
        if (int64_t{block_start[L]} * col_blocks > kMax || int64_t{group} * col_blocks > kMax)
          throw nb::value_error(
              "fused_tile_order: block_start[-1] * col_blocks and group * col_blocks must fit "
              "an int32");
        std::vector<int> tiles(static_cast<size_t>(block_start[L]) * col_blocks);
        for (size_t q = 0; q < tiles.size(); ++q)
          tiles[q] = jax_ep::fused::chunked_tile_order(block_start.data(), L, col_blocks,
                                                       chunk_blocks > 0 ? chunk_blocks : col_blocks,
                                                       group, static_cast<int>(q));
        return tiles;
      },
      nb::arg("block_start"), nb::arg("col_blocks"), nb::arg("group"), nb::arg("chunk_blocks") = 0,
      "The fused kernels' tile queue order: for each draw, row block * col_blocks + column "
      "block, given each segment's first row block and, last, the row blocks of all segments; "
      "chunk_blocks > 0: in chunks of that many column blocks (csrc/kernels/fused/tile_order.h).");
  m.def("debug_segv_backtrace", []() { signal(SIGSEGV, segv_backtrace); });
}

}  // namespace jax_ep
