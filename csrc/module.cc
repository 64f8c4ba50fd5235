// The nanobind module jax_ep._C (module.h): the FFI targets. Handler capsules, the call-site
// state type, and the sizes, limits and codes the Python side builds their calls with. The
// runtime's bindings are in module_runtime.cc, the test hooks in module_testing.cc.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ffi/handlers.h"
#include "ffi/site_state.h"
#include "kernels/fused/sizes.h"
#include "kernels/gemm/grouped_gemm.h"
#include "kernels/ht_sizes.h"
#include "kernels/ll_sizes.h"
#include "module.h"
#include "runtime/device.h"
#include "runtime/workspace.h"
#include "transport/poison.h"

namespace nb = nanobind;

// A grouped-GEMM shape from the size queries' arguments (codes: _C.gemm_modes, gemm_dtypes).
static jax_ep::gemm::GemmShape gemm_shape(int mode, int dtype, bool rhs_kn, int64_t G, int64_t M,
                                          int64_t K, int64_t N) {
  jax_ep::gemm::GemmShape s;
  s.mode = static_cast<jax_ep::gemm::Mode>(mode);
  s.dtype = static_cast<jax_ep::gemm::Dtype>(dtype);
  s.rhs_kn = rhs_kn;
  s.G = G;
  s.M = M;
  s.K = K;
  s.N = N;
  return s;
}

