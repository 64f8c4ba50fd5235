// Low-latency handlers: the fused ops (jax_ep_ll_dispatch / jax_ep_ll_combine, one kernel each)
// and the split ops (*_send / *_recv, one kernel each, same kernels in one phase). They decode
// the attributes, check shapes and the receive buffer, and launch. Contract: docs/ffi.md.
// Kernels: kernels/low_latency/.
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "ffi/group.h"
#include "ffi/handlers.h"
#include "ffi/site_state.h"
#include "ffi/virtual_ranks.h"
#include "kernels/low_latency.cuh"
#include "nvshmem/remote.h"
#include "runtime/device.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jax_ep::dims_are;
using jax_ep::dims_str;
namespace ll = jax_ep::ll;
namespace push = jax_ep::push;

namespace {

constexpr int64_t kIntMax = jax_ep::kInt32Max;

// Attributes every LL op carries (the lowering adds the first four; see jax_ep/_ffi.py). The
// call site's slot and receive buffers come from its lease (ffi/site_state.h).
// prereduce and diag are settings fixed at lowering (jax_ep/config.py): prereduce=false makes
// the combine send one bf16 row per (token, expert), no partial sums
// (kernels/low_latency/combine.cu, "Combine"); diag=true makes the kernels record per-warp
// timestamps (diag_max).
struct LlAttrs {
  ffi::Span<const int64_t> groups;
  int64_t group_size, site, timeout_ns;
  int64_t buffer_bytes, num_experts, max_tokens, num_topk, hidden;
  bool use_fp8, round_scale, prereduce, diag;
};

// The group of `device`, its receive buffers and the common shape checks. bufs[q]: where the
// kernels write q's rows: q's buffer, or for a remote q (bit 0 of its entry, symmetric.h) this
// rank's scratch image of it, which nvshmem/remote.h then puts. *own: this rank's buffer.
ffi::Error resolve(const char* op, int32_t device, const LlAttrs& a, const jax_ep::SiteState* st,
                   jax_ep::GroupInfo* gi, uint8_t** bufs, uint8_t** own, int64_t need_bytes) {
  if (st == nullptr || st->lease == nullptr)
    return ffi::Error::Internal(std::string(op) + ": no call-site state (instantiate stage)");
  const jax_ep::Lease& lease = *st->lease;
  if (ffi::Error err = jax_ep::resolve_group(device, a.groups, a.group_size, lease.slot, gi);
      err.failure())
    return err;
  auto bad = [op](const std::string& m) { return jax_ep::op_error(op, m); };
  const int64_t R = a.group_size, E = a.num_experts;
  if (E < R || E % R != 0 || E > (1 << 30))
    return bad("num_experts (" + std::to_string(E) +
               ") must be a positive multiple of the group size (" + std::to_string(R) + ")");
  if (E / R > jax_ep::kMaxLocalExperts)
    return bad("experts per rank " + std::to_string(E / R) + " exceeds " +
               std::to_string(jax_ep::kMaxLocalExperts));
  if (lease.slot < jax_ep::kFirstPushSlot) return bad("slot is not a push slot");
  if (need_bytes > a.buffer_bytes || static_cast<size_t>(a.buffer_bytes) != lease.request.bytes)
    return bad("the receive buffer holds " + std::to_string(a.buffer_bytes) +
               " bytes, this call needs " + std::to_string(need_bytes) +
               " (a lowering bug: the buffer is sized from the same shapes)");
  if (ffi::Error err = jax_ep::decode_peer_row(
          op, "receive buffer", ffi::Span<const int64_t>(lease.bufs), a.groups, *gi, bufs);
      err.failure())
    return err;
  *own = bufs[gi->peers.rank];
  return ffi::Error::Success();
}

ffi::Error remote_error(const char* op, cudaError_t e) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_ep: ") + op +
                              " (remote peers): " + cudaGetErrorString(e));
}

