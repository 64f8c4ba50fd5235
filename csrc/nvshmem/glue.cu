// NVSHMEM glue for the per-process mode (see glue.h): the host functions we call, resolved
// from the libnvshmem_host.so.3 already loaded in the process, and the registration of this
// module's device state. NVIDIA's static device library (linked into this module, which is
// built with relocatable device code) calls three host-library entry points to register its
// state; we define them here as forwarders to the loaded library, hidden inside this module.
#include <dlfcn.h>

#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include <nvshmem.h>
#include <nvshmemx.h>
#include "nvshmem/glue.h"

namespace {

struct Loaded {
  void* lib = nullptr;
  int (*hostlib_init_attr)(int, int*, unsigned int, nvshmemx_init_attr_t*, nvshmemi_version_t,
                           nvshmemx_device_lib_init_cb) = nullptr;
  void (*hostlib_finalize)(void*, void*) = nullptr;
  int (*init_status)() = nullptr;
  jax_ep::nvshmem::HostApi api{};
};
Loaded g;
std::mutex g_mu;
bool g_open = false;

template <typename F>
void resolve(F* fn, const char* name) {
  *fn = reinterpret_cast<F>(dlsym(g.lib, name));
  if (*fn == nullptr)
    throw std::runtime_error(std::string("jax_ep: the loaded NVSHMEM host library has no ") + name +
                             " (NVSHMEM 3.x expected)");
}

__global__ void self_test_kernel(int* cell, int* out) {
  const int me = nvshmem_my_pe();
  const int n = nvshmem_n_pes();
  const int next = (me + 1) % n;
  out[0] = me;
  out[1] = n;
  out[2] = nvshmem_ptr(cell, next) != nullptr ? 1 : 0;
  nvshmem_int_p(cell, 1000 + me, next);
  nvshmem_quiet();
}

__global__ void get_kernel(void* dst, const void* src, size_t bytes, int pe) {
  nvshmem_getmem(dst, src, bytes, pe);
}

}  // namespace

// The device library's host-side entry points (see the file comment): hidden forwarders.
extern "C" {
__attribute__((visibility("hidden"))) int nvshmemid_hostlib_init_attr(
    int requested, int* provided, unsigned int flags, nvshmemx_init_attr_t* attr,
    nvshmemi_version_t version, nvshmemx_device_lib_init_cb cb) {
  if (g.hostlib_init_attr == nullptr) return 1;
  return g.hostlib_init_attr(requested, provided, flags, attr, version, cb);
}
__attribute__((visibility("hidden"))) void nvshmemid_hostlib_finalize(void* dev, void* tr) {
  if (g.hostlib_finalize != nullptr) g.hostlib_finalize(dev, tr);
}
__attribute__((visibility("hidden"))) int nvshmemid_init_status() {
  return g.init_status == nullptr ? NVSHMEM_STATUS_NOT_INITIALIZED : g.init_status();
}
}

namespace jax_ep {
namespace nvshmem {

const HostApi& open() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_open) return g.api;
  g.lib = dlopen("libnvshmem_host.so.3", RTLD_NOW | RTLD_NOLOAD);
  if (g.lib == nullptr)
    throw std::runtime_error(
        "jax_ep: NVSHMEM is not loaded in this process. jax_ep.initialize() initialises it "
        "through nvshmem4py (pip install nvshmem4py-cu13, or -cu12) before the first op.");
  resolve(&g.hostlib_init_attr, "nvshmemid_hostlib_init_attr");
  resolve(&g.hostlib_finalize, "nvshmemid_hostlib_finalize");
  resolve(&g.init_status, "nvshmemid_init_status");
  resolve(&g.api.align, "nvshmem_align");
  resolve(&g.api.ptr, "nvshmem_ptr");
  resolve(&g.api.my_pe, "nvshmem_my_pe");
  resolve(&g.api.n_pes, "nvshmem_n_pes");
  resolve(&g.api.barrier_all, "nvshmem_barrier_all");
  if (g.init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    throw std::runtime_error(
        "jax_ep: NVSHMEM is loaded but not initialised (nvshmem.core.init has not run)");
  // Registers this module's nvshmemi_device_state_d with the running host library, which copies
  // its state (heap bases, PEs, transports) into it: what our kernels' NVSHMEM calls read.
  int provided = 0;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  if (nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, version) != 0)
    throw std::runtime_error(
        "jax_ep: registering the extension's NVSHMEM device state failed (is the NVSHMEM the "
        "extension was built with, " +
        std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
        std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + ", compatible with the loaded one?)");
  g_open = true;
  return g.api;
}

void launch_self_test(int* cell, int* out) {
  self_test_kernel<<<1, 1>>>(cell, out);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep: NVSHMEM self-test kernel failed: ") +
                             cudaGetErrorString(e));
}

cudaError_t launch_get(void* dst, const void* src, size_t bytes, int pe, cudaStream_t stream) {
  get_kernel<<<1, 1, 0, stream>>>(dst, src, bytes, pe);
  return cudaGetLastError();
}

}  // namespace nvshmem
}  // namespace jax_ep
