// jax_ep_ht_dispatch / jax_ep_ht_gather / jax_ep_ht_combine and the fused jax_ep_ht_gather_gemm
// / jax_ep_ht_gemm_combine: decode, validate shapes (host-side, cheap), launch. Operands, results
// and attributes: docs/ffi.md. Kernels: csrc/kernels/high_throughput/, csrc/kernels/fused/.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "ffi/group.h"
#include "ffi/handlers.h"
#include "ffi/site_state.h"
#include "ffi/virtual_ranks.h"
#include "kernels/fused/gather_gemm.h"
#include "kernels/fused/gemm_combine.h"
#include "kernels/high_throughput.cuh"
#include "nvshmem/remote.h"
#include "runtime/device.h"
#include "runtime/virtual_ranks.h"
#include "testing/mutations.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jax_ep::dims_str;
using jax_ep::expect_rank;
using jax_ep::ht::CombineArgs;
using jax_ep::ht::DispatchArgs;
using jax_ep::ht::DType;
using jax_ep::ht::GatherArgs;

namespace {

constexpr int64_t kMaxInt = jax_ep::kInt32Max;

// Attributes every HT op carries: the lowering adds groups, group_size, site, timeout_ns and
// stage_bytes (jax_ep/_ffi.py; stage_bytes is the per-process staging size, 0 in one process);
// num_blocks is the op's grid (jax_ep.set_num_blocks). The call site's slot and staging buffers
// come from its lease (ffi/site_state.h); site and stage_bytes are read there, at instantiate.
// An op with one attribute more binds a struct that extends this one with it (XLA decodes a
// struct from exactly the attributes of the call, by name).
struct HtAttrs {
  ffi::Span<const int64_t> groups;
  int64_t group_size, site, timeout_ns, stage_bytes, num_blocks;
};
struct HtDispatchAttrs : HtAttrs {
  int64_t num_experts;  // E: a positive multiple of group_size
};
struct HtGatherGemmAttrs : HtAttrs {
  int64_t copy_blocks;  // blocks that gather the rows (0: auto), beside the GEMM tiles
  int64_t activation;   // 1: also silu(gate) * up in the tiles' epilogue (act), h's columns paired
  int64_t w_k_major;    // 1: w is [L, N, H] (the product by its transpose: the backward's)
  int64_t write_h;      // 0 (with activation): h not written, [0, N] (only the backward reads h)
};
struct HtGemmCombineAttrs : HtAttrs {
  int64_t combine_blocks;  // blocks that combine the rows (0: auto), beside the GEMM tiles
  int64_t w_k_major;       // 1: w is [L, N, I] (the product by its transpose: the backward's)
};

ffi::Error common_checks(const char* op, const HtAttrs& a, const jax_ep::SiteState* st) {
  if (st == nullptr || st->lease == nullptr)
    return ffi::Error::Internal(std::string(op) + ": no call-site state (instantiate stage)");
  if (a.timeout_ns <= 0) return jax_ep::op_error(op, "timeout_ns must be positive");
  if (a.num_blocks < 1 || a.num_blocks > jax_ep::kMaxNumBlocks)
    return jax_ep::op_error(op, "num_blocks must be in [1, " +
                                    std::to_string(jax_ep::kMaxNumBlocks) + "], got " +
                                    std::to_string(a.num_blocks));
  return ffi::Error::Success();
}

// The multiprocessor count of `device` into *sms, or an error naming the op.
ffi::Error read_sm_count(const char* op, int32_t device, int* sms) {
  *sms = jax_ep::sm_count(device);
  if (*sms > 0) return ffi::Error::Success();
  cudaGetLastError();  // clear it: a later launch check must not see it
  return ffi::Error::Internal(std::string(op) +
                              ": cannot read the multiprocessor count of device " +
                              std::to_string(device));
}

#if !JAX_EP_WITH_GEMM
// What a fused op says in a build without CUTLASS.
ffi::Error fused_unbuilt(const char* op) {
  return jax_ep::op_error(op,
                          "this build has no CUTLASS GEMMs (the nvidia-cutlass headers were "
                          "not found when it was built)");
}
#else
// A 0 / 1 attribute of a fused kernel, named in the error.
ffi::Error flag_attr(const char* op, const char* name, int64_t v) {
  if (v == 0 || v == 1) return ffi::Error::Success();
  return jax_ep::op_error(op, std::string(name) + " must be 0 or 1, got " + std::to_string(v));
}

// The weights w [L, K, N] bfloat16 of a fused kernel, K (named `k_name`) given: *L and *N.
ffi::Error fused_weights(const char* op, ffi::Span<const int64_t> dw, const char* k_name, int64_t K,
                         int64_t k_major, int64_t* L, int64_t* N) {
  JAX_EP_RETURN_IF_ERROR(flag_attr(op, "w_k_major", k_major));
  const std::string k = std::string(k_name) + "=" + std::to_string(K);
  if (dw.size() != 3 || dw[k_major ? 2 : 1] != K)
    return ffi::Error::InvalidArgument(
        std::string(op) + ": w must be " + (k_major ? "[L, N, " + k + "]" : "[L, " + k + ", N]") +
        " bfloat16" + (k_major ? " (w_k_major=1)" : "") + ", got " + dims_str(dw));
  *L = dw[0];
  *N = dw[k_major ? 1 : 2];
  return ffi::Error::Success();
}

// The GEMM shapes of a fused kernel: C rows, K (named `k_name`) and N positive, K and N
// multiples of 8, L in range.
ffi::Error fused_gemm_checks(const char* op, const char* k_name, int64_t C, int64_t K, int64_t N,
                             int64_t L) {
  if (C < 1 || K < 1 || N < 1)
    return jax_ep::op_error(op, "C (" + std::to_string(C) + "), " + k_name + " (" +
                                    std::to_string(K) + ") and N (" + std::to_string(N) +
                                    ") must be positive");
  if (K % 8 != 0 || N % 8 != 0)
    return jax_ep::op_error(op, std::string(k_name) + " (" + std::to_string(K) + ") and N (" +
                                    std::to_string(N) +
                                    ") must be multiples of 8 (16-byte rows for the TMA)");
  if (L < 1 || L > jax_ep::fused::kMaxExperts)
    return jax_ep::op_error(op, "the local experts (" + std::to_string(L) + ") must be in [1, " +
                                    std::to_string(jax_ep::fused::kMaxExperts) + "]");
  return ffi::Error::Success();
}

// The grid of a fused kernel: one block per SM (its rank's share of them in the one-GPU
// multi-rank mode, which read_sm_count already gives), `requested` of them (the attribute
// `attr`; 0: automatic(share, ranks, k), k the GEMM's inner dimension) in the role beside the
// GEMM tiles, *gemm the rest.
ffi::Error fused_split(const char* op, int32_t device, int64_t requested, const char* attr,
                       int (*automatic)(int, int, long long), int ranks, int64_t k, int* other,
                       int* gemm) {
  int share = 0;
  JAX_EP_RETURN_IF_ERROR(read_sm_count(op, device, &share));
  if constexpr (JAX_EP_PLANTED(kFusedShareTwice)) {
    if (const jax_ep::VirtualRank* vr = jax_ep::virtual_rank()) share /= vr->num_ranks;
  }
  const int64_t n = requested > 0 ? requested : automatic(share, ranks, k);
  if (n < 1 || n >= share)
    return jax_ep::op_error(op, std::string(attr) + " (" + std::to_string(n) +
                                    ") must leave at least one of the " + std::to_string(share) +
                                    " blocks (one per SM) to the GEMM tiles");
  *other = static_cast<int>(n);
  *gemm = share - *other;
  return ffi::Error::Success();
}
#endif

// Per-process mode (the call site's lease names a staging buffer per rank, aligned with
// `groups`; its size is the `stage_bytes` attribute, kernels/ht_sizes.h): peers
// cannot read this rank's XLA buffers, so copy the operands they read into this rank's
// symmetric staging buffer, stream-ordered before the kernel, and point the kernel at the
// staging buffers (PeerSlots::stage). Operand i sits at the sum of the 256-byte-aligned sizes
// of operands 0..i-1 (kernels/ht_sizes.h, which also sizes the buffer). One-process mode has
// no staging buffers: nothing to do. Reuse is safe: the previous call on the slot ended with the
// end barrier, after every peer finished reading. An entry with bit 0 set names a remote peer
// (symmetric.h): its stage[] is this rank's mirror of that peer's staging buffer, which
// run_pulled fills (nvshmem/remote.h). *staged: the staged bytes (the same on every rank).
ffi::Error stage_operands(const char* op, cudaStream_t stream, const jax_ep::Lease& lease,
                          ffi::Span<const int64_t> groups, jax_ep::GroupInfo* gi,
                          std::initializer_list<std::pair<const void*, size_t>> operands,
                          size_t* staged) {
  const ffi::Span<const int64_t> stage(lease.bufs);
  if (stage.size() == 0) return ffi::Error::Success();
  size_t need = 0;
  for (const auto& operand : operands)
    need += jax_ep::ht::stage_aligned(static_cast<int64_t>(operand.second));
  if (need > lease.request.bytes)
    return ffi::Error::Internal(std::string(op) + ": the operands need " + std::to_string(need) +
                                " staging bytes, the call site's buffer holds " +
                                std::to_string(lease.request.bytes) +
                                " (a lowering bug: stage_bytes is sized from the same shapes)");
  uint8_t* bufs[jax_ep::kMaxRanks];
  if (ffi::Error err = jax_ep::decode_peer_row(op, "staging buffer", stage, groups, *gi, bufs);
      err.failure())
    return err;
  for (int r = 0; r < gi->peers.num_ranks; ++r) gi->peers.stage[r] = bufs[r];
  uint8_t* mine = bufs[gi->peers.rank];
  size_t off = 0;
  int i = 0;
  for (const auto& operand : operands) {
    gi->peers.stage_off[i++] = off;
    if (operand.second > 0 && operand.first != nullptr)
      cudaMemcpyAsync(mine + off, operand.first, operand.second, cudaMemcpyDeviceToDevice, stream);
    off += jax_ep::ht::stage_aligned(static_cast<int64_t>(operand.second));
  }
  *staged = off;
  return jax_ep::cuda_error("staging copy");
}

// Launches the op's kernels (launch()), between the NVSHMEM prologue and epilogue when the group
// has remote peers (nvshmem/remote.h).
template <typename Launch>
ffi::Error run_pulled(const char* op, const jax_ep::GroupInfo& gi, size_t staged,
                      int64_t timeout_ns, cudaStream_t stream, Launch&& launch) {
  if (gi.peers.remote == 0) {
    launch();
    return jax_ep::cuda_error(op);
  }
  cudaError_t e = jax_ep::remote::pull_prologue(gi.peers, staged, timeout_ns, stream);
  if (e == cudaSuccess) {
    launch();
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = jax_ep::remote::pull_epilogue(gi.peers, timeout_ns, stream);
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_ep: ") + op +
                                " (remote peers): " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Launches a fused kernel (kernels/fused/, its Args) through run_pulled; a launch error is named
// by the op.
template <class Args>
ffi::Error run_fused(const char* op, const jax_ep::GroupInfo& gi, size_t staged, int64_t timeout_ns,
                     cudaStream_t stream, const Args& a) {
  std::string err;
  ffi::Error e = run_pulled(op, gi, staged, timeout_ns, stream,
                            [&] { err = jax_ep::fused::launch(a, stream); });
  if (!err.empty()) return ffi::Error::Internal(std::string(op) + ": " + err);
  return e;
}

#define JAX_EP_CHECK_SHAPE(buf, op, name, ...) \
  JAX_EP_RETURN_IF_ERROR(jax_ep::expect_dims(op, name, (buf).dimensions(), {__VA_ARGS__}))

// ------------------------------------------------------------------------------------------
ffi::Error HtDispatchImpl(
    cudaStream_t stream, int32_t device, ffi::Buffer<ffi::U8> x, ffi::Buffer<ffi::F32> x_scales,
    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
    ffi::Result<ffi::Buffer<ffi::U8>> recv_x, ffi::Result<ffi::Buffer<ffi::F32>> recv_scales,
    ffi::Result<ffi::Buffer<ffi::S32>> recv_topk_idx,
    ffi::Result<ffi::Buffer<ffi::F32>> recv_topk_weights,
    ffi::Result<ffi::Buffer<ffi::S32>> recv_src, ffi::Result<ffi::Buffer<ffi::S32>> send_rows,
    ffi::Result<ffi::Buffer<ffi::S32>> recv_tokens_per_expert,
    ffi::Result<ffi::Buffer<ffi::S32>> stats, ffi::Result<ffi::Buffer<ffi::S32>> scratch,
    HtDispatchAttrs at, jax_ep::SiteState* st) {
  const char* op = "jax_ep_ht_dispatch";
  JAX_EP_RETURN_IF_ERROR(common_checks(op, at, st));
  jax_ep::GroupInfo gi;
  JAX_EP_RETURN_IF_ERROR(
      jax_ep::resolve_group(device, at.groups, at.group_size, st->lease->slot, &gi));
  const int64_t R = at.group_size;
  if (at.num_experts < R || at.num_experts % R != 0 || at.num_experts > kMaxInt)
    return ffi::Error::InvalidArgument(
        std::string(op) + ": num_experts (" + std::to_string(at.num_experts) +
        ") must be a positive multiple of the EP group size (" + std::to_string(R) + ")");
  const int64_t L = at.num_experts / R;
  const auto dx = x.dimensions();
  JAX_EP_RETURN_IF_ERROR(expect_rank(op, "x", dx, 2, "[T, Hb] u8"));
  const int64_t T = dx[0], Hb = dx[1];
  const auto dk = topk_idx.dimensions();
  if (dk.size() != 2 || dk[0] != T)
    return ffi::Error::InvalidArgument(std::string(op) + ": topk_idx must be [T=" +
                                       std::to_string(T) + ", K], got " + dims_str(dk));
  const int64_t K = dk[1];
  const auto ds = x_scales.dimensions();
  if (ds.size() != 2 || ds[0] != T)
    return ffi::Error::InvalidArgument(std::string(op) + ": x_scales must be [T=" +
                                       std::to_string(T) + ", G], got " + dims_str(ds));
  const int64_t G = ds[1];
  const auto dc = recv_src->dimensions();
  JAX_EP_RETURN_IF_ERROR(expect_rank(op, "recv_src", dc, 1, "[C]"));
  const int64_t C = dc[0];
  JAX_EP_CHECK_SHAPE(topk_weights, op, "topk_weights", T, K);
  JAX_EP_CHECK_SHAPE(*recv_x, op, "recv_x", C, Hb);
  JAX_EP_CHECK_SHAPE(*recv_scales, op, "recv_scales", C, G);
  JAX_EP_CHECK_SHAPE(*recv_topk_idx, op, "recv_topk_idx", C, K);
  JAX_EP_CHECK_SHAPE(*recv_topk_weights, op, "recv_topk_weights", C, K);
  JAX_EP_CHECK_SHAPE(*send_rows, op, "send_rows", T, R);
  JAX_EP_CHECK_SHAPE(*recv_tokens_per_expert, op, "recv_tokens_per_expert", L);
  JAX_EP_CHECK_SHAPE(*stats, op, "stats", 4);
  const int64_t need = jax_ep::ht::ht_scratch_words(R, T);
  if (static_cast<int64_t>(scratch->element_count()) < need)
    return ffi::Error::InvalidArgument(
        std::string(op) + ": scratch must hold R*T + R*R + 64 = " + std::to_string(need) +
        " int32, got " + dims_str(scratch->dimensions()));
  if (R * T > kMaxInt || C > kMaxInt || K > (1 << 20) || G > kMaxInt)
    return ffi::Error::InvalidArgument(std::string(op) + ": shapes too large for int32 indices");

  int sms = 0;
  JAX_EP_RETURN_IF_ERROR(read_sm_count(op, device, &sms));
  // The layout kernel has a grid barrier: its grid (R * nch) must be co-resident. Half the SMs
  // at most: XLA may run other kernels beside ours (a NCCL collective on another stream, say)
  // that hold SMs, and a grid that needs every SM would then wait for them to finish.
  const jax_ep::ht::LayoutPlan plan =
      jax_ep::ht::plan_layout(static_cast<int>(R), static_cast<int>(T), std::max(1, sms / 2));
  if (plan.scratch_words > need)  // cannot happen (chunks >= 32 tokens, R <= 8): a safety net
    return ffi::Error::Internal(std::string(op) + ": layout plan needs " +
                                std::to_string(plan.scratch_words) + " scratch words");

  size_t staged = 0;
  JAX_EP_RETURN_IF_ERROR(stage_operands(op, stream, *st->lease, at.groups, &gi,
                                        {{x.untyped_data(), x.size_bytes()},
                                         {x_scales.untyped_data(), x_scales.size_bytes()},
                                         {topk_idx.untyped_data(), topk_idx.size_bytes()},
                                         {topk_weights.untyped_data(), topk_weights.size_bytes()}},
                                        &staged));
  DispatchArgs a{};
  a.plan = plan;
  a.ps = gi.peers;
  a.timeout_ns = at.timeout_ns;
  a.num_blocks = static_cast<int>(at.num_blocks);
  a.x = x.typed_data();
  a.x_scales = G > 0 ? x_scales.typed_data() : nullptr;
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.T = static_cast<int>(T);
  a.K = static_cast<int>(K);
  a.E = static_cast<int>(at.num_experts);
  a.L = static_cast<int>(L);
  a.C = static_cast<int>(C);
  a.G = static_cast<int>(G);
  a.Hb = Hb;
  a.recv_x = recv_x->typed_data();
  a.recv_scales = G > 0 ? recv_scales->typed_data() : nullptr;
  a.recv_topk_idx = recv_topk_idx->typed_data();
  a.recv_topk_weights = recv_topk_weights->typed_data();
  a.recv_src = recv_src->typed_data();
  a.send_rows = send_rows->typed_data();
  a.recv_tokens_per_expert = recv_tokens_per_expert->typed_data();
  a.stats = stats->typed_data();
  a.scratch = scratch->typed_data();
  return run_pulled(op, gi, staged, at.timeout_ns, stream,
                    [&] { jax_ep::ht::launch_dispatch(a, stream); });
}

// ------------------------------------------------------------------------------------------
ffi::Error HtGatherImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::U8> x,
                        ffi::Buffer<ffi::S32> recv_src, ffi::Buffer<ffi::S32> stats,
                        ffi::Result<ffi::Buffer<ffi::U8>> recv_x, HtAttrs at,
                        jax_ep::SiteState* st) {
  const char* op = "jax_ep_ht_gather";
  JAX_EP_RETURN_IF_ERROR(common_checks(op, at, st));
  jax_ep::GroupInfo gi;
  JAX_EP_RETURN_IF_ERROR(
      jax_ep::resolve_group(device, at.groups, at.group_size, st->lease->slot, &gi));
  const auto dx = x.dimensions();
  JAX_EP_RETURN_IF_ERROR(expect_rank(op, "x", dx, 2, "[T, Hb] u8"));
  const int64_t T = dx[0], Hb = dx[1];
  const auto dc = recv_src.dimensions();
  JAX_EP_RETURN_IF_ERROR(expect_rank(op, "recv_src", dc, 1, "[C]"));
  const int64_t C = dc[0];
  JAX_EP_CHECK_SHAPE(stats, op, "stats", 4);
  JAX_EP_CHECK_SHAPE(*recv_x, op, "recv_x", C, Hb);
  if (at.group_size * T > kMaxInt || C > kMaxInt)
    return ffi::Error::InvalidArgument(std::string(op) + ": shapes too large for int32 indices");

  size_t staged = 0;
  JAX_EP_RETURN_IF_ERROR(stage_operands(op, stream, *st->lease, at.groups, &gi,
                                        {{x.untyped_data(), x.size_bytes()}}, &staged));
  GatherArgs a{};
  a.ps = gi.peers;
  a.timeout_ns = at.timeout_ns;
  a.num_blocks = static_cast<int>(at.num_blocks);
  a.x = x.typed_data();
  a.recv_src = recv_src.typed_data();
  a.stats = stats.typed_data();
  a.T = static_cast<int>(T);
  a.C = static_cast<int>(C);
  a.Hb = Hb;
  a.recv_x = recv_x->typed_data();
  return run_pulled(op, gi, staged, at.timeout_ns, stream,
                    [&] { jax_ep::ht::launch_gather(a, stream); });
}

// ------------------------------------------------------------------------------------------
ffi::Error HtCombineImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                         ffi::Buffer<ffi::S32> send_rows, ffi::Result<ffi::AnyBuffer> out,
                         HtAttrs at, jax_ep::SiteState* st) {
  const char* op = "jax_ep_ht_combine";
  JAX_EP_RETURN_IF_ERROR(common_checks(op, at, st));
  jax_ep::GroupInfo gi;
  JAX_EP_RETURN_IF_ERROR(
      jax_ep::resolve_group(device, at.groups, at.group_size, st->lease->slot, &gi));
  DType dt;
  switch (y.element_type()) {
    case ffi::DataType::F32:
      dt = DType::kF32;
      break;
    case ffi::DataType::BF16:
      dt = DType::kBF16;
      break;
    case ffi::DataType::F16:
      dt = DType::kF16;
      break;
    default:
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": y must be float32, bfloat16 or float16");
  }
  if (out->element_type() != y.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": out must have the dtype of y");
  // y is [C, H] (trailing dimensions, if any, are flattened into H); out is [T, same].
  const auto dy = y.dimensions();
  if (dy.size() < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": y must be [C, H], got a scalar");
  const int64_t C = dy[0];
  int64_t H = 1;
  for (size_t i = 1; i < dy.size(); ++i) H *= dy[i];
  const auto dr = send_rows.dimensions();
  if (dr.size() != 2 || dr[1] != at.group_size)
    return ffi::Error::InvalidArgument(std::string(op) + ": send_rows must be [T, R=" +
                                       std::to_string(at.group_size) + "], got " + dims_str(dr));
  const int64_t T = dr[0];
  const auto dout = out->dimensions();
  bool out_ok = dout.size() == dy.size() && dout[0] == T;
  for (size_t i = 1; out_ok && i < dy.size(); ++i) out_ok = dout[i] == dy[i];
  if (!out_ok)
    return ffi::Error::InvalidArgument(std::string(op) + ": out must be [T=" + std::to_string(T) +
                                       "] + y.shape[1:] (y " + dims_str(dy) + "), got " +
                                       dims_str(dout));
  if (C > kMaxInt || T * at.group_size > kMaxInt)
    return ffi::Error::InvalidArgument(std::string(op) + ": shapes too large for int32 indices");

