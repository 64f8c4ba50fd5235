// jax_ep._C (module.h): the one-process runtime (groups, devices, leases, faults, the phase
// tracer) and the per-process (NVSHMEM) runtime.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "module.h"
#include "nvshmem/symmetric.h"
#include "runtime/device.h"
#include "runtime/fault.h"
#include "runtime/lease.h"
#include "runtime/mode.h"
#include "runtime/virtual_ranks.h"
#include "runtime/workspace.h"
#include "transport/trace_marks.h"

namespace nb = nanobind;

namespace jax_ep {

void bind_runtime(nb::module_& m) {
  // Blocking native calls release the GIL (nb::call_guard, or a scoped release): a running
  // step may be waiting on a host callback that needs it.
  using release_gil = nb::call_guard<nb::gil_scoped_release>;
  m.def(
      "init_groups",
      [](const std::vector<std::vector<int>>& table) { current_mode().init_groups(table); },
      nb::arg("table"), release_gil(),
      "The workspaces of these EP groups (each a row of group-table entries in axis order: "
      "CUDA ordinals, virtual ids or PEs), as the process mode makes them "
      "(csrc/runtime/mode.h); groups already set up are skipped.");
  m.def("virtual_id", &jax_ep::virtual_id, nb::arg("device"), nb::arg("rank"),
        "Group-table id of virtual rank `rank` on CUDA device `device` (the one-GPU "
        "multi-rank mode, csrc/runtime/virtual_ranks.h).");
  m.def("device_sm_count", &jax_ep::device_sm_count, nb::arg("device"),
        "Multiprocessor count of a CUDA device (0 when it cannot be read).");
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
  m.attr("trace_slots") = jax_ep::kTraceSlots;
  {
    nb::dict marks, diag;  // trace index -> what the kernels record there (trace_marks.h)
    for (const auto& n : jax_ep::trace::kMarkNames) marks[nb::int_(n.index)] = n.name;
    for (const auto& n : jax_ep::trace::kDiagNames) diag[nb::int_(n.index)] = n.name;
    m.attr("trace_marks") = marks;
    m.attr("diag_marks") = diag;
    namespace tr = jax_ep::trace;
    nb::dict fused;  // the fused GEMM + combine's own slot
    fused[nb::int_(tr::kFusedStart)] = "start (peers published)";
    for (int c = 0; c < tr::kFusedTracedChunks; ++c) {
      const std::string chunk = "chunk " + std::to_string(c);
      fused[nb::int_(tr::kFusedChunkStored + c)] = chunk + ": last tile stored";
      fused[nb::int_(tr::kFusedChunkReduced + c)] = chunk + ": last first-step task done";
      fused[nb::int_(tr::kFusedChunkCombined + c)] = chunk + ": last second-step task done";
    }
    fused[nb::int_(tr::kFusedTilesDone)] = "last tile block done with its tiles";
    fused[nb::int_(tr::kFusedEnd)] = "end barrier passed";
    m.attr("fused_trace_marks") = fused;
    m.attr("fused_traced_chunks") = tr::kFusedTracedChunks;
  }
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
  // Per-process mode (nvshmem/symmetric.h).
  m.def("nvshmem_built", &jax_ep::sym::built);
  m.def("sym_active", &jax_ep::sym::active);
  m.def("sym_my_pe", &jax_ep::sym::my_pe);
  m.def("sym_n_pes", &jax_ep::sym::n_pes);
  m.def("sym_attach", &jax_ep::attach_per_process, nb::arg("arena_bytes"), release_gil(),
        "Enter the per-process mode (csrc/runtime/mode.h): attach to the NVSHMEM runtime "
        "initialised in this process (collective): register the module's device state, "
        "allocate and zero the symmetric arena.");
  m.def("sym_self_test", &jax_ep::sym::self_test, release_gil(),
        "Collective: [device my_pe, device n_pes, token received, token expected, next PE "
        "mapped] from a kernel of this module calling NVSHMEM device functions.");
  m.def("sym_remote_pes", &jax_ep::sym::remote_pes,
        "PEs reached only through NVSHMEM operations (no load/store mapping)");
  m.def("sym_arena_bytes", &jax_ep::sym::arena_bytes);
  m.def("sym_arena_used", &jax_ep::sym::arena_used);
  m.def("cuda_set_device", [](int d) {
    cudaError_t e = cudaSetDevice(d);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("jax_ep: cudaSetDevice: ") + cudaGetErrorString(e));
    }
  });
}

}  // namespace jax_ep
