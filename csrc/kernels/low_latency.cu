// Low-latency dispatch / combine kernels: push protocol over peer memory (transport/push.cuh).
// One kernel runs the send phase, the receive phase, or both (the fused op). Contract:
// docs/ffi.md. Design notes: docs/kernels.md ("Low-latency kernels").
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/fp8.cuh"
#include "kernels/low_latency.cuh"
#include "runtime/device.h"
#include "runtime/virtual_ranks.h"

namespace jax_ep {
namespace ll {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxParts = 4;       // most warps per (token, destination) send row / received row
constexpr int kQuantUnits = 4;     // 128-column groups in flight per 8 lanes (quantisation)
constexpr int kCopyRegs = 8;       // vectors in flight per lane while copying a row
constexpr int kFastRegs = 6;       // the same in copy_row_fast (loaded with the row's words)
constexpr int kFillInts = 512;     // recv_src / recv_slot entries per fill item
constexpr int kCombineVpt = 2;     // column vectors per lane per combine item
constexpr int kCombineKb = 8;      // top-k rows loaded together in combine
constexpr int kPollSleepNs = 128;  // pause between polls of a row tag or an epoch word

__host__ __device__ inline int64_t align16(int64_t v) { return (v + 15) & ~int64_t{15}; }

// Diagnostic (JAX_EP_LL_DIAG=1, off by default): the latest %globaltimer that any caller
// reached point i, into trace[i] of our slot; the points are listed in transport/peer.cuh
// ("Phase tracer"). benchmarks/trace_phases.py --ll-only --absolute prints them.
__device__ __forceinline__ void diag_max(const PeerSlots& ps, int on, int i) {
  if (on) atomicMax(&ps.slot[ps.rank]->trace[i], (unsigned long long)global_timer_ns());
}

// Warps per row (column parts) so that `fixed` + rows * parts items fit the grid's warps: the
// phases are chains of latencies, and a second wave of items on a warp doubles the phase.
__device__ __forceinline__ int row_parts(int fixed, int rows) {
  const int nw = static_cast<int>(gridDim.x) * kWarps;
  if (rows <= 0) return 1;
  return max(1, min(kMaxParts, (nw - fixed) / rows));
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Local expert of rank r named by a raw id, or -1 (invalid ids act as -1).
__device__ __forceinline__ int local_expert(int v, int E, int L, int r) {
  if (v < 0 || v >= E) return -1;
  const int q = v / L;
  return q == r ? v - q * L : -1;
}

// bf16 vectors <-> float
__device__ __forceinline__ float bf16_bits_to_float(unsigned int b) {
  return __uint_as_float(b << 16);
}
__device__ __forceinline__ unsigned int float_to_bf16_bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ void unpack(const unsigned short& v, float (&f)[1]) {
  f[0] = bf16_bits_to_float(v);
}
__device__ __forceinline__ void unpack(const unsigned int& v, float (&f)[2]) {
  f[0] = bf16_bits_to_float(v & 0xffffu);
  f[1] = __uint_as_float(v & 0xffff0000u);
}
__device__ __forceinline__ void unpack(const uint2& v, float (&f)[4]) {
  f[0] = bf16_bits_to_float(v.x & 0xffffu);
  f[1] = __uint_as_float(v.x & 0xffff0000u);
  f[2] = bf16_bits_to_float(v.y & 0xffffu);
  f[3] = __uint_as_float(v.y & 0xffff0000u);
}
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
  fp8::bf16x8_to_float(v, f);
}
__device__ __forceinline__ unsigned int pack2(float a, float b) {
  return float_to_bf16_bits(a) | (float_to_bf16_bits(b) << 16);
}
__device__ __forceinline__ void pack(const float (&f)[1], unsigned short* o) {
  *o = (unsigned short)float_to_bf16_bits(f[0]);
}
__device__ __forceinline__ void pack(const float (&f)[2], unsigned int* o) {
  *o = pack2(f[0], f[1]);
}
__device__ __forceinline__ void pack(const float (&f)[4], uint2* o) {
  *o = make_uint2(pack2(f[0], f[1]), pack2(f[2], f[3]));
}
__device__ __forceinline__ void pack(const float (&f)[8], uint4* o) {
  *o = make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

// Whole warp: copy `bytes` (a multiple of sizeof(V)) from src to dst, kCopyRegs vectors per
// lane in flight. src is read-only for the kernel (an XLA operand).
template <typename V>
__device__ __forceinline__ void copy_row(const uint8_t* src, uint8_t* dst, int64_t bytes,
                                         int lane) {
  const int nvec = static_cast<int>(bytes / (int64_t)sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  for (int base = 0; base < nvec; base += kCopyRegs * 32) {
    V buf[kCopyRegs];
#pragma unroll
    for (int u = 0; u < kCopyRegs; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nvec) buf[u] = __ldg(s + v);
    }
#pragma unroll
    for (int u = 0; u < kCopyRegs; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nvec) d[v] = buf[u];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------

// Dispatch row header: int tags[kDispatchTags], uint64 pos[K], int ids[K] (low_latency.cuh).
static_assert(kMaxParts == kDispatchTags, "every part of a dispatch row releases its own tags");
static_assert(kDispatchTags % 2 == 0, "the pos words are 8-byte aligned");
__device__ __forceinline__ unsigned long long* hdr_pos(int* hdr) {
  return reinterpret_cast<unsigned long long*>(hdr + kDispatchTags);
}
__device__ __forceinline__ const unsigned long long* hdr_pos(const int* hdr) {
  return reinterpret_cast<const unsigned long long*>(hdr + kDispatchTags);
}
__device__ __forceinline__ int* hdr_ids(int* hdr, int K) { return hdr + kDispatchTags + 2 * K; }
__device__ __forceinline__ const int* hdr_ids(const int* hdr, int K) {
  return hdr + kDispatchTags + 2 * K;
}

// Whether 32-bit epoch tag v is older than e32 (wrap-safe). A newer one passes: XLA may run a
// split receive twice, after the row was written again for call e + 2.
__device__ __forceinline__ bool tag_older(int v, unsigned int e32) {
#if JAX_EP_MUTATION == 4  // planted bug 4 (transport/peer.cuh): a tag of the half's last use
  e32 -= 2;
#endif
  return static_cast<int>(static_cast<unsigned int>(v) - e32) < 0;
}
// A word that carries its epoch (pos, count, data flag): (epoch << 32) | value.
__device__ __forceinline__ unsigned long long with_epoch(unsigned long long e, unsigned int v) {
  return (e << 32) | v;
}
// Whether such a word is older than call er (wrap-safe in the epoch's low 32 bits, as the tags).
__device__ __forceinline__ bool word_older(unsigned long long w, unsigned long long er) {
#if JAX_EP_MUTATION == 1  // planted bug 1 (transport/peer.cuh): a word of the half's last use
  er -= 2;
#endif
  return static_cast<int>(static_cast<unsigned int>(w >> 32) - static_cast<unsigned int>(er)) < 0;
}

// Whole warp: the output row (l * R*M + j) of the lead in lane sl (le, j: each lane's own).
__device__ __forceinline__ int64_t lead_row(int le, int j, int sl, int64_t RM) {
  return (int64_t)__shfl_sync(kFull, le, sl) * RM + __shfl_sync(kFull, j, sl);
}

// Whole warp: the n words of W at src, loaded once, to row lead_row(.., sl, ..) of dst (rows of
// n words) for every lead sl in mask.
template <typename W>
__device__ __forceinline__ void store_to_leads(const W* src, W* dst, int n, unsigned mask, int le,
                                               int j, int64_t RM, int lane) {
  for (int g0 = 0; g0 < n; g0 += 32) {  // warp-uniform
    const int g = g0 + lane;
    W v{};
    if (g < n) v = __ldcg(src + g);
    for (unsigned m = mask; m != 0; m &= m - 1) {  // warp-uniform
      const int64_t orow = lead_row(le, j, __ffs(m) - 1, RM);
      if (g < n) dst[orow * n + g] = v;
    }
  }
}

// Row t of sender s's area in a dispatch buffer (parity par), and the area's count block.
__device__ __forceinline__ uint8_t* dispatch_row(uint8_t* buf, const DispatchParams& p, int par,
                                                 int s, int t) {
  return buf + ((int64_t)par * p.ps.num_ranks + s) * p.area_bytes + (int64_t)t * p.row_bytes;
}
__device__ __forceinline__ unsigned long long* dispatch_counts(uint8_t* buf,
                                                               const DispatchParams& p, int par,
                                                               int s) {
  return reinterpret_cast<unsigned long long*>(
      buf + ((int64_t)par * p.ps.num_ranks + s) * p.area_bytes + (int64_t)p.M * p.row_bytes);
}

// The send phase has two item sets, taken by tickets, neither waiting on the other:
//   position (one per expert e, on rank q = e / L): ranks our tokens naming e (at their first
//     slot naming it) in token order, and writes each token's place into the pos word of that
//     slot in t's row header in q's buffer, and the number of such tokens into our count block
//     there, each word with the epoch. The receiver then knows every output row without atomics
//     (so a repeated receive is idempotent by construction) and without waiting for other rows.
//   send (token t, destination q, part): the ids and the payload, then the part's row tags; or,
//     when no expert of t lives on q, part 0 marks the row skipped (tags[0] = ~epoch).
__device__ __noinline__ void dispatch_position_item(const DispatchParams& p, int e, int par,
                                                    unsigned long long es, int lane) {
  const int r = p.ps.rank, q = e / p.L;
  int base = 0;
  for (int tb = 0; tb < p.T; tb += 32) {  // warp-uniform; lane = token
    const int t = tb + lane;
    int kf = -1;
    if (t < p.T) {
      const int32_t* ids = p.topk_idx + (int64_t)t * p.K;
#pragma unroll 8
      for (int k = p.K - 1; k >= 0; --k)  // independent loads; the first slot naming e wins
        if (__ldg(ids + k) == e) kf = k;
    }
    const unsigned b = __ballot_sync(kFull, kf >= 0);
    if (kf >= 0) {
      int* hdr = reinterpret_cast<int*>(dispatch_row(p.buf[q], p, par, r, t));
      st_relaxed_sys(hdr_pos(hdr) + kf, with_epoch(es, base + __popc(b & lanemask_lt())));
    }
    base += __popc(b);
  }
  if (lane == 0)
    st_relaxed_sys(dispatch_counts(p.buf[q], p, par, r) + (e - q * p.L),
                   with_epoch(es, static_cast<unsigned int>(base)));
}

// Whole warp: groups [g_begin, g_end) of bf16 row xr quantised into pay (e4m3) and sc (scales),
// 8 lanes per group (16-byte stores). The scales of an iteration's groups go out as one
// contiguous store (lane i: group g0 + i), not as a 4-byte remote store per group. At R = 4
// either change alone took the FP8 dispatch kernel from 30.5 to 28.7-28.8 us, both 28.6.
__device__ __forceinline__ void quantise_part(const uint8_t* xr, uint8_t* pay, float* sc,
                                              int g_begin, int g_end, bool round_scale, int lane) {
  const int quarter = lane >> 3, sub = lane & 7;
  for (int g0 = g_begin; g0 < g_end; g0 += 4 * kQuantUnits) {  // warp-uniform
    uint4 raw[kQuantUnits][2];
#pragma unroll
    for (int u = 0; u < kQuantUnits; ++u) {  // all loads first
      const int g = g0 + 4 * u + quarter;
      const uint4* src = reinterpret_cast<const uint4*>(xr + (g * fp8::kGroup + sub * 16) * 2);
      raw[u][0] = g < g_end ? __ldg(src) : make_uint4(0u, 0u, 0u, 0u);
      raw[u][1] = g < g_end ? __ldg(src + 1) : make_uint4(0u, 0u, 0u, 0u);
    }
    float scl[kQuantUnits];
#pragma unroll
    for (int u = 0; u < kQuantUnits; ++u) {
      scl[u] = 0.f;
      const int g = g0 + 4 * u + quarter;
      if (g0 + 4 * u >= g_end) continue;  // warp-uniform: no group of this u in any quarter
      scl[u] =
          fp8::quantise_group_slice(raw[u], round_scale, g < g_end, sub,
                                    reinterpret_cast<uint4*>(pay + g * fp8::kGroup + sub * 16));
    }
    float mine = 0.f;
#pragma unroll
    for (int u = 0; u < kQuantUnits; ++u) {  // lane i takes the scale of group g0 + i
      const float v = __shfl_sync(kFull, scl[u], (lane & 3) * 8);
      if ((lane >> 2) == u) mine = v;
    }
    if (lane < 4 * kQuantUnits && g0 + lane < g_end) sc[g0 + lane] = mine;
  }
}

// Send item it = (token t, destination q, part): q starts after our own rank so the ranks spread
// their first writes; `parts` warps share a row (part 0 also writes the ids). Skipped (and
// marked so) when no expert of t lives on q; else row t of our area in q's buffer gets the ids,
// the payload (FP8: quantised here, quantise_part; BF16: copied), then the part's tags.
template <typename V>
__device__ __noinline__ void dispatch_send_item(const DispatchParams& p, int it, int parts, int par,
                                                unsigned long long es, int lane) {
  const PeerSlots& ps = p.ps;
  const int R = ps.num_ranks, r = ps.rank;
  const int part = it % parts, tq = it / parts;
  const int t = tq / R, q = (tq % R + r + 1) % R;
  const int32_t* ids = p.topk_idx + (int64_t)t * p.K;
  bool any = false;
  for (int kb = 0; kb < p.K; kb += 32) {  // warp-uniform
    const int k = kb + lane;
    const int v = k < p.K ? __ldg(ids + k) : -1;
    any |= __ballot_sync(kFull, v >= 0 && v < p.E && v / p.L == q) != 0;
  }
  uint8_t* row = dispatch_row(p.buf[q], p, par, r, t);
  int* hdr = reinterpret_cast<int*>(row);
  if (!any) {  // skipped: the receiver need not wait for our data flag to know
    if (part == 0 && lane == 0) st_relaxed_sys_s32(hdr, ~static_cast<int>(es));
    return;
  }
  if (part == 0) {
    for (int k = lane; k < p.K; k += 32) {
      const int v = __ldg(ids + k);
      hdr_ids(hdr, p.K)[k] = (v >= 0 && v < p.E) ? v : -1;
    }
  }
  uint8_t* pay = row + p.hdr_bytes;
  const uint8_t* xr = static_cast<const uint8_t*>(p.x) + (int64_t)t * p.H * 2;
  if (p.use_fp8) {
    const int per = (p.G + parts - 1) / parts;
    const int g_begin = part * per, g_end = min(p.G, g_begin + per);
    float* sc = reinterpret_cast<float*>(pay + p.H);
    quantise_part(xr, pay, sc, g_begin, g_end, p.round_scale != 0, lane);
  } else {
    const int64_t nvec = 2LL * p.H / (int64_t)sizeof(V);
    const int64_t per = (nvec + parts - 1) / parts;
    const int64_t v0 = min(nvec, part * per), v1 = min(nvec, v0 + per);
    copy_row<V>(xr + v0 * sizeof(V), pay + v0 * sizeof(V), (v1 - v0) * sizeof(V), lane);
  }
  // Our tags once every lane's stores of the part are out (the warp barrier orders them before
  // the release stores): the receiver copies the row as soon as all tags are in.
  __syncwarp();
  if (lane < kDispatchTags && lane % parts == part) st_release_sys_s32(hdr + lane, (int)es);
}

// One lane: poll the epoch-carrying word w until it is of call er (a remote sender's, once its
// data flag is in: NVSHMEM puts it after the rest); trap after the timeout. Out of line: the
// callers keep their registers on the fast path.
__device__ __noinline__ unsigned long long wait_word_slow(const DispatchParams& p,
                                                          const unsigned long long* w, int s,
                                                          int par, unsigned long long er,
                                                          const char* what) {
  if (is_remote(p.ps, s))
    push::wait_data(p.ps, s, par, er, p.timeout_ns, "ll_dispatch: wait for the peers' rows");
  const uint64_t start = global_timer_ns();
  unsigned long long v;
  while (word_older(v = ld_relaxed_sys(w), er)) {
    __nanosleep(kPollSleepNs);
    if ((int64_t)(global_timer_ns() - start) > p.timeout_ns && first_timeout_report()) {
      printf(
          "jax_ep: rank %d timed out after %lld s in phase 'll_dispatch: wait for the peers' "
          "%s' waiting for rank %d (epoch %llu, seen %llu). A peer did not arrive: check "
          "that every rank runs the same program (JAX_EP_TIMEOUT_S sets the limit).\n",
          p.ps.rank, (long long)(p.timeout_ns / 1000000000LL), what, s, er, v >> 32);
      __trap();
    }
  }
  return v;
}

// One lane: the value of sender s's epoch-carrying word w in call er (waits for it).
__device__ __forceinline__ unsigned int word_of(const DispatchParams& p,
                                                const unsigned long long* w, int s, int par,
                                                unsigned long long er, const char* what) {
  unsigned long long v = ld_relaxed_sys(w);
  if (is_remote(p.ps, s) || word_older(v, er)) v = wait_word_slow(p, w, s, par, er, what);
  return static_cast<unsigned int>(v);
}

// Whole warp: the state of the row at hdr in call er from its tags: 1 sent (every tag is er),
// 0 skipped (tags[0] is ~er), -1 not known yet. Lanes < kDispatchTags load one tag each
// (acquire), then the warp synchronises: the row's loads come after.
__device__ __forceinline__ int row_state(const int* hdr, unsigned long long er, int lane) {
  const int e32 = static_cast<int>(er);
  const int v = lane < kDispatchTags ? ld_acquire_sys_s32(hdr + lane) : e32;
  if (__all_sync(kFull, v == e32)) return 1;
  return __shfl_sync(kFull, v, 0) == ~e32 ? 0 : -1;
}

// Whole warp: whether row t of local sender s (header hdr) was sent to us in call er, once its
// tags say so; a row past s's token count (s's data flag, written when its send started, says
// how many) never gets tags. A flag of a later call (XLA ran a split receive again after s
// sent into this half anew) ends the wait too: the row counts as sent when its tags are not
// older than er, as the combine lets a newer tag pass. Traps after the timeout.
__device__ __noinline__ bool wait_row_slow(const DispatchParams& p, const int* hdr, int s, int t,
                                           int par, unsigned long long er, int lane) {
  const uint64_t start = global_timer_ns();
  const unsigned long long* flag = &p.ps.slot[p.ps.rank]->data_flag[par][s];
  for (;;) {
    const int st = row_state(hdr, er, lane);
    if (st >= 0) return st == 1;
    int past = 0;  // 1: past s's token count; 2: s sent a later call into this half
    if (lane == 0) {
      const unsigned long long f = ld_relaxed_sys(flag);
      if (!word_older(f, er))
        past = static_cast<unsigned int>(f >> 32) != static_cast<unsigned int>(er) ? 2
               : t >= static_cast<int>(f & 0xffffffffu)                            ? 1
                                                                                   : 0;
    }
    past = __shfl_sync(kFull, past, 0);
    if (past == 1) return false;
    if (past == 2) {
      const int v = lane < kDispatchTags ? ld_acquire_sys_s32(hdr + lane) : static_cast<int>(er);
      return __all_sync(kFull, !tag_older(v, static_cast<unsigned int>(er)));
    }
    __nanosleep(kPollSleepNs);
    if (lane == 0 && (int64_t)(global_timer_ns() - start) > p.timeout_ns &&
        first_timeout_report()) {
      printf(
          "jax_ep: rank %d timed out after %lld s in phase 'll_dispatch: wait for the peers' "
          "rows' waiting for row %d of rank %d (epoch %llu, tag %d, flag epoch %llu). A peer "
          "did not arrive: check that every rank runs the same program (JAX_EP_TIMEOUT_S "
          "sets the limit).\n",
          p.ps.rank, (long long)(p.timeout_ns / 1000000000LL), t, s, er, ld_acquire_sys_s32(hdr),
          ld_acquire_sys(flag) >> 32);
      __trap();
    }
  }
}

// Whole warp: whether row t of sender s was sent to us in call er (waits until that is known).
__device__ __forceinline__ bool wait_row(const DispatchParams& p, const int* hdr, int s, int t,
                                         int par, unsigned long long er, int lane) {
  if (is_remote(p.ps, s)) {  // its rows arrive with its NVSHMEM push, before its flag
    if (lane == 0)
      push::wait_data(p.ps, s, par, er, p.timeout_ns, "ll_dispatch: wait for the peers' rows");
    __syncwarp();
    return row_state(hdr, er, lane) == 1;
  }
  const int st = row_state(hdr, er, lane);
  return st >= 0 ? st == 1 : wait_row_slow(p, hdr, s, t, par, er, lane);
}

// The receive phase is one set of items, taken by tickets as soon as a warp is done sending
// (no block-wide wait); each item waits only for the words it reads, none waits on another item
// or on a whole sender. The senders are ordered from our own rank (s = r, r + 1, ...):
//   copy (row (s, t), column part), our own rows first: wait until the row's tags say it was
//     sent to us or skipped (wait_row). Each slot naming a local expert first (the lead) gives
//     the output row: the counts of the senders before s plus the row's pos word (words that
//     carry their epoch, loaded at once: output_row_of). The payload part is loaded once and
//     stored to every lead's output row; part 0 also writes recv_src / recv_slot / src_rows and
//     the FP8 scales. Rows are thus copied while later rows are still on their way, not after
//     the senders' flags.
//   fill (local expert l, chunk c of its R*M entries), after our own rows: wait for every
//     sender's count of l; recv_count[l] (their sum) and -1 in recv_src / recv_slot past it.
// An expert's rows are thus ordered by sender from our own rank, then token.
__device__ __noinline__ void dispatch_fill_item(const DispatchParams& p, int l, int c, int par,
                                                unsigned long long er, int lane) {
  const int R = p.ps.num_ranks;
  const int64_t RM = (int64_t)R * p.M;
  int n = lane < R
              ? static_cast<int>(word_of(p, dispatch_counts(p.buf[p.ps.rank], p, par, lane) + l,
                                         lane, par, er, "counts"))
              : 0;
  n = __reduce_add_sync(kFull, n);
  if (c == 0 && lane == 0) p.recv_count[l] = n;
  const int64_t b = (int64_t)c * kFillInts, e = min(RM, b + kFillInts);
  for (int64_t i = max(b, (int64_t)n) + lane; i < e; i += 32) {
    p.recv_src[l * RM + i] = -1;
    p.recv_slot[l * RM + i] = -1;
  }
}

// Part 0 of a row not sent to us: its src_rows entries are -1 (the combine reads every one).
__device__ __forceinline__ void clear_src_rows(const DispatchParams& p, int s, int t, int lane) {
  for (int k = lane; k < p.K; k += 32) p.src_rows[((int64_t)s * p.M + t) * p.K + k] = -1;
}

// Out of line (a late word): output_row_of's sum, each word waited for in turn.
__device__ __noinline__ int output_row_slow(const DispatchParams& p, const int* hdr, int s, int kl,
                                            int le, int par, unsigned long long er, int rot) {
  const int R = p.ps.num_ranks;
  uint8_t* own = p.buf[p.ps.rank];
  int j = static_cast<int>(word_of(p, hdr_pos(hdr) + kl, s, par, er, "positions"));
  for (int o2 = 0; o2 < (s - rot + R) % R; ++o2) {
    const int s2 = (rot + o2) % R;
    j += static_cast<int>(word_of(p, dispatch_counts(own, p, par, s2) + le, s2, par, er, "counts"));
  }
  return j;
}

// Senders before s whose counts the copy loads at once (more: output_row_slow, in turn).
constexpr int kFastSenders = 3;

// One lane: the output row (within local expert le) of row hdr of sender s, whose first slot
// naming le is kl: s's pos word plus the counts for le of the senders before s (from rank rot),
// loaded at once up to kFastSenders senders before s, then checked; a late word, a remote
// sender (the slow path waits for its flag; a remote s: wait_row did) or more senders:
// output_row_slow.
__device__ __forceinline__ int output_row_of(const DispatchParams& p, const int* hdr, int s, int kl,
                                             int le, int par, unsigned long long er, int rot) {
  const int R = p.ps.num_ranks;
  const int ns = (s - rot + R) % R;
  uint8_t* own = p.buf[p.ps.rank];
  bool late = ns > kFastSenders;
  unsigned long long w[kFastSenders + 1];
  w[0] = ld_relaxed_sys(hdr_pos(hdr) + kl);
#pragma unroll
  for (int o2 = 0; o2 < kFastSenders; ++o2) {
    const int s2 = (rot + o2) % R;
    late |= o2 < ns && is_remote(p.ps, s2);
    w[o2 + 1] = o2 < ns && !late ? ld_relaxed_sys(dispatch_counts(own, p, par, s2) + le)
                                 : with_epoch(er, 0);
  }
  unsigned int j = 0;
#pragma unroll
  for (int o2 = 0; o2 <= kFastSenders; ++o2) {
    late |= word_older(w[o2], er);
    j += static_cast<unsigned int>(w[o2]);
  }
  return late ? output_row_slow(p, hdr, s, kl, le, par, er, rot) : static_cast<int>(j);
}

// Part 0 of a copy item, the lane of slot k (naming local expert le, -1: none; j: the output
// row of its lead, -1: dropped): src_rows of slot k, and recv_src / recv_slot of a lead's row.
__device__ __forceinline__ void write_row_indices(const DispatchParams& p, int s, int t, int k,
                                                  int le, int j, bool lead, int64_t RM) {
  if (k < p.K)
    p.src_rows[((int64_t)s * p.M + t) * p.K + k] = j >= 0 ? static_cast<int>(le * RM + j) : -1;
  if (lead && j >= 0) {
    p.recv_src[(int64_t)le * RM + j] = s * p.M + t;
    p.recv_slot[(int64_t)le * RM + j] = k;
  }
}

// Copy item: part `part` of `parts` of row t of sender s (its tags are in) to the output row of
// each local expert it names. rot: our rank (the first sender in the receive order).
template <typename VV>
__device__ __noinline__ void copy_row_part(const DispatchParams& p, int s, int t, int part,
                                           int parts, int64_t pay_bytes, unsigned long long er,
                                           int par, int rot, int lane) {
  const int r = p.ps.rank;
  const int64_t RM = (int64_t)p.ps.num_ranks * p.M;
  uint8_t* own = p.buf[r];
  const uint8_t* row = dispatch_row(own, p, par, s, t);
  const int* hdr = reinterpret_cast<const int*>(row);
  const uint8_t* pay = row + p.hdr_bytes;
  const VV* src = reinterpret_cast<const VV*>(pay);
  const int nvec = static_cast<int>(pay_bytes / (int64_t)sizeof(VV));
  const int per = (nvec + parts - 1) / parts;
  const int v0 = min(nvec, part * per), v1 = min(nvec, v0 + per);
  uint8_t* recv_x = static_cast<uint8_t*>(p.recv_x);
  for (int kb = 0; kb < p.K; kb += 32) {  // one pass when K <= 32
    const int k = kb + lane;
    const int le = k < p.K ? local_expert(__ldcg(hdr_ids(hdr, p.K) + k), p.E, p.L, r) : -1;
    const unsigned same = __match_any_sync(kFull, le);
    int kl = kb + __ffs(same) - 1;  // the lead: the first slot naming le (its pos word is set)
    if (le >= 0)
      for (int k2 = 0; k2 < kb; ++k2)  // earlier passes (K > 32 only)
        if (local_expert(__ldcg(hdr_ids(hdr, p.K) + k2), p.E, p.L, r) == le) {
          kl = k2;
          break;
        }
    const bool lead = le >= 0 && kl == k;
    int j = -1;  // every slot naming a local expert: the output row of its lead
    if (le >= 0) {
      j = output_row_of(p, hdr, s, kl, le, par, er, rot);
      if (j < 0 || j >= RM) j = -1;  // only a corrupt header gets here: drop, never overrun
    }
    if (part == 0) write_row_indices(p, s, t, k, le, j, lead, RM);
    if (!lead) j = -1;
    const unsigned mask = __ballot_sync(kFull, j >= 0);
    if (mask == 0) continue;
    for (int base = v0; base < v1; base += kCopyRegs * 32) {  // warp-uniform
      VV buf[kCopyRegs];
#pragma unroll
      for (int u = 0; u < kCopyRegs; ++u) {
        const int v = base + u * 32 + lane;
        if (v < v1) buf[u] = __ldcg(src + v);
      }
      for (unsigned m = mask; m != 0; m &= m - 1) {  // warp-uniform
        VV* d = reinterpret_cast<VV*>(recv_x + lead_row(le, j, __ffs(m) - 1, RM) * pay_bytes);
#pragma unroll
        for (int u = 0; u < kCopyRegs; ++u) {
          const int v = base + u * 32 + lane;
          if (v < v1) d[v] = buf[u];
        }
      }
    }
    if (p.use_fp8 && part == 0) {
      // The scales are loaded once, then stored to every lead's row (reloading them per lead
      // cost ~5 us of the receive at R = 4: a load round trip per lead, in series).
      const float* sc = reinterpret_cast<const float*>(pay + p.H);  // 16 B aligned (H % 128 == 0)
      if (p.G % 4 == 0 && (reinterpret_cast<uintptr_t>(p.recv_scales) & 15) == 0)
        store_to_leads(reinterpret_cast<const uint4*>(sc), reinterpret_cast<uint4*>(p.recv_scales),
                       p.G / 4, mask, le, j, RM, lane);
      else
        store_to_leads(sc, p.recv_scales, p.G, mask, le, j, RM, lane);
    }
  }
}

// Copy item, fast form: what copy_row_part does, with every load of the item issued at once
// after the row's tags: the ids and pos words (lane k: slot k), the counts of every local expert
// (lane l: expert l) of the senders before s, and the first kFastRegs vectors per lane of the
// part (part 0 of an FP8 row: and the scales). The output rows then come from shuffles: one
// load round trip where copy_row_part chains four (ids, words, payload, scales). Returns false,
// having written nothing, when a word is not of call er yet or the shape is not covered (K or L
// over 32, FP8 scales not in whole 16-byte vectors or over 32 of them, a remote sender, more
// than kFastSenders senders before s): the caller then runs copy_row_part.
template <typename VV>
__device__ __forceinline__ bool copy_row_fast(const DispatchParams& p, int s, int t, int part,
                                              int parts, int64_t pay_bytes, unsigned long long er,
                                              int par, int rot, int lane) {
  const int R = p.ps.num_ranks, r = p.ps.rank;
  const int ns = (s - rot + R) % R;  // senders before s in the receive order
  if (p.K > 32 || p.L > 32 || ns > kFastSenders || is_remote(p.ps, s)) return false;
  if (p.use_fp8 && (sizeof(VV) != 16 || p.G % 4 != 0 || p.G / 4 > 32 ||
                    (reinterpret_cast<uintptr_t>(p.recv_scales) & 15) != 0))
    return false;
  for (int o2 = 0; o2 < ns; ++o2)
    if (is_remote(p.ps, (rot + o2) % R)) return false;
  const int64_t RM = (int64_t)R * p.M;
  uint8_t* own = p.buf[r];
  const uint8_t* row = dispatch_row(own, p, par, s, t);
  const int* hdr = reinterpret_cast<const int*>(row);
  const VV* src = reinterpret_cast<const VV*>(row + p.hdr_bytes);
  // The parts split the payload exactly as copy_row_part does (another part of the row may
  // take that form), and part 0 copies the scales (FP8: 16-byte vectors right after it).
  const int npay = static_cast<int>(pay_bytes / (int64_t)sizeof(VV));
  const int nsc = p.use_fp8 && part == 0 ? p.G / 4 : 0;
  const int per = (npay + parts - 1) / parts;
  const int v0 = min(npay, part * per), v1 = min(npay, v0 + per);
  // Every address, then every load (no parameter is read between the loads).
  const bool slot = lane < p.K;
  const unsigned long long* cp[kFastSenders];
#pragma unroll
  for (int o2 = 0; o2 < kFastSenders; ++o2)
    cp[o2] = o2 < ns && lane < p.L ? dispatch_counts(own, p, par, (rot + o2) % R) + lane : nullptr;
  const int id = slot ? __ldcg(hdr_ids(hdr, p.K) + lane) : -1;
  const unsigned long long pw = slot ? ld_relaxed_sys(hdr_pos(hdr) + lane) : 0ull;
  unsigned long long cw[kFastSenders];
#pragma unroll
  for (int o2 = 0; o2 < kFastSenders; ++o2)
    cw[o2] = cp[o2] != nullptr ? ld_relaxed_sys(cp[o2]) : with_epoch(er, 0);
  VV buf[kFastRegs];
#pragma unroll
  for (int u = 0; u < kFastRegs; ++u) {
    const int v = v0 + u * 32 + lane;
    if (v < v1) buf[u] = __ldcg(src + v);
  }
  uint4 scv = make_uint4(0u, 0u, 0u, 0u);
  if (lane < nsc) scv = __ldcg(reinterpret_cast<const uint4*>(src + npay) + lane);
  // The lead of each slot's expert, and its output row: the lead's pos word plus the senders'
  // counts of that expert.
  const int le = local_expert(id, p.E, p.L, r);
  const int kl = __ffs(__match_any_sync(kFull, le)) - 1;
  const bool lead = le >= 0 && kl == lane;
  const unsigned long long lw = __shfl_sync(kFull, pw, kl);
  bool late = le >= 0 && word_older(lw, er);
  unsigned int jw = static_cast<unsigned int>(lw);
#pragma unroll
  for (int o2 = 0; o2 < kFastSenders; ++o2) {
    const unsigned long long c = __shfl_sync(kFull, cw[o2], le >= 0 ? le : 0);
    late |= le >= 0 && word_older(c, er);
    jw += static_cast<unsigned int>(c);
  }
  if (__any_sync(kFull, late)) return false;
  if (lane == 0) diag_max(p.ps, p.diag, trace::kDiagFastCopyWordsIn);
  int j = le >= 0 && jw < RM ? static_cast<int>(jw) : -1;  // >= RM: a corrupt header; drop
  if (part == 0) write_row_indices(p, s, t, lane, le, j, lead, RM);
  if (!lead) j = -1;
  const unsigned mask = __ballot_sync(kFull, j >= 0);
  VV* recv_x = static_cast<VV*>(p.recv_x);
  uint4* recv_sc = reinterpret_cast<uint4*>(p.recv_scales);
  for (int base = v0;; base += kFastRegs * 32) {   // warp-uniform; long parts load again
    for (unsigned m = mask; m != 0; m &= m - 1) {  // warp-uniform
      const int64_t orow = lead_row(le, j, __ffs(m) - 1, RM);
#pragma unroll
      for (int u = 0; u < kFastRegs; ++u) {
        const int v = base + u * 32 + lane;
        if (v < v1) recv_x[orow * npay + v] = buf[u];
      }
      if (base == v0 && lane < nsc) recv_sc[orow * nsc + lane] = scv;
    }
    if (base + kFastRegs * 32 >= v1) break;
#pragma unroll
    for (int u = 0; u < kFastRegs; ++u) {
      const int v = base + kFastRegs * 32 + u * 32 + lane;
      if (v < v1) buf[u] = __ldcg(src + v);
    }
  }
  return true;
}

// Copy item (row t of sender s, column part `part`, its tags are in): the fast form, else the
// general one.
template <typename VV>
__device__ __noinline__ void copy_item(const DispatchParams& p, int s, int t, int part, int parts,
                                       int64_t pay_bytes, unsigned long long er, int par,
                                       int lane) {
  const int r = p.ps.rank;
  if (lane == 0) diag_max(p.ps, p.diag, trace::kDiagItemDataIn);
  if (!copy_row_fast<VV>(p, s, t, part, parts, pay_bytes, er, par, r, lane))
    copy_row_part<VV>(p, s, t, part, parts, pay_bytes, er, par, r, lane);
}

// Closing step of the send phase (whole warp): num_invalid over our own ids.
__device__ __forceinline__ void dispatch_close_send(const DispatchParams& p, unsigned long long es,
                                                    int lane) {
  const PeerSlots& ps = p.ps;
  if (lane == 0) trace_mark_last(ps, trace::kLlDispatchSendDone);
  int c = 0;
  const int64_t n = (int64_t)p.T * p.K;
#pragma unroll 8
  for (int64_t i = lane; i < n; i += 32) {  // loads in flight together: this warp receives next
    const int v = __ldg(p.topk_idx + i);
    c += (v < -1 || v >= p.E) ? 1 : 0;
  }
  c = __reduce_add_sync(kFull, c);
  if (lane == 0) {
    p.stats[0] = c;
    p.stats[1] = static_cast<int>(es);  // the split receive takes the epoch from here
  }
}

template <typename V>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(const __grid_constant__ DispatchParams p) {
  const PeerSlots& ps = p.ps;
  const int R = ps.num_ranks;
  Slot* me = ps.slot[ps.rank];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned long long es = push::send_epoch(ps);
  const unsigned long long er =
      push::recv_epoch(ps, p.mode == push::kModeRecv ? p.ticket + 1 : nullptr);
  trace_mark(ps, trace::kLlDispatchStart);
  if (threadIdx.x == 0) diag_max(ps, p.diag, trace::kDiagLastBlockStart);

  if (p.mode & push::kModeSend) {
    const int par = static_cast<int>(es & 1);
    if ((int)threadIdx.x < R) {
      push::wait_freed(ps, threadIdx.x, es, p.timeout_ns, "ll_dispatch: receivers free the buffer");
      // Our token count to every receiver: its rows t >= T get no tags (rows are ready by
      // their tags, not by this flag, so it goes first; a remote receiver gets it after the
      // NVSHMEM puts instead).
      if (blockIdx.x == 0) push::signal_data(ps, threadIdx.x, par, es, p.T);
    }
    __shared__ unsigned int first_ticket;  // the block's first send tickets (one atomic)
    if (threadIdx.x == 0) first_ticket = push::take_block_tickets(me, push::kSend, kWarps);
    __syncthreads();
    if (threadIdx.x == 0) diag_max(ps, p.diag, trace::kDiagPastWaitFreed);
    const int rows = p.T * R;
    const int parts = row_parts(p.E, rows);
    const int n = p.E + rows * parts;  // >= 1: the close always runs
    bool closer = false;
    for (int fin = 0;; fin = 1) {  // warp-uniform
      const push::Take tk = push::send_take(me, first_ticket, warp, n, fin, lane);
      if (fin == 0 && lane == 0) diag_max(ps, p.diag, trace::kDiagFirstSendTicket);
      if (tk.it >= n) {
        closer = tk.closer;
        break;
      }
      if (tk.it < p.E)  // experts of the next rank first, as the send items
        dispatch_position_item(p, (tk.it + (ps.rank + 1) * p.L) % p.E, par, es, lane);
      else
        dispatch_send_item<V>(p, tk.it - p.E, parts, par, es, lane);
    }
    if (lane == 0) diag_max(ps, p.diag, trace::kDiagSendLoopDone);
    if (closer) dispatch_close_send(p, es, lane);
  }

  if (p.mode & push::kModeRecv) {
    const int par = static_cast<int>(er & 1);
    const int r = ps.rank;
    const int64_t RM = (int64_t)R * p.M;
    const int cpe = static_cast<int>((RM + kFillInts - 1) / kFillInts);
    const int nf = p.L * cpe;  // fill items
    const int rows = R * p.M;  // every (sender, token) row; wait_row skips those past its count
    const int parts = row_parts(nf, rows);
    const int n_own = p.M * parts;  // our own rows first: our own send wrote them
    const int n = nf + rows * parts;
    bool closer = false;
    for (int fin = 0;; fin = 1) {  // warp-uniform
      if (fin != 0 && lane == 0) diag_max(ps, p.diag, trace::kDiagReceiveItemDone);
      const push::Take tk = push::next_item(me, push::kRecv, n, fin, lane);
      if (fin == 0 && lane == 0) diag_max(ps, p.diag, trace::kDiagFirstReceiveTicket);
      if (tk.it >= n) {
        closer = tk.closer;
        break;
      }
      const int it = tk.it;
      if (it >= n_own && it < n_own + nf) {  // needs every sender's counts
        dispatch_fill_item(p, (it - n_own) / cpe, (it - n_own) % cpe, par, er, lane);
        if (it == n_own && lane == 0) trace_mark_last(ps, trace::kLlDispatchFirstFill);
      } else {
        const int ri = it < n_own ? it : it - nf;
        const int row = ri / parts, part = ri % parts;
        const int o = row / p.M, t = row - o * p.M;  // o: senders before s in our order
        const int s = (r + o) % R;
        const int* hdr = reinterpret_cast<const int*>(dispatch_row(p.buf[r], p, par, s, t));
        const bool sent = wait_row(p, hdr, s, t, par, er, lane);
        if (lane == 0 && fin == 0) diag_max(ps, p.diag, trace::kDiagFirstCopyPastRowWait);
        if (sent) {
          if (p.use_fp8 || sizeof(V) == sizeof(uint4))  // FP8 rows: 16-byte vectors
            copy_item<uint4>(p, s, t, part, parts, p.use_fp8 ? p.H : 2LL * p.H, er, par, lane);
          else
            copy_item<V>(p, s, t, part, parts, 2LL * p.H, er, par, lane);
        } else if (part == 0) {
          clear_src_rows(p, s, t, lane);
        }
      }
    }
    if (lane == 0) diag_max(ps, p.diag, trace::kDiagReceiveLoopDone);
    if (closer) {
      // every row and count of this half is read: the senders may write it again
      if (lane < R) push::signal_freed(ps, lane, er);
      if (lane == 0) trace_mark_last(ps, trace::kLlDispatchReceiveDone);
      if (lane == 0) diag_max(ps, p.diag, trace::kDiagCloserPastFreed);
    }
  }
  if (lane == 0) diag_max(ps, p.diag, trace::kDiagKernelExit);
  push::leave_kernel(ps, p.mode, es);
}

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
// The source decides the same from its topk_idx; it adds w * row for the rows and the partials
// as they are, in k order (the partial at slot a).

template <typename V>
struct LoOf;  // the low bytes (1 per column) of a vector V of bf16 columns
template <>
struct LoOf<uint4> {
  using T = uint2;
};
template <>
struct LoOf<uint2> {
  using T = unsigned int;
};
template <>
struct LoOf<unsigned int> {
  using T = unsigned short;
};
template <>
struct LoOf<unsigned short> {
  using T = unsigned char;
};

// float -> its bits rounded to the upper 24 (half away from zero; a NaN stays a NaN).
__device__ __forceinline__ unsigned int round24(float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return (u >> 8) | ((u & 0x7fffffu) != 0 ? 1u : 0u);
  return (u + 0x80u) >> 8;
}

// The low bytes as one integer (byte e: column e), and in / out of a vector register V (the
// receive keeps a partial's low bytes in the slot of its row batch).
__device__ __forceinline__ unsigned long long lo_bits(const uint2& l) {
  return l.x | (static_cast<unsigned long long>(l.y) << 32);
}
__device__ __forceinline__ unsigned long long lo_bits(unsigned int l) { return l; }
__device__ __forceinline__ unsigned long long lo_bits(unsigned short l) { return l; }
__device__ __forceinline__ unsigned long long lo_bits(unsigned char l) { return l; }
__device__ __forceinline__ void lo_make(unsigned long long b, uint2& l) {
  l = make_uint2(static_cast<unsigned int>(b), static_cast<unsigned int>(b >> 32));
}
__device__ __forceinline__ void lo_make(unsigned long long b, unsigned int& l) {
  l = static_cast<unsigned int>(b);
}
__device__ __forceinline__ void lo_make(unsigned long long b, unsigned short& l) {
  l = static_cast<unsigned short>(b);
}
__device__ __forceinline__ void lo_make(unsigned long long b, unsigned char& l) {
  l = static_cast<unsigned char>(b);
}
__device__ __forceinline__ void lo_park(unsigned long long b, uint4& v) {
  v.x = static_cast<unsigned int>(b);
  v.y = static_cast<unsigned int>(b >> 32);
}
__device__ __forceinline__ void lo_park(unsigned long long b, uint2& v) {
  v.x = static_cast<unsigned int>(b);
}
__device__ __forceinline__ void lo_park(unsigned long long b, unsigned int& v) {
  v = static_cast<unsigned int>(b);
}
__device__ __forceinline__ void lo_park(unsigned long long b, unsigned short& v) {
  v = static_cast<unsigned short>(b);
}
__device__ __forceinline__ unsigned long long lo_parked(const uint4& v) {
  return v.x | (static_cast<unsigned long long>(v.y) << 32);
}
__device__ __forceinline__ unsigned long long lo_parked(const uint2& v) { return v.x; }
__device__ __forceinline__ unsigned long long lo_parked(unsigned int v) { return v & 0xffffu; }
__device__ __forceinline__ unsigned long long lo_parked(unsigned short v) { return v & 0xffu; }

// Columns f (float) -> their 24-bit values: the upper 16 bits as a bf16 vector, the next 8 bits.
template <typename V>
__device__ __forceinline__ void split24(const float (&f)[sizeof(V) / 2], V& hi,
                                        typename LoOf<V>::T& lo) {
  constexpr int EPV = sizeof(V) / 2;
  float h[EPV];
  unsigned long long b = 0;
#pragma unroll
  for (int e = 0; e < EPV; ++e) {
    const unsigned int r = round24(f[e]);
    h[e] = __uint_as_float((r >> 8) << 16);  // a bf16 value: pack() keeps its bits
    b |= static_cast<unsigned long long>(r & 0xffu) << (8 * e);
  }
  pack(h, &hi);
  lo_make(b, lo);
}

// The inverse: hi (a bf16 vector) and the low bytes b -> the columns' float values.
template <typename V>
__device__ __forceinline__ void join24(const V& hi, unsigned long long b,
                                       float (&f)[sizeof(V) / 2]) {
  constexpr int EPV = sizeof(V) / 2;
  unpack(hi, f);
#pragma unroll
  for (int e = 0; e < EPV; ++e)
    f[e] = __uint_as_float(__float_as_uint(f[e]) |
                           (static_cast<unsigned int>((b >> (8 * e)) & 0xffu) << 8));
}

// Row (t, k) of parity par in a combine buffer, the tag of its column part, s's weights and their
// flag. A tag holds the epoch (low 32 bits) of the call whose part is in place, written by the
// expert rank after the part (release): the source reduces a token as soon as its rows are in,
// while other rows are still on their way.
__device__ __forceinline__ uint8_t* combine_row(uint8_t* buf, const CombineParams& p, int par,
                                                int t, int k) {
  return buf + (((int64_t)par * p.M + t) * p.K + k) * combine_row_bytes(p.H);
}
__device__ __forceinline__ int* combine_tag(uint8_t* buf, const CombineParams& p, int par, int t,
                                            int k, int part) {
  return reinterpret_cast<int*>(buf + combine_tags_offset(p.M, p.K, p.H)) +
         (((int64_t)par * p.M + t) * p.K + k) * kCombineParts + part;
}
__device__ __forceinline__ float* combine_weights(uint8_t* buf, const CombineParams& p, int par,
                                                  int s) {
  return reinterpret_cast<float*>(buf + combine_weights_offset(p.M, p.K, p.H)) +
         ((int64_t)par * p.ps.num_ranks + s) * p.M * p.K;
}
__device__ __forceinline__ int* combine_wflag(uint8_t* buf, const CombineParams& p, int par,
                                              int s) {
  return reinterpret_cast<int*>(buf + combine_wflags_offset(p.ps.num_ranks, p.M, p.K, p.H)) +
         par * p.ps.num_ranks + s;
}

// One lane: wait until *tag is not older than e32; trap after the timeout (what / t / k say
// which wait: the first thread to time out reports). The poll loop is out of line: the callers
// keep their registers on the fast path.
__device__ __noinline__ void wait_tag_slow(const CombineParams& p, const int* tag, unsigned int e32,
                                           const char* what, int t, int k) {
  const uint64_t start = global_timer_ns();
  while (tag_older(ld_acquire_sys_s32(tag), e32)) {
    __nanosleep(kPollSleepNs);  // leave the issue slots and memory pipes to the senders
    if ((int64_t)(global_timer_ns() - start) > p.timeout_ns && first_timeout_report()) {
      printf(
          "jax_ep: rank %d timed out after %lld s in phase 'll_combine: %s' (token %d, slot "
          "%d, epoch %u, tag %d). A peer did not send it: check that every rank runs the "
          "same program and that combine gets the dispatch's topk_idx and handle "
          "(JAX_EP_TIMEOUT_S sets the limit).\n",
          p.ps.rank, (long long)(p.timeout_ns / 1000000000LL), what, t, k, e32,
          ld_acquire_sys_s32(tag));
      __trap();
    }
  }
}
__device__ __forceinline__ void wait_tag(const CombineParams& p, const int* tag, unsigned int e32,
                                         const char* what, int t, int k) {
  if (tag_older(ld_acquire_sys_s32(tag), e32)) wait_tag_slow(p, tag, e32, what, t, k);
}

// Send side, source role (one warp per expert rank q, at the start): our weights into q's buffer,
// then their flag (the warp barrier orders every lane's stores before lane 0's release store).
__device__ __forceinline__ void combine_send_weights(const CombineParams& p, int q, int par,
                                                     unsigned long long es, int lane) {
  float* dst = combine_weights(p.buf[q], p, par, p.ps.rank);
  const int n = p.T * p.K;
  if ((n & 3) == 0 &&
      ((reinterpret_cast<uintptr_t>(p.topk_weights) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0)
    for (int i = lane; i < n / 4; i += 32)
      reinterpret_cast<uint4*>(dst)[i] = __ldg(reinterpret_cast<const uint4*>(p.topk_weights) + i);
  else
    for (int i = lane; i < n; i += 32) dst[i] = __ldg(p.topk_weights + i);
  __syncwarp();
  if (lane == 0)
    st_release_sys_s32(combine_wflag(p.buf[q], p, par, p.ps.rank), static_cast<int>(es));
}

// Whole warp: columns [v0, v1) (vectors V) of the partial sum_k w_k * y[row_k] over the slots
// in `has` (lane k: row_k, w_k), in k order, split into hi / lo (split24). kU vectors per lane
// per pass, one slot's loads at a time: loading 2 or 4 slots at once (more registers, spills)
// made the combine 4-7 us slower at R = 4 (docs/design.md#rejected-partial-loads).
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
  for (int kb = 0; kb < p.K; kb += 32) {  // one pass when K <= 32 (partials need K <= 32)
    const int k = kb + lane;
    const int rr = k < p.K ? __ldg(rows + k) : -1;
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
                 "wait for the source's weights", t, -1);
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
  const int v = lane < p.K ? __ldg(p.topk_idx + (int64_t)t * p.K + lane) : -1;
  const bool valid = v >= 0 && v < p.E;
  const float w = valid ? __ldg(p.topk_weights + (int64_t)t * p.K + lane) : 0.f;
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
  const int32_t* ids = p.topk_idx + (int64_t)t * p.K;
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
                        valid ? __ldg(p.topk_weights + (int64_t)t * p.K + k) : 0.f);
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
               "wait for the expert outputs", t, k);
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
    if ((int)threadIdx.x < R)
      push::wait_freed(ps, threadIdx.x, es, p.timeout_ns, "ll_combine: sources free the buffer");
    if (p.ticket != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
      p.ticket[0] = static_cast<int>(es);  // the split receive takes the epoch from here
    __shared__ unsigned int first_ticket;  // the block's first send tickets (one atomic)
    if (threadIdx.x == 0) first_ticket = push::take_block_tickets(me, push::kSend, kWarps);
    __syncthreads();
    // Parts per (source, token): as many as the grid's warps take in one round (a second round
    // doubles the phase), a power of two <= kCombineParts.
    int parts = kCombineParts;
    while (parts > 1 && R * p.M * parts > static_cast<int>(gridDim.x) * kWarps) parts >>= 1;
    const int n = R * p.M * parts;
    unsigned wseen = 0;
    for (int fin = 0;; fin = 1) {  // warp-uniform
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
  push::leave_kernel(ps, p.mode, es);
}

// One kernel launch behind the gate of the one-GPU multi-rank mode (runtime/virtual_ranks.h).
template <typename Params>
void launch_gated(void (*kernel)(Params), const char* name, int grid, const Params& p,
                  cudaStream_t stream) {
  if (may_launch(reinterpret_cast<const void*>(kernel), name, grid, kThreads, 0))
    kernel<<<grid, kThreads, 0, stream>>>(p);
}

// Widest vector (bytes) dividing every value.
int vec_bytes(std::initializer_list<uintptr_t> vals) {
  int vw = 16;
  for (uintptr_t v : vals)
    while (vw > 2 && (v & (vw - 1))) vw >>= 1;
  return vw;
}

}  // namespace

int64_t dispatch_header_bytes(int64_t K) { return align16(4 * kDispatchTags + 12 * K); }
int64_t dispatch_row_bytes(int64_t K, int64_t H, bool use_fp8) {
  return dispatch_header_bytes(K) + align16(use_fp8 ? H + 4 * (H / 128) : 2 * H);
}
int64_t dispatch_count_bytes(int64_t L) { return align16(8 * L); }
int64_t dispatch_area_bytes(int64_t M, int64_t K, int64_t H, int64_t L, bool use_fp8) {
  return M * dispatch_row_bytes(K, H, use_fp8) + dispatch_count_bytes(L);
}
int64_t dispatch_buffer_bytes(int64_t R, int64_t M, int64_t K, int64_t H, int64_t L, bool use_fp8) {
  return 2 * R * dispatch_area_bytes(M, K, H, L, use_fp8);
}
int64_t combine_buffer_bytes(int64_t R, int64_t M, int64_t K, int64_t H) {
  return combine_wflags_offset(R, M, K, H) + align16(2 * R * 4);  // rows, tags, weights, flags
}

// Neither kernel holds every SM: one that did while it spins on its peers could starve a kernel
// that XLA runs beside it (a NCCL collective on another stream) and that the peers wait on.
// Work is taken by tickets, so blocks that are not resident only cost time.
// The dispatch: three quarters of the SMs. At R = 4 on H200 it took 26.9 us on 99 blocks and
// 29.0 on 132 (docs/design.md#grid-sizes).
int dispatch_grid_size(int device) {
  const int sms = jax_ep::sm_count(device);
  return sms * 3 / 4 > 0 ? sms * 3 / 4 : (sms > 0 ? 1 : 0);
}
// The combine: all SMs but kCombineFreeSms (at least three quarters). More warps take more
// column parts of a (source, token) in one round: at R = 4, M = 128 on H200, 128 blocks give 4
// parts where 99 gave 2, and the kernel took 37.6 us against 41.0 (docs/design.md#grid-sizes).
constexpr int kCombineFreeSms = 4;
int combine_grid_size(int device) {
  return std::max(dispatch_grid_size(device), jax_ep::sm_count(device) - kCombineFreeSms);
}

cudaError_t launch_dispatch(const DispatchParams& p, int grid, cudaStream_t stream) {
  // V: the BF16 payload copies (x rows, recv_x rows); FP8 rows always move as 16-byte vectors.
  const int vw = p.use_fp8 ? 16
                           : vec_bytes({(uintptr_t)(2 * p.H), reinterpret_cast<uintptr_t>(p.x),
                                        reinterpret_cast<uintptr_t>(p.recv_x)});
  launch_gated(vw == 16  ? dispatch_kernel<uint4>
               : vw == 8 ? dispatch_kernel<uint2>
               : vw == 4 ? dispatch_kernel<unsigned int>
                         : dispatch_kernel<unsigned short>,
               "low-latency dispatch", grid, p, stream);
  return cudaGetLastError();
}

cudaError_t launch_combine(const CombineParams& p, int grid, cudaStream_t stream) {
  const int vw = vec_bytes(
      {(uintptr_t)(2 * p.H), reinterpret_cast<uintptr_t>(p.y), reinterpret_cast<uintptr_t>(p.out)});
  launch_gated(vw == 16  ? combine_kernel<uint4>
               : vw == 8 ? combine_kernel<uint2>
               : vw == 4 ? combine_kernel<unsigned int>
                         : combine_kernel<unsigned short>,
               "low-latency combine", grid, p, stream);
  return cudaGetLastError();
}

}  // namespace ll
}  // namespace jax_ep