// With remote peers a fused op runs as its send kernel, the NVSHMEM puts, its receive kernel
// and the NVSHMEM freed flags (a remote peer's rows arrive only after our send kernel ended);
// a split half runs its kernel and its NVSHMEM step. The receive kernel and the freed flags
// take the epoch from the send's ticket (dispatch: stats[1]; fused combine: our send_epoch).
ffi::Error dispatch_with_remote(const char* op, const ll::DispatchParams& p, int grid, uint8_t* own,
                                cudaStream_t stream) {
  if (p.mode & push::kModeSend) {
    ll::DispatchParams s = p;
    s.mode = push::kModeSend;
    ll::launch_dispatch(s, grid, stream);
    if (ffi::Error err = remote_error(op, jax_ep::remote::push_dispatch_rows(
                                              p.ps, own, p.buf, p.T, p.M, p.row_bytes, p.area_bytes,
                                              ll::dispatch_count_bytes(p.L), stream));
        err.failure())
      return err;
  }
  if (p.mode & push::kModeRecv) {
    ll::DispatchParams r = p;
    r.mode = push::kModeRecv;
    if (p.mode != push::kModeRecv) r.ticket = p.stats;  // fused: the send kernel's stats
    ll::launch_dispatch(r, grid, stream);
    if (ffi::Error err = remote_error(op, cudaSuccess); err.failure()) return err;
    return remote_error(op, jax_ep::remote::free_remote_senders(p.ps, r.ticket + 1, stream));
  }
  return ffi::Error::Success();
}