  size_t staged = 0;
  JAX_EP_RETURN_IF_ERROR(stage_operands(op, stream, *st->lease, at.groups, &gi,
                                        {{y.untyped_data(), y.size_bytes()}}, &staged));
  CombineArgs a{};
  a.ps = gi.peers;
  a.timeout_ns = at.timeout_ns;
  a.num_blocks = static_cast<int>(at.num_blocks);
  a.dtype = dt;
  a.y = y.untyped_data();
  a.send_rows = send_rows.typed_data();
  a.T = static_cast<int>(T);
  a.C = static_cast<int>(C);
  a.H = H;
  a.out = out->untyped_data();
  return run_pulled(op, gi, staged, at.timeout_ns, stream,
                    [&] { jax_ep::ht::launch_combine(a, stream); });
}

// ------------------------------------------------------------------------------------------
ffi::Error HtGatherGemmImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x,
                            ffi::Buffer<ffi::S32> rows_src, ffi::Buffer<ffi::S32> rows_dups,
                            ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::BF16> w,
                            ffi::Result<ffi::Buffer<ffi::BF16>> xe,
                            ffi::Result<ffi::Buffer<ffi::BF16>> h,
                            ffi::Result<ffi::Buffer<ffi::BF16>> act,
                            ffi::Result<ffi::Buffer<ffi::S32>> counters, HtGatherGemmAttrs at,
                            jax_ep::SiteState* st) {
  const char* op = "jax_ep_ht_gather_gemm";
  JAX_EP_RETURN_IF_ERROR(common_checks(op, at, st));
#if !JAX_EP_WITH_GEMM
  return fused_unbuilt(op);
#else
  jax_ep::GroupInfo gi;
  JAX_EP_RETURN_IF_ERROR(
      jax_ep::resolve_group(device, at.groups, at.group_size, st->lease->slot, &gi));
  const auto dx = x.dimensions();
  JAX_EP_RETURN_IF_ERROR(expect_rank(op, "x", dx, 2, "[T, H] bfloat16"));
  const int64_t T = dx[0], H = dx[1];
  int64_t L = 0, N = 0;
  JAX_EP_RETURN_IF_ERROR(fused_weights(op, w.dimensions(), "H", H, at.w_k_major, &L, &N));
  const auto dc = rows_src.dimensions();
  JAX_EP_RETURN_IF_ERROR(expect_rank(op, "rows_src", dc, 1, "[C]"));
  const int64_t C = dc[0];
  const auto dd = rows_dups.dimensions();
  if (dd.size() != 2 || dd[0] != C || dd[1] > jax_ep::fused::kMaxDups)
    return ffi::Error::InvalidArgument(
        std::string(op) + ": rows_dups must be [C=" + std::to_string(C) +
        ", D] with D <= " + std::to_string(jax_ep::fused::kMaxDups) + ", got " + dims_str(dd));
  JAX_EP_CHECK_SHAPE(sizes, op, "sizes", L);
  JAX_EP_RETURN_IF_ERROR(flag_attr(op, "activation", at.activation));
  JAX_EP_RETURN_IF_ERROR(flag_attr(op, "write_h", at.write_h));
  if (!at.write_h && !at.activation)
    return jax_ep::op_error(op, "write_h=0 needs activation=1 (without it h is the result)");
  JAX_EP_CHECK_SHAPE(*xe, op, "xe", C, H);
  JAX_EP_CHECK_SHAPE(*h, op, "h", at.write_h ? C : 0, N);
  if (at.activation && at.w_k_major)
    return jax_ep::op_error(op, "activation=1 reads w as [L, H, N] (w_k_major=0)");
  if (at.activation && N % jax_ep::fused::kBlockN != 0)
    return jax_ep::op_error(op, "activation=1 needs w's N = 2I a multiple of " +
                                    std::to_string(jax_ep::fused::kBlockN) + ", got " +
                                    std::to_string(N));
  JAX_EP_CHECK_SHAPE(*act, op, "act", at.activation ? C : 0, N / 2);
  JAX_EP_CHECK_SHAPE(*counters, op, "counters", jax_ep::fused::counter_words(C));
  if (at.group_size * T > kMaxInt || C > kMaxInt || H > kMaxInt || N > kMaxInt)
    return ffi::Error::InvalidArgument(std::string(op) + ": shapes too large for int32 indices");
  JAX_EP_RETURN_IF_ERROR(fused_gemm_checks(op, "H", C, H, N, L));
  int copy = 0, gemm = 0;
  JAX_EP_RETURN_IF_ERROR(fused_split(op, device, at.copy_blocks, "copy_blocks",
                                     jax_ep::fused::auto_copy_blocks,
                                     static_cast<int>(at.group_size), H, &copy, &gemm));

  size_t staged = 0;
  JAX_EP_RETURN_IF_ERROR(stage_operands(op, stream, *st->lease, at.groups, &gi,
                                        {{x.untyped_data(), x.size_bytes()}}, &staged));
  cudaMemsetAsync(counters->untyped_data(), 0, counters->size_bytes(), stream);
  jax_ep::fused::GatherGemmArgs a{};
  a.ps = gi.peers;
  a.timeout_ns = at.timeout_ns;
  a.x = x.untyped_data();
  a.rows_src = rows_src.typed_data();
  a.rows_dups = rows_dups.typed_data();
  a.D = static_cast<int>(dd[1]);
  a.sizes = sizes.typed_data();
  a.w = w.untyped_data();
  a.T = static_cast<int>(T);
  a.C = static_cast<int>(C);
  a.L = static_cast<int>(L);
  a.H = H;
  a.N = N;
  a.xe = xe->untyped_data();
  a.h = at.write_h ? h->untyped_data() : nullptr;
  a.act = at.activation ? act->untyped_data() : nullptr;
  a.w_k_major = at.w_k_major != 0;
  a.counters = counters->typed_data();
  a.copy_blocks = copy;
  a.gemm_blocks = gemm;
  return run_fused(op, gi, staged, at.timeout_ns, stream, a);
#endif
}

