#include "ffi/site_state.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "ffi/common.h"
#include "runtime/workspace.h"

namespace jax_ep {

namespace ffi = xla::ffi;

ffi::TypeId SiteState::id = {};

const XLA_FFI_TypeInfo* site_state_type_info() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<SiteState>();
  return &info;
}

namespace {

ffi::ErrorOr<std::unique_ptr<SiteState>> instantiate(ffi::Dictionary attrs) {
  auto fail = [](const std::string& m) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("jax_ep (instantiate): " + m));
  };
  ffi::ErrorOr<ffi::Span<const int64_t>> groups = attrs.get<ffi::Span<const int64_t>>("groups");
  ffi::ErrorOr<int64_t> group_size = attrs.get<int64_t>("group_size");
  ffi::ErrorOr<int64_t> site = attrs.get<int64_t>("site");
  ffi::ErrorOr<int64_t> timeout_ns = attrs.get<int64_t>("timeout_ns");
  if (!groups.has_value() || !group_size.has_value() || !site.has_value() ||
      !timeout_ns.has_value())
    return fail(
        "a communication call site needs the attributes groups, group_size, site and "
        "timeout_ns");
  if (*timeout_ns <= 0) return fail("timeout_ns must be positive");
  const bool push = attrs.contains("buffer_bytes");
  ffi::ErrorOr<int64_t> bytes = attrs.get<int64_t>(push ? "buffer_bytes" : "stage_bytes");
  if (!bytes.has_value()) return fail("missing buffer_bytes / stage_bytes");
  const int64_t R = *group_size;
  if (R < 1 || R > kMaxRanks || groups->size() == 0 || groups->size() % R != 0)
    return fail("group table of " + std::to_string(groups->size()) + " entries, group size " +
                std::to_string(R));
  if (*bytes < 0) return fail("negative buffer size");
  LeaseRequest r;
  r.site = static_cast<uint64_t>(*site);
  r.groups.assign(groups->begin(), groups->end());
  r.group_size = static_cast<int>(R);
  r.push = push;
  r.bytes = static_cast<size_t>(*bytes);
  r.timeout_ns = *timeout_ns;
  auto st = std::make_unique<SiteState>();
  try {
    st->lease = acquire_lease(r);
  } catch (const LeaseDisagreement& e) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition, e.what()));
  } catch (const std::exception& e) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kResourceExhausted, e.what()));
  }
  return ffi::ErrorOr<std::unique_ptr<SiteState>>(std::move(st));
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpSiteInstantiate, jax_ep::instantiate,
                              xla::ffi::Ffi::BindInstantiate().Attrs<xla::ffi::Dictionary>());