ffi::Error combine_with_remote(const char* op, const ll::CombineParams& p, int grid, uint8_t* own,
                               cudaStream_t stream) {
  if (p.mode & push::kModeSend) {
    ll::CombineParams s = p;
    s.mode = push::kModeSend;
    ll::launch_combine(s, grid, stream);
    if (ffi::Error err = remote_error(
            op, jax_ep::remote::push_combine_rows(
                    p.ps, own, p.buf, p.recv_src, p.recv_slot, p.recv_count, p.L, p.M, p.K,
                    ll::combine_row_bytes(p.H), ll::combine_tags_offset(p.M, p.K, p.H),
                    ll::kCombineParts, stream));
        err.failure())
      return err;
  }
  if (p.mode & push::kModeRecv) {
    ll::CombineParams r = p;
    r.mode = push::kModeRecv;
    // Fused: the send kernel left its epoch in our slot's send_epoch (its low 32 bits).
    if (p.mode != push::kModeRecv)
      r.ticket_in = reinterpret_cast<const int32_t*>(&p.ps.slot[p.ps.rank]->send_epoch);
    ll::launch_combine(r, grid, stream);
    if (ffi::Error err = remote_error(op, cudaSuccess); err.failure()) return err;
    return remote_error(op, jax_ep::remote::free_remote_senders(p.ps, r.ticket_in, stream));
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------
// Dispatch: x, topk_idx (send) -> recv_x, recv_scales, recv_count, recv_src, recv_slot (recv)
// ------------------------------------------------------------------------------------------

ffi::Error LlDispatchAny(const char* op, int mode, cudaStream_t stream, int32_t device,
                         const LlAttrs& a, const jax_ep::SiteState* st, const ffi::AnyBuffer* x,
                         const ffi::AnyBuffer* idx, int32_t* stats, const int32_t* ticket,
                         ffi::Result<ffi::AnyBuffer>* recv_x,
                         ffi::Result<ffi::AnyBuffer>* recv_scales,
                         ffi::Result<ffi::AnyBuffer>* recv_count,
                         ffi::Result<ffi::AnyBuffer>* recv_src,
                         ffi::Result<ffi::AnyBuffer>* recv_slot,
                         ffi::Result<ffi::AnyBuffer>* src_rows) {
  auto bad = [op](const std::string& m) { return jax_ep::op_error(op, m); };
  const int64_t R = a.group_size, M = a.max_tokens, E = a.num_experts, L = E / R;
  const int64_t H = a.hidden, K = a.num_topk;
  int64_t T = 0;
  if (mode & push::kModeSend) {
    const auto dx = x->dimensions(), di = idx->dimensions();
    if (x->element_type() != ffi::DataType::BF16) return bad("x must be bfloat16");
    if (dx.size() != 2 || dx[1] != H) return bad("x must be [T, H], got " + dims_str(dx));
    T = dx[0];
    if (idx->element_type() != ffi::DataType::S32) return bad("topk_idx must be int32");
    if (!dims_are(di, {T, K})) return bad("topk_idx must be [T, K], got " + dims_str(di));
    if (M < 0 || T > M)
      return bad("T = " + std::to_string(T) + " exceeds max_tokens = " + std::to_string(M));
  }
  if (R * M > kIntMax / 2 || M * K > kIntMax || H > kIntMax / 4 || K > (1 << 20) ||
      L * R * M > kIntMax || H < 1 || K < 1)
    return bad("shapes out of range");
  if (a.use_fp8 && H % 128 != 0)
    return bad("use_fp8 needs H % 128 == 0, got H = " + std::to_string(H));
  const int64_t G = a.use_fp8 ? H / 128 : 0;
  if (mode & push::kModeRecv) {
    const auto want_x = a.use_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16;
    if ((*recv_x)->element_type() != want_x)
      return bad(std::string("recv_x must be ") + (a.use_fp8 ? "float8_e4m3fn" : "bfloat16"));
    if (!dims_are((*recv_x)->dimensions(), {L, R * M, H}))
      return bad("recv_x must be [L, R*M, H], got " + dims_str((*recv_x)->dimensions()));
    if (!dims_are((*recv_scales)->dimensions(), {L, R * M, G}))
      return bad("recv_scales must be [L, R*M, G], got " + dims_str((*recv_scales)->dimensions()));
    if (!dims_are((*recv_count)->dimensions(), {L}))
      return bad("recv_count must be [L], got " + dims_str((*recv_count)->dimensions()));
    if (!dims_are((*recv_src)->dimensions(), {L, R * M}) ||
        !dims_are((*recv_slot)->dimensions(), {L, R * M}))
      return bad("recv_src / recv_slot must be [L, R*M]");
    if ((*src_rows)->element_type() != ffi::DataType::S32 ||
        !dims_are((*src_rows)->dimensions(), {R * M, K}))
      return bad("src_rows must be int32 [R*M, K], got " + dims_str((*src_rows)->dimensions()));
  }
  jax_ep::GroupInfo gi;
  ll::DispatchParams p{};
  uint8_t* own = nullptr;
  if (ffi::Error err = resolve(op, device, a, st, &gi, p.buf, &own,
                               ll::dispatch_buffer_bytes(R, M, K, H, L, a.use_fp8));
      err.failure())
    return err;
  const int grid = ll::dispatch_grid_size(jax_ep::sm_count(device));
  if (grid < 1) return jax_ep::cuda_error(op);
  p.ps = gi.peers;
  p.mode = mode;
  if (mode & push::kModeSend) {
    p.x = x->untyped_data();
    p.topk_idx = static_cast<const int32_t*>(idx->untyped_data());
    p.stats = stats;
  }
  if (mode == push::kModeRecv) p.ticket = ticket;
  if (mode & push::kModeRecv) {
    p.recv_x = (*recv_x)->untyped_data();
    p.recv_scales = static_cast<float*>((*recv_scales)->untyped_data());
    p.recv_count = static_cast<int32_t*>((*recv_count)->untyped_data());
    p.recv_src = static_cast<int32_t*>((*recv_src)->untyped_data());
    p.recv_slot = static_cast<int32_t*>((*recv_slot)->untyped_data());
    p.src_rows = static_cast<int32_t*>((*src_rows)->untyped_data());
  }
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.K = static_cast<int>(K);
  p.E = static_cast<int>(E);
  p.L = static_cast<int>(L);
  p.M = static_cast<int>(M);
  p.G = static_cast<int>(G);
  p.use_fp8 = a.use_fp8 ? 1 : 0;
  p.round_scale = a.round_scale ? 1 : 0;
  p.diag = a.diag ? 1 : 0;
  p.hdr_bytes = ll::dispatch_header_bytes(K);
  p.row_bytes = ll::dispatch_row_bytes(K, H, a.use_fp8);
  p.area_bytes = ll::dispatch_area_bytes(M, K, H, L, a.use_fp8);
  p.timeout_ns = a.timeout_ns;
  if (p.ps.remote != 0) return dispatch_with_remote(op, p, grid, own, stream);
  ll::launch_dispatch(p, grid, stream);
  return jax_ep::cuda_error(op);
}

ffi::Error LlDispatchImpl(
    cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer idx,
    ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
    ffi::Result<ffi::AnyBuffer> recv_count, ffi::Result<ffi::AnyBuffer> recv_src,
    ffi::Result<ffi::AnyBuffer> recv_slot, ffi::Result<ffi::AnyBuffer> src_rows,
    ffi::Result<ffi::Buffer<ffi::S32>> stats, LlAttrs a, jax_ep::SiteState* st) {
  if (stats->element_count() != 2) return ffi::Error::InvalidArgument("stats must be [2]");
  return LlDispatchAny("jax_ep_ll_dispatch", push::kModeBoth, stream, device, a, st, &x, &idx,
                       stats->typed_data(), nullptr, &recv_x, &recv_scales, &recv_count, &recv_src,
                       &recv_slot, &src_rows);
}

ffi::Error LlDispatchSendImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::AnyBuffer idx, ffi::Result<ffi::Buffer<ffi::S32>> stats,
                              LlAttrs a, jax_ep::SiteState* st) {
  if (stats->element_count() != 2) return ffi::Error::InvalidArgument("stats must be [2]");
  return LlDispatchAny("jax_ep_ll_dispatch_send", push::kModeSend, stream, device, a, st, &x, &idx,
                       stats->typed_data(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                       nullptr);
}

ffi::Error LlDispatchRecvImpl(
    cudaStream_t stream, int32_t device, ffi::AnyBuffer ticket, ffi::Result<ffi::AnyBuffer> recv_x,
    ffi::Result<ffi::AnyBuffer> recv_scales, ffi::Result<ffi::AnyBuffer> recv_count,
    ffi::Result<ffi::AnyBuffer> recv_src, ffi::Result<ffi::AnyBuffer> recv_slot,
    ffi::Result<ffi::AnyBuffer> src_rows, LlAttrs a, jax_ep::SiteState* st) {
  if (ticket.element_count() != 2 || ticket.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jax_ep_ll_dispatch_recv: ticket must be int32 [2]");
  // The send's stats: orders this op after the send, and carries the send's epoch.
  return LlDispatchAny("jax_ep_ll_dispatch_recv", push::kModeRecv, stream, device, a, st, nullptr,
                       nullptr, nullptr, static_cast<const int32_t*>(ticket.untyped_data()),
                       &recv_x, &recv_scales, &recv_count, &recv_src, &recv_slot, &src_rows);
}

// ------------------------------------------------------------------------------------------
// Combine: y, recv_src, recv_slot, recv_count, src_rows, topk_idx, topk_weights (send: expert
// side, and the weights to the expert ranks) -> out (recv, source side: topk_idx, topk_weights)
// ------------------------------------------------------------------------------------------

ffi::Error LlCombineAny(const char* op, int mode, cudaStream_t stream, int32_t device,
                        const LlAttrs& a, const jax_ep::SiteState* st, const ffi::AnyBuffer* y,
                        const ffi::AnyBuffer* src, const ffi::AnyBuffer* slot,
                        const ffi::AnyBuffer* count, const ffi::AnyBuffer* rows, int32_t* ticket,
                        const int32_t* ticket_in, const ffi::AnyBuffer* idx,
                        const ffi::AnyBuffer* w, const ffi::AnyBuffer* didx,
                        ffi::Result<ffi::AnyBuffer>* out) {
  auto bad = [op](const std::string& m) { return jax_ep::op_error(op, m); };
  const int64_t R = a.group_size, M = a.max_tokens, E = a.num_experts, L = E / R;
  const int64_t H = a.hidden, K = a.num_topk;
  int64_t T = 0;
  if (mode & push::kModeSend) {
    if (y->element_type() != ffi::DataType::BF16) return bad("y must be bfloat16");
    if (!dims_are(y->dimensions(), {L, R * M, H}))
      return bad("y must be [L, R*M, H], got " + dims_str(y->dimensions()));
    if (!dims_are(src->dimensions(), {L, R * M}) || !dims_are(slot->dimensions(), {L, R * M}))
      return bad("recv_src / recv_slot must be [L, R*M]");
    if (!dims_are(count->dimensions(), {L}))
      return bad("recv_count must be [L], got " + dims_str(count->dimensions()));
    if (rows->element_type() != ffi::DataType::S32 || !dims_are(rows->dimensions(), {R * M, K}))
      return bad("src_rows must be int32 [R*M, K], got " + dims_str(rows->dimensions()));
  }
  {  // both sides read topk_idx / topk_weights (the send writes the weights to the expert ranks)
    const auto di = idx->dimensions();
    if (di.size() != 2 || di[1] != K) return bad("topk_idx must be [T, K], got " + dims_str(di));
    T = di[0];
    if (T > M) return bad("T exceeds max_tokens");
    if (idx->element_type() != ffi::DataType::S32) return bad("topk_idx must be int32");
    if (w->element_type() != ffi::DataType::F32 || !dims_are(w->dimensions(), {T, K}))
      return bad("topk_weights must be float32 [T, K], got " + dims_str(w->dimensions()));
    if (didx->element_type() != ffi::DataType::S32 || !dims_are(didx->dimensions(), {T, K}))
      return bad("the handle's topk_idx must be int32 [T, K] like topk_idx, got " +
                 dims_str(didx->dimensions()));
    if ((mode & push::kModeRecv) && !dims_are((*out)->dimensions(), {T, H}))
      return bad("out must be [T, H], got " + dims_str((*out)->dimensions()));
  }
  if (R * M > kIntMax / 2 || M * K > kIntMax || H > kIntMax / 4 || K > (1 << 20) || H < 1 ||
      K < 1 || M * K * ((H + 63) / 64) > kIntMax)
    return bad("shapes out of range");
  jax_ep::GroupInfo gi;
  ll::CombineParams p{};
  uint8_t* own = nullptr;
  if (ffi::Error err =
          resolve(op, device, a, st, &gi, p.buf, &own, ll::combine_buffer_bytes(R, M, K, H));
      err.failure())
    return err;
  const int grid = ll::combine_grid_size(jax_ep::sm_count(device));
  if (grid < 1) return jax_ep::cuda_error(op);
  p.ps = gi.peers;
  p.mode = mode;
  if (mode & push::kModeSend) {
    p.y = y->untyped_data();
    p.recv_src = static_cast<const int32_t*>(src->untyped_data());
    p.recv_slot = static_cast<const int32_t*>(slot->untyped_data());
    p.recv_count = static_cast<const int32_t*>(count->untyped_data());
    p.src_rows = static_cast<const int32_t*>(rows->untyped_data());
    p.ticket = ticket;
  }
  if (mode == push::kModeRecv) p.ticket_in = ticket_in;
  p.topk_idx = static_cast<const int32_t*>(idx->untyped_data());
  p.topk_weights = static_cast<const float*>(w->untyped_data());
  p.dispatch_idx = static_cast<const int32_t*>(didx->untyped_data());
  if (mode & push::kModeRecv) p.out = (*out)->untyped_data();
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.K = static_cast<int>(K);
  p.E = static_cast<int>(E);
  p.L = static_cast<int>(L);
  p.M = static_cast<int>(M);
  p.diag = a.diag ? 1 : 0;
  p.timeout_ns = a.timeout_ns;
  // Pre-reduction needs K <= 32 (one lane per slot); JAX_EP_LL_PREREDUCE=0 turns it off.
  p.min_partial = (K <= 32 && a.prereduce) ? 2 : (1 << 30);
  if (p.ps.remote != 0) return combine_with_remote(op, p, grid, own, stream);
  ll::launch_combine(p, grid, stream);
  return jax_ep::cuda_error(op);
}

ffi::Error LlCombineImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y, ffi::AnyBuffer src,
                         ffi::AnyBuffer slot, ffi::AnyBuffer count, ffi::AnyBuffer rows,
                         ffi::AnyBuffer idx, ffi::AnyBuffer w, ffi::AnyBuffer didx,
                         ffi::Result<ffi::AnyBuffer> out, LlAttrs a, jax_ep::SiteState* st) {
  return LlCombineAny("jax_ep_ll_combine", push::kModeBoth, stream, device, a, st, &y, &src, &slot,
                      &count, &rows, nullptr, nullptr, &idx, &w, &didx, &out);
}

ffi::Error LlCombineSendImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                             ffi::AnyBuffer src, ffi::AnyBuffer slot, ffi::AnyBuffer count,
                             ffi::AnyBuffer rows, ffi::AnyBuffer idx, ffi::AnyBuffer w,
                             ffi::AnyBuffer didx, ffi::Result<ffi::Buffer<ffi::S32>> ticket,
                             LlAttrs a, jax_ep::SiteState* st) {
  return LlCombineAny("jax_ep_ll_combine_send", push::kModeSend, stream, device, a, st, &y, &src,
                      &slot, &count, &rows, ticket->typed_data(), nullptr, &idx, &w, &didx,
                      nullptr);
}

ffi::Error LlCombineRecvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer ticket,
                             ffi::AnyBuffer idx, ffi::AnyBuffer w, ffi::AnyBuffer didx,
                             ffi::Result<ffi::AnyBuffer> out, LlAttrs a, jax_ep::SiteState* st) {
  if (ticket.element_count() != 1 || ticket.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jax_ep_ll_combine_recv: ticket must be int32 [1]");
  // The send's ticket: orders this op after the send, and carries the send's epoch.
  return LlCombineAny("jax_ep_ll_combine_recv", push::kModeRecv, stream, device, a, st, nullptr,
                      nullptr, nullptr, nullptr, nullptr, nullptr,
                      static_cast<const int32_t*>(ticket.untyped_data()), &idx, &w, &didx, &out);
}

}  // namespace

