// jax_ep_unwritten: a result that nothing writes (its contents undefined), the first value of a
// while loop's carry that is read only once the loop wrote it: the layer's sum of its extra
// passes, which the fused GEMM + combine reads only when a pass ran
// (docs/design.md#layer-passes-early). The operand only gives the call its place among the
// shard_map's values; it is not read. No launch, no stream work.
#include "ffi/handlers.h"

namespace {

namespace ffi = xla::ffi;

ffi::Error UnwrittenImpl(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpUnwritten, UnwrittenImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // like: not read
                                  .Ret<ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