// ------------------------------------------------------------------------------------------
ffi::Error HtGemmCombineImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> a,
                             ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::BF16> w,
                             ffi::Buffer<ffi::S32> row_of, ffi::Buffer<ffi::F32> weights,
                             ffi::Buffer<ffi::S32> send_rows, ffi::Buffer<ffi::BF16> addend,
                             ffi::Buffer<ffi::PRED> addend_on,
                             ffi::Result<ffi::Buffer<ffi::BF16>> ye,
                             ffi::Result<ffi::Buffer<ffi::BF16>> out,
                             ffi::Result<ffi::Buffer<ffi::S32>> counters, HtGemmCombineAttrs at,
                             jax_ep::SiteState* st) {
  const char* op = "jax_ep_ht_gemm_combine";
  JAX_EP_RETURN_IF_ERROR(common_checks(op, at, st));
#if !JAX_EP_WITH_GEMM
  return fused_unbuilt(op);
#else
  jax_ep::GroupInfo gi;
  JAX_EP_RETURN_IF_ERROR(
      jax_ep::resolve_group(device, at.groups, at.group_size, st->lease->slot, &gi));
  // Peers read ye while this kernel writes it: only one process's buffers allow that.
  if (!st->lease->bufs.empty() || gi.peers.remote != 0)
    return jax_ep::op_error(op,
                            "the fused grouped GEMM + combine runs with one process over the "
                            "group's GPUs (peers read the rows as they are computed); per-process "
                            "groups run it unfused");
  const auto da = a.dimensions();
  JAX_EP_RETURN_IF_ERROR(expect_rank(op, "a", da, 2, "[C, I] bfloat16"));
  const int64_t C = da[0], I = da[1];
  int64_t L = 0, N = 0;
  JAX_EP_RETURN_IF_ERROR(fused_weights(op, w.dimensions(), "I", I, at.w_k_major, &L, &N));
  const auto dr = row_of.dimensions();
  JAX_EP_RETURN_IF_ERROR(expect_rank(op, "row_of", dr, 2, "[Cr, K]"));
  const int64_t Cr = dr[0], K = dr[1];
  const auto ds = send_rows.dimensions();
  if (ds.size() != 2 || ds[1] != at.group_size)
    return ffi::Error::InvalidArgument(std::string(op) + ": send_rows must be [T, R=" +
                                       std::to_string(at.group_size) + "], got " + dims_str(ds));
  const int64_t T = ds[0];
  JAX_EP_CHECK_SHAPE(sizes, op, "sizes", L);
  JAX_EP_CHECK_SHAPE(weights, op, "weights", Cr, K);
  JAX_EP_CHECK_SHAPE(*ye, op, "ye", C, N);
  JAX_EP_CHECK_SHAPE(*out, op, "out", T, N);
  JAX_EP_CHECK_SHAPE(*counters, op, "counters", jax_ep::fused::combine_counter_words(C, Cr, N));
  const bool has_addend = addend.element_count() != 0;
  if (has_addend) JAX_EP_CHECK_SHAPE(addend, op, "addend", T, N);
  if (addend_on.element_count() != 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": addend_on must be one bool, got " +
                                       dims_str(addend_on.dimensions()));
  const int64_t chunks = jax_ep::fused::combine_chunks(N);
  if (at.group_size * T > kMaxInt || C > kMaxInt || Cr * K > kMaxInt || I > kMaxInt ||
      N > kMaxInt || T * chunks > kMaxInt || C + 2 > kMaxInt ||
      (jax_ep::fused::reduce_tasks(Cr) + jax_ep::fused::token_tasks(T)) * chunks > kMaxInt)
    return ffi::Error::InvalidArgument(std::string(op) + ": shapes too large for int32 indices");
  JAX_EP_RETURN_IF_ERROR(fused_gemm_checks(op, "I", C, I, N, L));
  int combine = 0, gemm = 0;
  JAX_EP_RETURN_IF_ERROR(fused_split(op, device, at.combine_blocks, "combine_blocks",
                                     jax_ep::fused::auto_combine_blocks,
                                     static_cast<int>(at.group_size), I, &combine, &gemm));

  cudaMemsetAsync(counters->untyped_data(), 0, counters->size_bytes(), stream);
  jax_ep::fused::GemmCombineArgs g{};
  g.ps = gi.peers;
  g.timeout_ns = at.timeout_ns;
  g.a = a.untyped_data();
  g.sizes = sizes.typed_data();
  g.w = w.untyped_data();
  g.row_of = row_of.typed_data();
  g.weights = weights.typed_data();
  g.send_rows = send_rows.typed_data();
  g.T = static_cast<int>(T);
  g.C = static_cast<int>(C);
  g.Cr = static_cast<int>(Cr);
  g.K = static_cast<int>(K);
  g.L = static_cast<int>(L);
  g.I = I;
  g.N = N;
  g.ye = ye->untyped_data();
  g.out = out->untyped_data();
  g.addend = has_addend ? addend.untyped_data() : nullptr;
  g.addend_on = has_addend ? static_cast<const bool*>(addend_on.untyped_data()) : nullptr;
  g.counters = counters->typed_data();
  g.w_k_major = at.w_k_major != 0;
  g.combine_blocks = combine;
  g.gemm_blocks = gemm;
  return run_fused(op, gi, 0, at.timeout_ns, stream, g);
#endif
}

}  // namespace

