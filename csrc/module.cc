// The nanobind module jax_ep._C: FFI handler capsules and the one-process runtime.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include <cuda_runtime.h>

#include "ffi/handlers.h"
#include "runtime/workspace.h"

namespace nb = nanobind;

template <typename T>
static nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_C, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_ep_layout"] = encapsulate(JaxEpLayout);
    d["jax_ep_ht_dispatch"] = encapsulate(JaxEpHtDispatch);
    d["jax_ep_ht_gather"] = encapsulate(JaxEpHtGather);
    d["jax_ep_ht_combine"] = encapsulate(JaxEpHtCombine);
    d["jax_ep_ll_dispatch"] = encapsulate(JaxEpLlDispatch);
    d["jax_ep_ll_combine"] = encapsulate(JaxEpLlCombine);
    d["jax_ep_ll_dispatch_send"] = encapsulate(JaxEpLlDispatchSend);
    d["jax_ep_ll_dispatch_recv"] = encapsulate(JaxEpLlDispatchRecv);
    d["jax_ep_ll_combine_send"] = encapsulate(JaxEpLlCombineSend);
    d["jax_ep_ll_combine_recv"] = encapsulate(JaxEpLlCombineRecv);
    return d;
  });
  m.def("init_group", &jax_ep::init_group, nb::arg("devices"),
        "Allocate the workspaces of one EP group (CUDA ordinals in axis order) and enable peer "
        "access between its devices.");
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
      "reserve_slot_buffer",
      [](nb::list group, int slot, size_t bytes) {
        std::vector<int> g;
        for (nb::handle h : group) g.push_back(nb::cast<int>(h));
        if (slot < jax_ep::kFirstPushSlot || slot >= jax_ep::kNumSlots)
          throw std::invalid_argument("jax_ep: not a push slot");
        nb::list out;
        for (unsigned long long p : jax_ep::reserve_slot_buffer(g, slot, bytes)) out.append(p);
        return out;
      },
      nb::arg("group"), nb::arg("slot"), nb::arg("bytes"),
      "Receive buffer (>= bytes) of a push slot on every device of the group: device addresses "
      "in group order.");
  m.def("slot_buffer_bytes", &jax_ep::slot_buffer_bytes, nb::arg("device"));
  m.def("workspace_bytes", []() { return sizeof(jax_ep::Workspace); });
  m.def("cuda_device_count", []() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  });
  m.attr("max_ranks") = jax_ep::kMaxRanks;
  m.attr("num_slots") = jax_ep::kNumSlots;
  m.attr("first_push_slot") = jax_ep::kFirstPushSlot;
  m.attr("max_local_experts") = jax_ep::kMaxLocalExperts;
  m.attr("trace_slots") = jax_ep::kTraceSlots;
}
