// The nanobind module jax_ep._C: FFI handler capsules, the one-process runtime and the
// per-process (NVSHMEM) runtime.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <csignal>
#include <execinfo.h>
#include <unistd.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "ffi/handlers.h"
#include "ffi/site_state.h"
#include "kernels/fused/sizes.h"
#include "kernels/fused/tile_order.h"
#include "kernels/gemm/grouped_gemm.h"
#include "kernels/ht_sizes.h"
#include "kernels/ll_sizes.h"
#include "runtime/device.h"
#include "runtime/fault.h"
#include "runtime/lease.h"
#include "nvshmem/symmetric.h"
#include "runtime/virtual_ranks.h"
#include "runtime/workspace.h"
#include "transport/trace_marks.h"

#ifndef JAX_EP_MUTATION
#define JAX_EP_MUTATION 0  // transport/peer.cuh
#endif

namespace nb = nanobind;

// JAX_EP_DEBUG: native backtrace on SIGSEGV (Python's faulthandler shows Python frames only).
static void segv_backtrace(int) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(139);
}

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
    d["jax_ep_grouped_gemm"] = encapsulate(JaxEpGroupedGemm);
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
  // Blocking native calls release the GIL (nb::call_guard, or a scoped release): a running
  // step may be waiting on a host callback that needs it.
  using release_gil = nb::call_guard<nb::gil_scoped_release>;
  m.def("init_group", &jax_ep::init_group, nb::arg("devices"), release_gil(),
        "Allocate the workspaces of one EP group (CUDA ordinals in axis order) and enable peer "
        "access between its devices.");
  m.def("virtual_id", &jax_ep::virtual_id, nb::arg("device"), nb::arg("rank"),
        "Group-table id of virtual rank `rank` on CUDA device `device` (the one-GPU "
        "multi-rank mode, csrc/runtime/virtual_ranks.h).");
  m.def("device_sm_count", &jax_ep::device_sm_count, nb::arg("device"),
        "Multiprocessor count of a CUDA device (0 when it cannot be read).");
  m.def(
      "planted_bug", []() { return JAX_EP_MUTATION; },
      "The planted bug this build carries for the mutation check (csrc/transport/peer.cuh); "
      "0 in every real build.");
  m.def("runtime_devices", []() {
    nb::list out;
    for (int d : jax_ep::runtime_devices()) out.append(d);
    return out;
  });
  m.def("runtime_num_groups", &jax_ep::runtime_num_groups);
  m.def(
      "read_traces",
      [](nb::list group, int device) {
        std::vector<int> g;
        for (nb::handle h : group) g.push_back(nb::cast<int>(h));
        const std::vector<unsigned long long> v = jax_ep::read_traces(g, device);
        nb::list out;
        for (unsigned long long x : v) out.append(x);
        return out;
      },
      nb::arg("group"), nb::arg("device"),
      "Diagnostic: num_slots * trace_slots phase timestamps (ns, slot-major) of the group's "
      "workspace on `device` (see csrc/transport/peer.cuh, phase tracer).");
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
  m.def(
      "lease_stats",
      []() {
        const jax_ep::LeaseStats s = jax_ep::lease_stats();
        nb::dict d;
        d["live"] = s.live;
        d["free_push_slots"] = s.free_push;
        d["free_pull_slots"] = s.free_pull;
        d["buffer_bytes"] = s.buffer_bytes;
        d["created"] = s.created;
        return d;
      },
      "Call-site leases (runtime/lease.h): live ones, free slots, bytes of live buffers, made "
      "since start.");
  m.def("lease_buffer_bytes", &jax_ep::lease_buffer_bytes, nb::arg("device"),
        "Bytes of live call-site buffers on one CUDA device.");
  m.def("flush_buffer_frees", &jax_ep::flush_buffer_frees, release_gil(),
        "Wait until the buffers of released call-site leases are freed.");
  m.def(
      "device_memory_used",
      [](int device) {
        int prev = 0;
        cudaGetDevice(&prev);
        size_t free_b = 0, total = 0;
        cudaError_t e = cudaSetDevice(device);
        if (e == cudaSuccess) e = cudaMemGetInfo(&free_b, &total);
        cudaSetDevice(prev);
        if (e != cudaSuccess) {
          cudaGetLastError();
          throw std::runtime_error(std::string("jax_ep: cudaMemGetInfo: ") + cudaGetErrorString(e));
        }
        return static_cast<int64_t>(total - free_b);
      },
      nb::arg("device"), "Bytes of device memory in use on a CUDA device (cudaMemGetInfo).");
  m.def(
      "fault_records",
      []() {
        nb::list out;
        for (const jax_ep::FaultRecord& r : jax_ep::fault::records()) {
          nb::dict d;
          d["rank"] = r.rank;
          d["peer"] = r.peer;
          d["num_ranks"] = r.num_ranks;
          d["epoch"] = r.epoch;
          d["seen"] = r.seen;
          d["timeout_ns"] = r.timeout_ns;
          d["phase"] = std::string(r.phase);
          out.append(d);
        }
        return out;
      },
      "Why waits of this process gave up (runtime/fault.h): one record per device whose wait "
      "timed out.");
  m.def("fault_message", &jax_ep::fault::message,
        "The error every communication op returns once a wait gave up; empty before.");
  m.def("set_absent_virtual_ranks", &jax_ep::set_absent_ranks, nb::arg("mask"),
        "Testing: virtual ranks (bit r) that do not run, as if their process had stopped.");
  // Per-process mode (nvshmem/symmetric.h).
  m.def("nvshmem_built", &jax_ep::sym::built);
  m.def("sym_active", &jax_ep::sym::active);
  m.def("sym_my_pe", &jax_ep::sym::my_pe);
  m.def("sym_n_pes", &jax_ep::sym::n_pes);
  m.def("sym_attach", &jax_ep::sym::attach, nb::arg("arena_bytes"), release_gil(),
        "Attach to the NVSHMEM runtime initialised in this process (collective): register the "
        "module's device state, allocate and zero the symmetric arena.");
  m.def("sym_self_test", &jax_ep::sym::self_test, release_gil(),
        "Collective: [device my_pe, device n_pes, token received, token expected, next PE "
        "mapped] from a kernel of this module calling NVSHMEM device functions.");
  m.def("sym_init_groups", &jax_ep::sym::init_groups, nb::arg("table"), release_gil());
  m.def("sym_remote_pes", &jax_ep::sym::remote_pes,
        "PEs reached only through NVSHMEM operations (no load/store mapping)");
  m.def("sym_arena_bytes", &jax_ep::sym::arena_bytes);
  m.def("sym_arena_used", &jax_ep::sym::arena_used);
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
        "int32 words of the fused kernels' counters result for C expert-major rows "
        "(csrc/kernels/fused/sizes.h).");
  m.attr("fused_raster_row_blocks") = jax_ep::fused::kRasterRowBlocks;
  m.def(
      "fused_tile_order",
      [](const std::vector<int>& block_start, int col_blocks, int group) {
        if (block_start.size() < 2)
          throw nb::value_error("fused_tile_order: block_start needs L + 1 >= 2 entries");
        for (size_t l = 0; l < block_start.size(); ++l)
          if (l == 0 ? block_start[0] != 0 : block_start[l] < block_start[l - 1])
            throw nb::value_error("fused_tile_order: block_start must start at 0 and not decrease");
        if (col_blocks < 1 || group < 1)
          throw nb::value_error("fused_tile_order: col_blocks and group must be positive");
        const int L = static_cast<int>(block_start.size()) - 1;
        // the kernels' int arithmetic: every tile id and group * col_blocks fit an int
        constexpr int64_t kMax = std::numeric_limits<int>::max();
        if (int64_t{block_start[L]} * col_blocks > kMax || int64_t{group} * col_blocks > kMax)
          throw nb::value_error(
              "fused_tile_order: block_start[-1] * col_blocks and group * col_blocks must fit "
              "an int32");
        std::vector<int> tiles(static_cast<size_t>(block_start[L]) * col_blocks);
        for (size_t q = 0; q < tiles.size(); ++q)
          tiles[q] = jax_ep::fused::tile_order(block_start.data(), L, col_blocks, group,
                                               static_cast<int>(q));
        return tiles;
      },
      nb::arg("block_start"), nb::arg("col_blocks"), nb::arg("group"),
      "The fused kernels' tile queue order: for each draw, row block * col_blocks + column "
      "block, given each segment's first row block and, last, the row blocks of all segments "
      "(csrc/kernels/fused/tile_order.h).");
  m.def("gemm_built", &jax_ep::gemm::built,
        "True when the CUTLASS grouped-GEMM kernels are compiled in.");
  m.def(
      "grouped_gemm_workspace_bytes",
      [](int mode, int dtype, bool rhs_kn, bool small_m, int64_t G, int64_t M, int64_t K, int64_t N,
         int device) {
        jax_ep::gemm::GemmShape s = gemm_shape(mode, dtype, rhs_kn, G, M, K, N);
        s.small_m = small_m;
        if (auto why = jax_ep::gemm::unsupported(s); !why.empty())
          throw std::invalid_argument("jax_ep grouped GEMM: " + why);
        return jax_ep::gemm::workspace_bytes(s, jax_ep::sm_count(device));
      },
      nb::arg("mode"), nb::arg("dtype"), nb::arg("rhs_kn"), nb::arg("small_m"), nb::arg("G"),
      nb::arg("M"), nb::arg("K"), nb::arg("N"), nb::arg("device"),
      "Bytes of the workspace result of jax_ep_grouped_gemm (csrc/kernels/gemm/workspace.h). "
      "mode: 0 contiguous, 1 masked, 2 transposed (weight gradient); dtype: 0 bf16, 1 f16, "
      "2 FP8 e4m3. Raises ValueError naming the operand when no kernel serves the shapes.");
  m.def(
      "gemm_unsupported",
      [](int mode, int dtype, bool rhs_kn, int64_t G, int64_t M, int64_t K, int64_t N) {
        return jax_ep::gemm::unsupported(gemm_shape(mode, dtype, rhs_kn, G, M, K, N));
      },
      "Why no grouped-GEMM kernel serves these shapes ('' when one does).");
  m.def("debug_segv_backtrace", []() { signal(SIGSEGV, segv_backtrace); });
  m.def("cuda_set_device", [](int d) {
    cudaError_t e = cudaSetDevice(d);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("jax_ep: cudaSetDevice: ") + cudaGetErrorString(e));
    }
  });
  m.attr("max_ranks") = jax_ep::kMaxRanks;
  m.attr("num_slots") = jax_ep::kNumSlots;
  m.attr("first_push_slot") = jax_ep::kFirstPushSlot;
  m.attr("max_local_experts") = jax_ep::kMaxLocalExperts;
  m.attr("max_layout_ranks") = jax_ep::kMaxLayoutRanks;
  m.attr("max_num_blocks") = jax_ep::kMaxNumBlocks;
  m.attr("trace_slots") = jax_ep::kTraceSlots;
  {
    nb::dict marks, diag;  // trace index -> what the kernels record there (trace_marks.h)
    for (const auto& n : jax_ep::trace::kMarkNames) marks[nb::int_(n.index)] = n.name;
    for (const auto& n : jax_ep::trace::kDiagNames) diag[nb::int_(n.index)] = n.name;
    m.attr("trace_marks") = marks;
    m.attr("diag_marks") = diag;
  }
  m.attr("fp8_block") = jax_ep::gemm::kFp8Block;
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
}
