// The per-executable state of every communication call site: its lease (runtime/lease.h),
// taken in the FFI instantiate stage from the attributes the lowering adds (`site`, `groups`,
// `group_size`, and the data-buffer size: `buffer_bytes` of the push ops, `stage_bytes` of the
// pull ops), and released when XLA destroys the executable. The execute stage reads the slot
// and the buffer table from it (docs/ffi.md, "Call-site state").
#pragma once
#include <memory>

#include "runtime/lease.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

struct SiteState {
  static xla::ffi::TypeId id;  // registered with XLA by name (module.cc, jax_ep/_ffi.py)
  std::shared_ptr<const Lease> lease;
};

// The XLA type information of SiteState (its deleter), for the registration.
const XLA_FFI_TypeInfo* site_state_type_info();

}  // namespace jax_ep

// The instantiate stage shared by every communication handler and its one-GPU multi-rank twin.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpSiteInstantiate);