// The members of HtAttrs, in its order (the structs that extend it list theirs after them).
#define JAX_EP_HT_MEMBERS                                                                          \
  ffi::StructMember<ffi::Span<const int64_t>>("groups"), ffi::StructMember<int64_t>("group_size"), \
      ffi::StructMember<int64_t>("site"), ffi::StructMember<int64_t>("timeout_ns"),                \
      ffi::StructMember<int64_t>("stage_bytes"), ffi::StructMember<int64_t>("num_blocks")
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(HtAttrs, JAX_EP_HT_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(HtDispatchAttrs, JAX_EP_HT_MEMBERS,
                                      ffi::StructMember<int64_t>("num_experts"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(HtGatherGemmAttrs, JAX_EP_HT_MEMBERS,
                                      ffi::StructMember<int64_t>("copy_blocks"),
                                      ffi::StructMember<int64_t>("activation"),
                                      ffi::StructMember<int64_t>("w_k_major"),
                                      ffi::StructMember<int64_t>("write_h"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(HtGemmCombineAttrs, JAX_EP_HT_MEMBERS,
                                      ffi::StructMember<int64_t>("combine_blocks"),
                                      ffi::StructMember<int64_t>("w_k_major"));

// What every high-throughput handler binds first (stream, device), and last: its attributes
// (one struct) and the call site's state (its lease).
#define JAX_EP_HT_BIND \
  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()
#define JAX_EP_HT_ATTRS_AND_STATE(T) .Attrs<T>().Ctx<ffi::State<jax_ep::SiteState>>()

#define JAX_EP_BIND_HT_DISPATCH                                      \
  JAX_EP_HT_BIND                                                     \
      .Arg<ffi::Buffer<ffi::U8>>()  /* x [T, Hb] */                  \
      .Arg<ffi::Buffer<ffi::F32>>() /* x_scales [T, G] */            \
      .Arg<ffi::Buffer<ffi::S32>>() /* topk_idx [T, K] */            \
      .Arg<ffi::Buffer<ffi::F32>>() /* topk_weights [T, K] */        \
      .Ret<ffi::Buffer<ffi::U8>>()  /* recv_x [C, Hb] */             \
      .Ret<ffi::Buffer<ffi::F32>>() /* recv_scales [C, G] */         \
      .Ret<ffi::Buffer<ffi::S32>>() /* recv_topk_idx [C, K] */       \
      .Ret<ffi::Buffer<ffi::F32>>() /* recv_topk_weights [C, K] */   \
      .Ret<ffi::Buffer<ffi::S32>>() /* recv_src [C] */               \
      .Ret<ffi::Buffer<ffi::S32>>() /* send_rows [T, R] */           \
      .Ret<ffi::Buffer<ffi::S32>>() /* recv_tokens_per_expert [L] */ \
      .Ret<ffi::Buffer<ffi::S32>>() /* stats [4] */                  \
      .Ret<ffi::Buffer<ffi::S32>>() /* scratch [ht_scratch_words] */ \
      JAX_EP_HT_ATTRS_AND_STATE(HtDispatchAttrs)
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpHtDispatch, HtDispatchImpl, JAX_EP_BIND_HT_DISPATCH);

#define JAX_EP_BIND_HT_GATHER                            \
  JAX_EP_HT_BIND                                         \
      .Arg<ffi::Buffer<ffi::U8>>()  /* x [T, Hb] */      \
      .Arg<ffi::Buffer<ffi::S32>>() /* recv_src [C] */   \
      .Arg<ffi::Buffer<ffi::S32>>() /* stats [4] */      \
      .Ret<ffi::Buffer<ffi::U8>>()  /* recv_x [C, Hb] */ \
      JAX_EP_HT_ATTRS_AND_STATE(HtAttrs)
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpHtGather, HtGatherImpl, JAX_EP_BIND_HT_GATHER);

#define JAX_EP_BIND_HT_COMBINE                                      \
  JAX_EP_HT_BIND                                                    \
      .Arg<ffi::AnyBuffer>()        /* y [C, H] f32 / bf16 / f16 */ \
      .Arg<ffi::Buffer<ffi::S32>>() /* send_rows [T, R] */          \
      .Ret<ffi::AnyBuffer>()        /* out [T, H], dtype of y */    \
      JAX_EP_HT_ATTRS_AND_STATE(HtAttrs)
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpHtCombine, HtCombineImpl, JAX_EP_BIND_HT_COMBINE);

#define JAX_EP_BIND_HT_GATHER_GEMM                                     \
  JAX_EP_HT_BIND                                                       \
      .Arg<ffi::Buffer<ffi::BF16>>() /* x [T, H] */                    \
      .Arg<ffi::Buffer<ffi::S32>>()  /* rows_src [C] */                \
      .Arg<ffi::Buffer<ffi::S32>>()  /* rows_dups [C, D] */            \
      .Arg<ffi::Buffer<ffi::S32>>()  /* sizes [L] */                   \
      .Arg<ffi::Buffer<ffi::BF16>>() /* w [L, H, N] or [L, N, H] */    \
      .Ret<ffi::Buffer<ffi::BF16>>() /* xe [C, H] */                   \
      .Ret<ffi::Buffer<ffi::BF16>>() /* h [C, N] */                    \
      .Ret<ffi::Buffer<ffi::BF16>>() /* act [C or 0, N / 2] */         \
      .Ret<ffi::Buffer<ffi::S32>>()  /* counters [counter_words(C)] */ \
      JAX_EP_HT_ATTRS_AND_STATE(HtGatherGemmAttrs)
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpHtGatherGemm, HtGatherGemmImpl, JAX_EP_BIND_HT_GATHER_GEMM);

#define JAX_EP_BIND_HT_GEMM_COMBINE                                                    \
  JAX_EP_HT_BIND                                                                       \
      .Arg<ffi::Buffer<ffi::BF16>>() /* a [C, I] */                                    \
      .Arg<ffi::Buffer<ffi::S32>>()  /* sizes [L] */                                   \
      .Arg<ffi::Buffer<ffi::BF16>>() /* w [L, I, N] or [L, N, I] */                    \
      .Arg<ffi::Buffer<ffi::S32>>()  /* row_of [Cr, K] */                              \
      .Arg<ffi::Buffer<ffi::F32>>()  /* weights [Cr, K] */                             \
      .Arg<ffi::Buffer<ffi::S32>>()  /* send_rows [T, R] */                            \
      .Arg<ffi::Buffer<ffi::BF16>>() /* addend [T, N] (may alias out), or [0]: none */ \
      .Arg<ffi::Buffer<ffi::PRED>>() /* addend_on []: whether it is read */            \
      .Ret<ffi::Buffer<ffi::BF16>>() /* ye [C, N] */                                   \
      .Ret<ffi::Buffer<ffi::BF16>>() /* out [T, N] */                                  \
      .Ret<ffi::Buffer<ffi::S32>>()  /* counters [combine_counter_words(C, Cr, N)] */  \
      JAX_EP_HT_ATTRS_AND_STATE(HtGemmCombineAttrs)
JAX_EP_DEFINE_HANDLER_AND_VR(JaxEpHtGemmCombine, HtGemmCombineImpl, JAX_EP_BIND_HT_GEMM_COMBINE);