// Attribute decoding shared by the six handlers (a dictionary of exactly these names).
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    LlAttrs, ffi::StructMember<ffi::Span<const int64_t>>("groups"),
    ffi::StructMember<int64_t>("group_size"), ffi::StructMember<int64_t>("site"),
    ffi::StructMember<int64_t>("timeout_ns"), ffi::StructMember<int64_t>("buffer_bytes"),
    ffi::StructMember<int64_t>("num_experts"), ffi::StructMember<int64_t>("max_tokens"),
    ffi::StructMember<int64_t>("num_topk"), ffi::StructMember<int64_t>("hidden"),
    ffi::StructMember<bool>("use_fp8"), ffi::StructMember<bool>("round_scale"),
    ffi::StructMember<bool>("prereduce"), ffi::StructMember<bool>("diag"));

#define JAX_EP_LL_BIND \
  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()
// What every LL handler binds last: the attributes and the call site's state (its lease).
#define JAX_EP_LL_ATTRS_AND_STATE .Attrs<LlAttrs>().Ctx<ffi::State<jax_ep::SiteState>>()

#define JAX_EP_BIND_LL_DISPATCH                                   \
  JAX_EP_LL_BIND                                                  \
      .Arg<ffi::AnyBuffer>()        /* x [T, H] bf16 */           \
      .Arg<ffi::AnyBuffer>()        /* topk_idx [T, K] s32 */     \
      .Ret<ffi::AnyBuffer>()        /* recv_x [L, R*M, H] */      \
      .Ret<ffi::AnyBuffer>()        /* recv_scales [L, R*M, G] */ \
      .Ret<ffi::AnyBuffer>()        /* recv_count [L] */          \
      .Ret<ffi::AnyBuffer>()        /* recv_src [L, R*M] */       \
      .Ret<ffi::AnyBuffer>()        /* recv_slot [L, R*M] */      \
      .Ret<ffi::AnyBuffer>()        /* src_rows [R*M, K] */       \
      .Ret<ffi::Buffer<ffi::S32>>() /* stats [2] */               \
      JAX_EP_LL_ATTRS_AND_STATE
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpLlDispatch, LlDispatchImpl, JAX_EP_BIND_LL_DISPATCH);

