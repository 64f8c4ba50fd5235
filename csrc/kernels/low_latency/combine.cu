// Low-latency combine kernel: push protocol over peer memory (transport/push.cuh).
// One kernel runs the send phase, the receive phase, or both (the fused op). Contract:
// docs/ffi.md. Design notes: docs/kernels.md ("Low-latency kernels").
#include <algorithm>

#include "kernels/low_latency/codec24.cuh"
#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/geometry.cuh"
#include "testing/mutations.h"

namespace jax_ep {
namespace ll {
namespace {

// ---------------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------------

// The expert rank sends each (source s, token t) back in kCombineParts column parts, each part
// by its own warp and with its own tag:
//   rows: the bf16 output row of each local expert the token names, into s's row (t, lead slot:
//     the first slot naming that expert);
//   a partial (pre-reduction), when at least min_partial of t's slots name experts here, s is
//     reachable by stores (not an NVSHMEM remote peer) and the first two such slots a < b fall
//     in the same batch of kCombineKb slots (the receive loads a batch at once): the sum of
//     w[t][k] * row of slot k over those slots (float32, k order), as 24 bits per column (the
//     float's bits rounded: the upper 16 in row (t, a), 2 bytes per column like a bf16 row, the
//     next 8 in row (t, b), 1 byte per column). At R = 4 with top-8 of 128 experts this sends
//     39% fewer remote bytes than one bf16 row per expert; the partial's relative rounding
//     (2^-16) is 1/256 of the output's bf16 rounding.
// The source decides the same from the dispatch's ids (dispatch_idx); it adds w * row for the
// rows and the partials as they are, in k order (the partial at slot a).

// One lane: wait until *tag is not older than e32 (`what` names the wait, peer the rank that
// writes the tag, -1 when not known here). A wait that gave up leaves the row as it is: a stale
// row of our own buffer, in bounds. The poll loop is out of line: the callers keep their
// registers on the fast path.
__device__ __noinline__ void wait_tag_slow(const CombineParams& p, const int* tag, unsigned int e32,
                                           const char* what, int peer) {
  Patience wait;
  int v;
  while (tag_older(v = ld_acquire_sys_s32(tag), e32)) {
    __nanosleep(kPollSleepNs);  // leave the issue slots and memory pipes to the senders
    if (wait.gives_up(p.ps, p.timeout_ns, WaitSite{what, peer, e32, static_cast<unsigned int>(v)}))
      return;
  }
}
__device__ __forceinline__ void wait_tag(const CombineParams& p, const int* tag, unsigned int e32,
                                         const char* what, int peer) {
  if (tag_older(ld_acquire_sys_s32(tag), e32)) wait_tag_slow(p, tag, e32, what, peer);
}

// Weight of slot i = t * K + k: the caller's, where its topk_idx names the dispatch's expert,
// else 0 (a slot the caller changed contributes nothing; docs/API.md).
__device__ __forceinline__ float combine_weight(const CombineParams& p, int64_t i) {
  return __ldg(p.topk_idx + i) == __ldg(p.dispatch_idx + i) ? __ldg(p.topk_weights + i) : 0.f;
}

// Send side, source role (one warp per expert rank q, at the start): our weights into q's buffer,
// then their flag (the warp barrier orders every lane's stores before lane 0's release store).
__device__ __forceinline__ void combine_send_weights(const CombineParams& p, int q, int par,
                                                     unsigned long long es, int lane) {
  float* dst = combine_weights(p.buf[q], p, par, p.ps.rank);
  const int n = p.T * p.K;
  for (int i = lane; i < n; i += 32) dst[i] = combine_weight(p, i);
  __syncwarp();
  if (lane == 0)
    st_release_sys_s32(combine_wflag(p.buf[q], p, par, p.ps.rank), static_cast<int>(es));
}

// Whole warp: columns [v0, v1) (vectors V) of the partial sum_k w_k * y[row_k] over the slots
// in `has` (lane k: row_k, w_k), in k order, split into hi / lo (split24). kU vectors per lane
// per pass, one slot's loads at a time: loading 2 or 4 slots at once (more registers, spills)
// made the combine 4-7 us slower at R = 4 (docs/notes.md#rejected-partial-loads).
template <typename V, int kU>
__device__ __forceinline__ void partial_columns(const V* y, int nvec_row, unsigned has, int rr,
                                                float w, int v0, int v1, V* hi,
                                                typename LoOf<V>::T* lo, int lane) {
  constexpr int EPV = sizeof(V) / 2;
  for (int base = v0; base < v1; base += kU * 32) {  // warp-uniform
    float acc[kU][EPV];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int e = 0; e < EPV; ++e) acc[u][e] = 0.f;
    for (unsigned m = has; m != 0; m &= m - 1) {  // warp-uniform; slots in k order
      const int ks = __ffs(m) - 1;
      const V* src = y + (int64_t)__shfl_sync(kFull, rr, ks) * nvec_row;
      const float wk = __shfl_sync(kFull, w, ks);
      V x[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = base + u * 32 + lane;
        if (v < v1) x[u] = __ldg(src + v);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        float f[EPV];
        unpack(x[u], f);
#pragma unroll
        for (int e = 0; e < EPV; ++e) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(wk, f[e]));
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = base + u * 32 + lane;
      if (v < v1) {
        V h;
        typename LoOf<V>::T l;
        split24<V>(acc[u], h, l);
        hi[v] = h;
        lo[v] = l;
      }
    }
  }
}

// Send item (source s, token t, part of `parts`): the rows or the partial of t in the columns of
// tag units [part * u, (part + 1) * u), u = kCombineParts / parts, then those units' tags.
// *wseen: bit s set once this warp saw s's weight flag.
template <typename V>
__device__ __noinline__ void combine_send_item(const CombineParams& p, int s, int t, int part,
                                               int parts, int par, unsigned long long es,
                                               unsigned* wseen, int lane) {
  using LoV = typename LoOf<V>::T;
  constexpr int EPV = sizeof(V) / 2;
  constexpr int kU = 4;  // column vectors per lane per pass of the partial
  const int nvec = p.H / EPV;
  const int per = (nvec + kCombineParts - 1) / kCombineParts;  // vectors per tag unit
  const int upi = kCombineParts / parts, u0 = part * upi;
  const int v0 = min(nvec, u0 * per), v1 = min(nvec, (u0 + upi) * per);
  const int32_t* rows = p.src_rows + ((int64_t)s * p.M + t) * p.K;
  const uint8_t* y = static_cast<const uint8_t*>(p.y);
  const int64_t rb = 2LL * p.H;  // stride of y's rows
  uint8_t* dbuf = p.buf[s];
  // A row of y outside [0, L * R * M) (a handle not made by this dispatch) counts as no row.
  const int nrows = p.L * p.ps.num_ranks * p.M;
  for (int kb = 0; kb < p.K; kb += 32) {  // one pass when K <= 32 (partials need K <= 32)
    const int k = kb + lane;
    int rr = k < p.K ? __ldg(rows + k) : -1;
    if (rr >= nrows && !JAX_EP_PLANTED(kLlRowUnbounded)) rr = -1;
    const unsigned has = __ballot_sync(kFull, rr >= 0);
    if (has == 0) continue;
    const unsigned rest = has & (has - 1);
    const int a = __ffs(has) - 1, b = rest != 0 ? __ffs(rest) - 1 : -1;
    const bool partial = kb == 0 && __popc(has) >= p.min_partial && !is_remote(p.ps, s) && b >= 0 &&
                         a / kCombineKb == b / kCombineKb;
    if (!partial) {
      // rows: one per lead (the first slot with that row; K > 32: earlier passes checked too)
      const unsigned same = __match_any_sync(kFull, rr);
      bool lead = rr >= 0 && (same & lanemask_lt()) == 0;
      if (lead)
        for (int k2 = 0; k2 < kb; ++k2)
          if (__ldg(rows + k2) == rr) {
            lead = false;
            break;
          }
      const unsigned leads = __ballot_sync(kFull, lead);
      for (unsigned m = leads; m != 0; m &= m - 1) {  // warp-uniform
        const int ks = __ffs(m) - 1;
        const int row = __shfl_sync(kFull, rr, ks);
        copy_row<V>(y + (int64_t)row * rb + (int64_t)v0 * sizeof(V),
                    combine_row(dbuf, p, par, t, kb + ks) + (int64_t)v0 * sizeof(V),
                    (int64_t)(v1 - v0) * sizeof(V), lane);
      }
      // The warp barrier orders every lane's stores before the release stores of the tags,
      // which makes them visible first (release is cumulative). Tags after every row: a
      // release waits for the warp's stores before it, so a tag between two rows stalls the
      // second. A system fence before them cost 2.8 us of the combine at R = 4
      // (docs/design.md#release-tags).
      __syncwarp();
      for (int i = lane; i < __popc(leads) * upi; i += 32)
        st_release_sys_s32(
            combine_tag(dbuf, p, par, t, kb + __fns(leads, 0, i / upi + 1), u0 + i % upi),
            static_cast<int>(es));
      continue;
    }
    // partial: s's weights first (written by s at the start of its combine)
    uint8_t* own = p.buf[p.ps.rank];
    // The rows' columns into L2 while the weights travel (the partial's loads are a latency
    // chain; at R = 4 this took 0.4-0.8 us off the combine, about the run-to-run drift).
    for (unsigned m = has; m != 0; m &= m - 1) {  // warp-uniform
      const uint8_t* r0 = y + (int64_t)__shfl_sync(kFull, rr, __ffs(m) - 1) * rb;
      for (int64_t off = (int64_t)v0 * sizeof(V) + lane * 128; off < (int64_t)v1 * sizeof(V);
           off += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(r0 + off));
    }
    if (((*wseen >> s) & 1u) == 0) {
      if (lane == 0)
        wait_tag(p, combine_wflag(own, p, par, s), static_cast<unsigned>(es),
                 "ll_combine: wait for the source's weights", s);
      __syncwarp();  // lane 0's acquire comes before every lane's weight load
      *wseen |= 1u << s;
    }
    const float* ws = combine_weights(own, p, par, s) + (int64_t)t * p.K;
    const float w = rr >= 0 ? __ldcg(ws + k) : 0.f;
    V* hi = reinterpret_cast<V*>(combine_row(dbuf, p, par, t, a));
    LoV* lo = reinterpret_cast<LoV*>(combine_row(dbuf, p, par, t, b));
    partial_columns<V, kU>(reinterpret_cast<const V*>(y), nvec, has, rr, w, v0, v1, hi, lo, lane);
    __syncwarp();
    if (lane < upi)
      st_release_sys_s32(combine_tag(dbuf, p, par, t, a, u0 + lane), static_cast<int>(es));
  }
}

// Top-k slot k of token t at the source, as the receive uses it: whether to load row kf (then
// add w times it; lo >= 0: row kf is a partial's upper half, slot lo's row its low bytes), or
// row k as a partial's low bytes (lo_only). K <= 32: lane k holds them (slot_regs), broadcast by
// shuffle; larger K (no partials): read from memory. Packed: the receive keeps kCombineKb of
// them in registers beside the loaded rows.
struct SlotInfo {
  unsigned int code;  // kf (bits 0-20: K <= 2^20) | valid << 21 | lo_only << 22 | (lo + 1) << 23
  float w;
  __device__ __forceinline__ static SlotInfo make(bool valid, bool lo_only, int kf, int lo,
                                                  float w) {
    return SlotInfo{static_cast<unsigned int>(kf) | (valid ? 1u << 21 : 0u) |
                        (lo_only ? 1u << 22 : 0u) | (static_cast<unsigned int>(lo + 1) << 23),
                    w};
  }
  __device__ __forceinline__ bool valid() const { return (code >> 21) & 1u; }
  __device__ __forceinline__ bool lo_only() const { return (code >> 22) & 1u; }
  __device__ __forceinline__ int kf() const { return static_cast<int>(code & 0x1fffffu); }
  __device__ __forceinline__ int lo() const { return static_cast<int>(code >> 23) - 1; }
};

// Whole warp (K <= 32): lane k's SlotInfo for token t; see "Combine" above for the partials.
__device__ __forceinline__ SlotInfo slot_regs(const CombineParams& p, int t, int lane) {
  const int v = lane < p.K ? __ldg(p.dispatch_idx + (int64_t)t * p.K + lane) : -1;
  const bool valid = v >= 0 && v < p.E;
  const float w = valid ? combine_weight(p, (int64_t)t * p.K + lane) : 0.f;
  const unsigned same_e = __match_any_sync(kFull, valid ? v : -1);
  const int q = valid ? v / p.L : -1;
  const unsigned same_q = __match_any_sync(kFull, q);
  const unsigned rest = same_q & (same_q - 1);
  const int a = __ffs(same_q) - 1, b = rest != 0 ? __ffs(rest) - 1 : -1;
  const bool partial = valid && __popc(same_q) >= p.min_partial && !is_remote(p.ps, q) && b >= 0 &&
                       a / kCombineKb == b / kCombineKb;
  if (partial) return SlotInfo::make(lane == a, lane == b, a, b, 1.f);
  return SlotInfo::make(valid, false, __ffs(same_e) - 1, -1, w);
}

// Slot k of token t (whole warp): from lane k's SlotInfo g (K <= 32), else from memory.
__device__ __forceinline__ SlotInfo slot_info(const CombineParams& p, int t, int k,
                                              const SlotInfo& g) {
  if (p.K <= 32) return SlotInfo{__shfl_sync(kFull, g.code, k), __shfl_sync(kFull, g.w, k)};
  const int32_t* ids = p.dispatch_idx + (int64_t)t * p.K;
  const int v = __ldg(ids + k);
  const bool valid = v >= 0 && v < p.E;
  int kf = k;
  if (valid)
    for (int k2 = 0; k2 < k; ++k2)
      if (__ldg(ids + k2) == v) {
        kf = k2;
        break;
      }
  return SlotInfo::make(valid, false, kf, -1,
                        valid ? combine_weight(p, (int64_t)t * p.K + k) : 0.f);
}

// Whole warp: wait until every part of the rows token t reads (the lead rows, the partials'
// upper halves) carries the tag of epoch er or a newer one; lanes poll one (slot, part) each.
__device__ __forceinline__ void combine_wait_rows(const CombineParams& p, int t, int par,
                                                  unsigned long long er, const SlotInfo& g,
                                                  int lane) {
  uint8_t* own = p.buf[p.ps.rank];
  // the rows read: a valid slot's row kf is its own (a lead row, or a partial's upper half)
  const unsigned wait_mask = p.K <= 32 ? __ballot_sync(kFull, g.valid() && g.kf() == lane) : 0u;
  for (int i = lane; i < p.K * kCombineParts; i += 32) {
    const int k = i / kCombineParts, part = i % kCombineParts;
    bool wait = (wait_mask >> k) & 1u;
    if (p.K > 32) {  // slot_info reads the ids from memory then (no shuffles)
      const SlotInfo si = slot_info(p, t, k, g);
      wait = si.valid() && si.kf() == k;
    }
    if (wait)
      wait_tag(p, combine_tag(own, p, par, t, k, part), static_cast<unsigned>(er),
               "ll_combine: wait for the expert outputs", -1);
  }
  __syncwarp();  // the polling lanes' acquires come before every lane's row loads
}

// Receive item (token t, column chunk c): out[t] = sum_k w[t][k] * row(t, first slot of e_k),
// accumulated in float32 in k order (a partial counts once, at its first slot).
template <typename V>
__device__ __forceinline__ void combine_recv_item(const CombineParams& p, int t, int c, int par,
                                                  unsigned long long er, int lane) {
  using LoV = typename LoOf<V>::T;
  constexpr int EPV = sizeof(V) / 2;
  const int nvec = p.H / EPV;
  const SlotInfo g = p.K <= 32 ? slot_regs(p, t, lane) : SlotInfo::make(false, false, 0, -1, 0.f);
  combine_wait_rows(p, t, par, er, g, lane);
  if (lane == 0) diag_max(p.ps, p.diag, trace::kDiagItemDataIn);
  uint8_t* own = p.buf[p.ps.rank];
  const int v0 = c * 32 * kCombineVpt;
  float acc[kCombineVpt][EPV];
#pragma unroll
  for (int i = 0; i < kCombineVpt; ++i)
#pragma unroll
    for (int e = 0; e < EPV; ++e) acc[i][e] = 0.f;
  for (int k0 = 0; k0 < p.K; k0 += kCombineKb) {  // warp-uniform
    V buf[kCombineKb][kCombineVpt];
    SlotInfo si[kCombineKb];
#pragma unroll
    for (int kk = 0; kk < kCombineKb; ++kk) {  // all loads first
      const int k = k0 + kk;
      si[kk] = k < p.K ? slot_info(p, t, k, g) : SlotInfo::make(false, false, 0, -1, 0.f);
      const uint8_t* row = combine_row(own, p, par, t, si[kk].lo_only() ? k : si[kk].kf());
#pragma unroll
      for (int i = 0; i < kCombineVpt; ++i) {
        const int v = v0 + i * 32 + lane;
        if (v >= nvec) continue;
        if (si[kk].valid()) {
          buf[kk][i] = __ldcg(reinterpret_cast<const V*>(row) + v);
        } else if (si[kk].lo_only()) {
          lo_park(lo_bits(__ldcg(reinterpret_cast<const LoV*>(row) + v)), buf[kk][i]);
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < kCombineKb; ++kk) {  // then accumulate in k order
      if (!si[kk].valid()) continue;
#pragma unroll
      for (int i = 0; i < kCombineVpt; ++i) {
        float f[EPV];
        if (si[kk].lo() < 0) {
          unpack(buf[kk][i], f);
        } else {  // a partial: its low bytes are in the batch's slot lo (static indices only)
          unsigned long long b = 0;
#pragma unroll
          for (int k2 = kk + 1; k2 < kCombineKb; ++k2)
            if (k0 + k2 == si[kk].lo()) b = lo_parked(buf[k2][i]);
          join24<V>(buf[kk][i], b, f);
        }
#pragma unroll
        for (int e = 0; e < EPV; ++e) acc[i][e] = __fadd_rn(acc[i][e], __fmul_rn(si[kk].w, f[e]));
      }
    }
  }
  V* out = reinterpret_cast<V*>(static_cast<uint8_t*>(p.out) + (int64_t)t * 2LL * p.H);
#pragma unroll
  for (int i = 0; i < kCombineVpt; ++i) {
    const int v = v0 + i * 32 + lane;
    if (v < nvec) pack(acc[i], out + v);
  }
}

// Send items (source s, token t, column part), tokens in order and the sources interleaved from
// the next rank: every source gets its tokens in token order at about the same pace, and its
// receive items (taken in token order) find their rows early.
template <typename V>
__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(const __grid_constant__ CombineParams p) {
  const PeerSlots& ps = p.ps;
  const int R = ps.num_ranks;
  Slot* me = ps.slot[ps.rank];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned long long es = push::send_epoch(ps);
  const unsigned long long er =
      push::recv_epoch(ps, p.mode == push::kModeRecv ? p.ticket_in : nullptr);
  trace_mark(ps, trace::kLlCombineStart);
  if (threadIdx.x == 0) diag_max(ps, p.diag, trace::kDiagLastBlockStart);

  if (p.mode & push::kModeSend) {
    const int par = static_cast<int>(es & 1);
    // Our weights to every expert rank reachable by stores, before anything waits. Their half
    // of the buffer is free: each expert rank read our weights of call es - 2 before it sent us
    // the rows our receive of es - 2 waited for, and that receive ran before this send.
    if (blockIdx.x == 0 && warp < R && p.min_partial <= p.K) {
      const int q = (ps.rank + 1 + warp) % R;
      if (!is_remote(ps, q)) combine_send_weights(p, q, par, es, lane);
    }
    bool freed = true;
    if ((int)threadIdx.x < R)
      freed = push::wait_freed(ps, threadIdx.x, es, p.timeout_ns,
                               "ll_combine: sources free the buffer");
    if (p.ticket != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
      p.ticket[0] = static_cast<int>(es);  // the split receive takes the epoch from here
    __shared__ unsigned int first_ticket;  // the block's first send tickets (one atomic)
    if (threadIdx.x == 0) first_ticket = push::take_block_tickets(me, push::kSend, kWarps);
    // A source never freed its half (the wait gave up): this block sends nothing.
    const bool held = __syncthreads_or(!freed);
    // Parts per (source, token): as many as the grid's warps take in one round (a second round
    // doubles the phase), a power of two <= kCombineParts.
    int parts = kCombineParts;
    while (parts > 1 && R * p.M * parts > static_cast<int>(gridDim.x) * kWarps) parts >>= 1;
    const int n = R * p.M * parts;
    unsigned wseen = 0;
    for (int fin = 0; !held; fin = 1) {  // warp-uniform
      const push::Take tk = push::send_take(me, first_ticket, warp, n, fin, lane);
      if (fin == 0 && lane == 0) diag_max(ps, p.diag, trace::kDiagFirstSendTicket);
      if (tk.it >= n) {
        if (tk.closer && lane == 0) trace_mark_last(ps, trace::kLlCombineSendDone);
        break;
      }
      const int part = tk.it % parts, pair = tk.it / parts;
      const int t = pair / R, s = (ps.rank + 1 + pair % R) % R;
      combine_send_item<V>(p, s, t, part, parts, par, es, &wseen, lane);
    }
    if (lane == 0) diag_max(ps, p.diag, trace::kDiagSendLoopDone);
  }

  if (p.mode & push::kModeRecv) {
    const int par = static_cast<int>(er & 1);
    trace_mark(ps, trace::kLlCombineReceiveStarts);
    constexpr int EPV = sizeof(V) / 2;
    const int nvec = p.H / EPV;
    const int nchunk = (nvec + 32 * kCombineVpt - 1) / (32 * kCombineVpt);
    const int n = p.T * nchunk;
    bool closer = n == 0 && blockIdx.x == 0 && threadIdx.x < 32;
    for (int fin = 0;; fin = 1) {  // warp-uniform; tokens in order (the order the rows arrive in)
      const push::Take tk = push::next_item(me, push::kRecv, n, fin, lane);
      if (fin == 0 && lane == 0) diag_max(ps, p.diag, trace::kDiagFirstReceiveTicket);
      if (tk.it >= n) {
        closer |= tk.closer;
        break;
      }
      combine_recv_item<V>(p, tk.it / nchunk, tk.it % nchunk, par, er, lane);
    }
    if (lane == 0) diag_max(ps, p.diag, trace::kDiagReceiveLoopDone);
    if (closer) {  // every row of this half is read: the senders may write it again
      if (lane < R) push::signal_freed(ps, lane, er);
      if (lane == 0) trace_mark_last(ps, trace::kLlCombineReceiveDone);
    }
  }
  if (lane == 0) diag_max(ps, p.diag, trace::kDiagKernelExit);
  push::leave_kernel(ps, p.mode, es, p.outputs);
}

}  // namespace

// The combine: all SMs but kCombineFreeSms (at least three quarters). More warps take more
// column parts of a (source, token) in one round: at R = 4, M = 128 on H200, 128 blocks give 4
// parts where 99 gave 2, and the kernel took 37.6 us against 41.0 (docs/design.md#grid-sizes).
constexpr int kCombineFreeSms = 4;
int combine_grid_size(int sms) { return std::max(dispatch_grid_size(sms), sms - kCombineFreeSms); }

cudaError_t launch_combine(const CombineParams& p, int grid, cudaStream_t stream) {
  const int vw = vec_bytes(
      {(uintptr_t)(2 * p.H), reinterpret_cast<uintptr_t>(p.y), reinterpret_cast<uintptr_t>(p.out)});
  // The results a wait that gave up poisons (transport/poison.cuh).
  CombineParams q = p;
  q.outputs = {};
  if (p.mode & push::kModeSend) poison::add(q.outputs, p.ticket, 4);
  if (p.mode & push::kModeRecv) poison::add(q.outputs, p.out, static_cast<int64_t>(p.T) * p.H * 2);
  launch_gated(JAX_EP_LL_BY_VEC_WIDTH(combine_kernel, vw), "low-latency combine", grid, kThreads, 0,
               stream, q);
  return cudaGetLastError();
}

}  // namespace ll
}  // namespace jax_ep