template <typename T>
static nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_C, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_ep_layout"] = encapsulate(JaxEpLayout);
    d["jax_ep_expert_positions"] = encapsulate(JaxEpExpertPositions);
    d["jax_ep_grouped_gemm"] = encapsulate(JaxEpGroupedGemm);
    d["jax_ep_unwritten"] = encapsulate(JaxEpUnwritten);
    // Each communication handler and its one-GPU multi-rank twin, target name + "_vr"
    // (ffi/virtual_ranks.h): stateful, the call site's lease taken in the instantiate stage
    // (ffi/site_state.h).
    auto with_vr = [&d](const std::string& name, auto* fn, auto* vr) {
      for (auto [n, f] : {std::pair<std::string, nb::capsule>{name, encapsulate(fn)},
                          {name + "_vr", encapsulate(vr)}}) {
        nb::dict stages;
        stages["instantiate"] = encapsulate(JaxEpSiteInstantiate);
        stages["execute"] = f;
        d[n.c_str()] = stages;
      }
    };
    with_vr("jax_ep_ht_dispatch", JaxEpHtDispatch, JaxEpHtDispatchVr);
    with_vr("jax_ep_ht_gather", JaxEpHtGather, JaxEpHtGatherVr);
    with_vr("jax_ep_ht_combine", JaxEpHtCombine, JaxEpHtCombineVr);
    with_vr("jax_ep_ht_gather_gemm", JaxEpHtGatherGemm, JaxEpHtGatherGemmVr);
    with_vr("jax_ep_ht_gemm_combine", JaxEpHtGemmCombine, JaxEpHtGemmCombineVr);
    with_vr("jax_ep_ll_dispatch", JaxEpLlDispatch, JaxEpLlDispatchVr);
    with_vr("jax_ep_ll_combine", JaxEpLlCombine, JaxEpLlCombineVr);
    with_vr("jax_ep_ll_dispatch_send", JaxEpLlDispatchSend, JaxEpLlDispatchSendVr);
    with_vr("jax_ep_ll_dispatch_recv", JaxEpLlDispatchRecv, JaxEpLlDispatchRecvVr);
    with_vr("jax_ep_ll_combine_send", JaxEpLlCombineSend, JaxEpLlCombineSendVr);
    with_vr("jax_ep_ll_combine_recv", JaxEpLlCombineRecv, JaxEpLlCombineRecvVr);
    return d;
  });
  m.def(
      "site_state_type",
      []() {
        nb::dict t;  // what jax.ffi.register_ffi_type takes
        t["type_id"] = nb::capsule(reinterpret_cast<void*>(&jax_ep::SiteState::id));
        t["type_info"] = nb::capsule(
            reinterpret_cast<void*>(const_cast<XLA_FFI_TypeInfo*>(jax_ep::site_state_type_info())));
        return t;
      },
      "Type id and type info of the call-site state (ffi/site_state.h), for "
      "jax.ffi.register_ffi_type under the name site_state_type_name.");
  m.attr("site_state_type_name") = "jax_ep.site_state";
  m.def("workspace_bytes", []() { return sizeof(jax_ep::Workspace); });
  m.def("ll_dispatch_buffer_bytes", &jax_ep::ll::dispatch_buffer_bytes, nb::arg("R"), nb::arg("M"),
        nb::arg("K"), nb::arg("H"), nb::arg("L"), nb::arg("use_fp8"),
        "Bytes of a low-latency dispatch slot's receive buffer (kernels/low_latency/geometry.cu).");
  m.def("ll_combine_buffer_bytes", &jax_ep::ll::combine_buffer_bytes, nb::arg("R"), nb::arg("M"),
        nb::arg("K"), nb::arg("H"),
        "Bytes of a low-latency combine slot's receive buffer (kernels/low_latency/geometry.cu).");
  m.def(
      "ht_stage_bytes",
      [](const std::vector<int64_t>& operand_bytes) {
        return jax_ep::ht::stage_bytes(operand_bytes);
      },
      nb::arg("operand_bytes"),
      "Per-process mode: bytes of the staging buffer for operands of these sizes.");
  {
    nb::dict staged;  // target -> how many leading operands its handler stages
    staged["jax_ep_ht_dispatch"] = jax_ep::ht::kStagedDispatch;
    staged["jax_ep_ht_gather"] = jax_ep::ht::kStagedGather;
    staged["jax_ep_ht_combine"] = jax_ep::ht::kStagedCombine;
    staged["jax_ep_ht_gather_gemm"] = jax_ep::ht::kStagedGatherGemm;
    staged["jax_ep_ht_gemm_combine"] = jax_ep::ht::kStagedGemmCombine;
    m.attr("ht_staged_operands") = staged;
  }
  m.def("ht_scratch_words", &jax_ep::ht::ht_scratch_words, nb::arg("R"), nb::arg("T"),
        "int32 words of jax_ep_ht_dispatch's scratch result (csrc/kernels/high_throughput.cuh).");
  m.attr("fused_block_rows") = jax_ep::fused::kBlockM;
  m.attr("fused_max_dups") = jax_ep::fused::kMaxDups;
  m.def("fused_counter_words", &jax_ep::fused::counter_words, nb::arg("C"),
        "int32 words of the fused gather + GEMM's counters result for C expert-major rows "
        "(csrc/kernels/fused/sizes.h).");
  m.def("fused_combine_counter_words", &jax_ep::fused::combine_counter_words, nb::arg("C"),
        nb::arg("Cr"), nb::arg("N"),
        "int32 words of the fused GEMM + combine's counters result for C expert-major rows, Cr "
        "received rows and N output columns (csrc/kernels/fused/sizes.h).");
  m.attr("fused_chunk_blocks") = jax_ep::fused::kChunkBlocks;
  m.def("fused_auto_combine_blocks", &jax_ep::fused::auto_combine_blocks, nb::arg("share"),
        nb::arg("ranks"), nb::arg("k"),
        "The fused GEMM + combine's automatic combine-only blocks out of `share` (one per SM) "
        "over `ranks` ranks, for a GEMM of inner dimension k (docs/kernels.md).");
  m.attr("fused_block_columns") = jax_ep::fused::kBlockN;
  m.attr("fused_raster_row_blocks") = jax_ep::fused::kRasterRowBlocks;
  m.def("gemm_built", &jax_ep::gemm::built,
        "True when the CUTLASS grouped-GEMM kernels are compiled in.");
  m.def(
      "grouped_gemm_workspace_bytes",
      [](int mode, int dtype, bool rhs_kn, bool small_m, int64_t G, int64_t M, int64_t K, int64_t N,
         int device, bool accumulate) {
        jax_ep::gemm::GemmShape s = gemm_shape(mode, dtype, rhs_kn, G, M, K, N);
        s.small_m = small_m;
        s.accumulate = accumulate;
        if (auto why = jax_ep::gemm::unsupported(s); !why.empty())
          throw std::invalid_argument("jax_ep grouped GEMM: " + why);
        return jax_ep::gemm::workspace_bytes(s, jax_ep::sm_count(device));
      },
      nb::arg("mode"), nb::arg("dtype"), nb::arg("rhs_kn"), nb::arg("small_m"), nb::arg("G"),
      nb::arg("M"), nb::arg("K"), nb::arg("N"), nb::arg("device"), nb::arg("accumulate") = false,
      "Bytes of the workspace result of jax_ep_grouped_gemm (csrc/kernels/gemm/workspace.h). "
      "mode: 0 contiguous, 1 masked, 2 transposed (weight gradient); dtype: 0 bf16, 1 f16, "
      "2 FP8 e4m3. Raises ValueError naming the operand when no kernel serves the shapes.");
  m.def(
      "gemm_unsupported",
      [](int mode, int dtype, bool rhs_kn, int64_t G, int64_t M, int64_t K, int64_t N) {
        return jax_ep::gemm::unsupported(gemm_shape(mode, dtype, rhs_kn, G, M, K, N));
      },
      "Why no grouped-GEMM kernel serves these shapes ('' when one does).");
  m.attr("max_ranks") = jax_ep::kMaxRanks;
  m.attr("num_slots") = jax_ep::kNumSlots;
  m.attr("max_local_experts") = jax_ep::kMaxLocalExperts;
  m.attr("max_layout_ranks") = jax_ep::kMaxLayoutRanks;
  m.attr("max_position_experts") = jax_ep::kMaxPositionExperts;
  m.attr("position_slice_pairs") = jax_ep::kPositionSlicePairs;
  m.attr("max_num_blocks") = jax_ep::kMaxNumBlocks;
  // What every result of an op whose wait gave up holds (docs/API.md#timeouts): each byte, and
  // so each int32.
  m.attr("poison_byte") = jax_ep::poison::kByte;
  m.attr("poison_int") = jax_ep::poison::kInt;
  {
    using jax_ep::gemm::Dtype;
    using jax_ep::gemm::Mode;
    nb::dict modes, dtypes;
    modes["contiguous"] = static_cast<int>(Mode::kContiguous);
    modes["masked"] = static_cast<int>(Mode::kMasked);
    modes["transposed"] = static_cast<int>(Mode::kTransposed);
    dtypes["bfloat16"] = static_cast<int>(Dtype::kBF16);
    dtypes["float16"] = static_cast<int>(Dtype::kF16);
    dtypes["float8_e4m3fn"] = static_cast<int>(Dtype::kFP8);
    m.attr("gemm_modes") = modes;    // the `mode` attribute of jax_ep_grouped_gemm
    m.attr("gemm_dtypes") = dtypes;  // lhs dtype name -> the dtype argument of the size query
  }
  jax_ep::bind_runtime(m);
  jax_ep::bind_testing(m);
}