#define JAX_EP_BIND_LL_DISPATCH_SEND                             \
  JAX_EP_LL_BIND                                                 \
      .Arg<ffi::AnyBuffer>()        /* x */                      \
      .Arg<ffi::AnyBuffer>()        /* topk_idx */               \
      .Ret<ffi::Buffer<ffi::S32>>() /* stats [2] (the ticket) */ \
      JAX_EP_LL_ATTRS_AND_STATE
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpLlDispatchSend, LlDispatchSendImpl, JAX_EP_BIND_LL_DISPATCH_SEND);

#define JAX_EP_BIND_LL_DISPATCH_RECV           \
  JAX_EP_LL_BIND                               \
      .Arg<ffi::AnyBuffer>() /* ticket [2] */  \
      .Ret<ffi::AnyBuffer>() /* recv_x */      \
      .Ret<ffi::AnyBuffer>() /* recv_scales */ \
      .Ret<ffi::AnyBuffer>() /* recv_count */  \
      .Ret<ffi::AnyBuffer>() /* recv_src */    \
      .Ret<ffi::AnyBuffer>() /* recv_slot */   \
      .Ret<ffi::AnyBuffer>() /* src_rows */    \
      JAX_EP_LL_ATTRS_AND_STATE
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpLlDispatchRecv, LlDispatchRecvImpl, JAX_EP_BIND_LL_DISPATCH_RECV);

