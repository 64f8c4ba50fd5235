// The nanobind module jax_ep._C, in three files: module.cc (the FFI targets: handler capsules,
// the call-site state type, and the sizes, limits and codes the Python side builds calls
// with), module_runtime.cc (the one-process and per-process runtimes: groups, leases, faults,
// traces) and module_testing.cc (test and debug hooks). Each binds its names into m.
#pragma once
#include <nanobind/nanobind.h>

namespace jax_ep {

void bind_runtime(nanobind::module_& m);  // module_runtime.cc
void bind_testing(nanobind::module_& m);  // module_testing.cc

}  // namespace jax_ep
