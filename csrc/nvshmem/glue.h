// NVSHMEM for the per-process mode. The host library is the one already loaded in the process
// (nvshmem4py loads libnvshmem_host.so.3): we resolve the few host functions we call from it at
// run time, so the extension imports, and the one-process mode works, without NVSHMEM installed.
// Our kernels link NVIDIA's static device library; its device state (nvshmemi_device_state_d, a
// copy per CUDA module) is registered with the host library by open() (see glue.cu).
// Only compiled in builds with NVSHMEM (CMakeLists.txt).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace jax_ep {
namespace nvshmem {

struct HostApi {
  void* (*align)(size_t alignment, size_t bytes);  // nvshmem_align (collective)
  void* (*ptr)(const void* sym, int pe);           // nvshmem_ptr: load/store address or null
  int (*my_pe)();
  int (*n_pes)();
  void (*barrier_all)();  // host barrier, collective
};

// The host API of the loaded NVSHMEM, with this module's device state registered. Throws
// std::runtime_error when NVSHMEM is not loaded or not initialised, naming what to do.
const HostApi& open();
// One thread of a kernel on the current device: out = {nvshmem_my_pe(), nvshmem_n_pes(),
// nvshmem_ptr(cell, next PE) != null}, and nvshmem_int_p(cell, 1000 + my_pe, next PE); then
// nvshmem_quiet. `cell` is a symmetric int; out is device memory for 3 ints. Synchronous.
void launch_self_test(int* cell, int* out);
// Enqueues on `stream` one thread of a kernel on the current device that copies `bytes` from the
// symmetric `src` of PE `pe` into the symmetric `dst` of this PE (nvshmem_getmem; complete when
// the kernel is). For reading a peer that loads and stores do not reach; asynchronous.
cudaError_t launch_get(void* dst, const void* src, size_t bytes, int pe, cudaStream_t stream);

}  // namespace nvshmem
}  // namespace jax_ep