#define JAX_EP_BIND_LL_COMBINE                                  \
  JAX_EP_LL_BIND                                                \
      .Arg<ffi::AnyBuffer>() /* y [L, R*M, H] bf16 */           \
      .Arg<ffi::AnyBuffer>() /* recv_src [L, R*M] */            \
      .Arg<ffi::AnyBuffer>() /* recv_slot [L, R*M] */           \
      .Arg<ffi::AnyBuffer>() /* recv_count [L] */               \
      .Arg<ffi::AnyBuffer>() /* src_rows [R*M, K] */            \
      .Arg<ffi::AnyBuffer>() /* topk_idx [T, K] */              \
      .Arg<ffi::AnyBuffer>() /* topk_weights [T, K] f32 */      \
      .Arg<ffi::AnyBuffer>() /* the handle's topk_idx [T, K] */ \
      .Ret<ffi::AnyBuffer>() /* out [T, H] bf16 */              \
      JAX_EP_LL_ATTRS_AND_STATE
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpLlCombine, LlCombineImpl, JAX_EP_BIND_LL_COMBINE);

#define JAX_EP_BIND_LL_COMBINE_SEND                             \
  JAX_EP_LL_BIND                                                \
      .Arg<ffi::AnyBuffer>()        /* y */                     \
      .Arg<ffi::AnyBuffer>()        /* recv_src */              \
      .Arg<ffi::AnyBuffer>()        /* recv_slot */             \
      .Arg<ffi::AnyBuffer>()        /* recv_count */            \
      .Arg<ffi::AnyBuffer>()        /* src_rows */              \
      .Arg<ffi::AnyBuffer>()        /* topk_idx */              \
      .Arg<ffi::AnyBuffer>()        /* topk_weights */          \
      .Arg<ffi::AnyBuffer>()        /* the handle's topk_idx */ \
      .Ret<ffi::Buffer<ffi::S32>>() /* ticket [1] */            \
      JAX_EP_LL_ATTRS_AND_STATE
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpLlCombineSend, LlCombineSendImpl, JAX_EP_BIND_LL_COMBINE_SEND);

#define JAX_EP_BIND_LL_COMBINE_RECV                      \
  JAX_EP_LL_BIND                                         \
      .Arg<ffi::AnyBuffer>() /* ticket [1] */            \
      .Arg<ffi::AnyBuffer>() /* topk_idx */              \
      .Arg<ffi::AnyBuffer>() /* topk_weights */          \
      .Arg<ffi::AnyBuffer>() /* the handle's topk_idx */ \
      .Ret<ffi::AnyBuffer>() /* out */                   \
      JAX_EP_LL_ATTRS_AND_STATE
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpLlCombineRecv, LlCombineRecvImpl, JAX_EP_BIND_LL_COMBINE_RECV);
