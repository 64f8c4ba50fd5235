// Low-latency dispatch kernel: push protocol over peer memory (transport/push.cuh).
// One kernel runs the send phase, the receive phase, or both (the fused op). Contract:
// docs/ffi.md. Design notes: docs/kernels.md ("Low-latency kernels").
#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/geometry.cuh"

namespace jax_ep {
namespace ll {
namespace {

// ---------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------

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
// data flag is in: NVSHMEM puts it after the rest). A wait that gave up reads as 0 (no rows, an
// offset of 0): every output row index stays in bounds. Out of line: the callers keep their
// registers on the fast path.
__device__ __noinline__ unsigned long long wait_word_slow(const DispatchParams& p,
                                                          const unsigned long long* w, int s,
                                                          int par, unsigned long long er,
                                                          const char* what) {
  if (is_remote(p.ps, s) &&
      !push::wait_data(p.ps, s, par, er, p.timeout_ns, "ll_dispatch: wait for the peers' rows"))
    return 0;
  unsigned long long v = ld_relaxed_sys(w);
  if (!word_older(v, er)) return v;
  Patience wait;
  while (word_older(v = ld_relaxed_sys(w), er)) {
    __nanosleep(kPollSleepNs);
    if (wait.gives_up(p.ps, p.timeout_ns, WaitSite{what, s, er, v >> 32})) return 0;
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
// older than er, as the combine lets a newer tag pass. Not sent when the wait gave up.
__device__ __noinline__ bool wait_row_slow(const DispatchParams& p, const int* hdr, int s, int t,
                                           int par, unsigned long long er, int lane) {
  Patience wait;
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
    int stop = 0;
    if (lane == 0)
      stop = wait.gives_up(p.ps, p.timeout_ns,
                           WaitSite{"ll_dispatch: wait for the peers' rows", s, er,
                                    static_cast<unsigned int>(ld_acquire_sys_s32(hdr))});
    if (__shfl_sync(kFull, stop, 0)) return false;
  }
}

// Whole warp: whether row t of sender s was sent to us in call er (waits until that is known).
__device__ __forceinline__ bool wait_row(const DispatchParams& p, const int* hdr, int s, int t,
                                         int par, unsigned long long er, int lane) {
  if (is_remote(p.ps, s)) {  // its rows arrive with its NVSHMEM push, before its flag
    int in = 0;
    if (lane == 0)
      in = push::wait_data(p.ps, s, par, er, p.timeout_ns, "ll_dispatch: wait for the peers' rows");
    __syncwarp();  // lane 0's acquire comes before every lane's tag load (a shuffle orders none)
    if (!__shfl_sync(kFull, in, 0)) return false;
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
                                         lane, par, er, "ll_dispatch: wait for the peers' counts"))
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
  int j = static_cast<int>(
      word_of(p, hdr_pos(hdr) + kl, s, par, er, "ll_dispatch: wait for the peers' positions"));
  for (int o2 = 0; o2 < (s - rot + R) % R; ++o2) {
    const int s2 = (rot + o2) % R;
    j += static_cast<int>(word_of(p, dispatch_counts(own, p, par, s2) + le, s2, par, er,
                                  "ll_dispatch: wait for the peers' counts"));
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
    bool freed = true;
    if ((int)threadIdx.x < R) {
      freed = push::wait_freed(ps, threadIdx.x, es, p.timeout_ns,
                               "ll_dispatch: receivers free the buffer");
      // Our token count to every receiver: its rows t >= T get no tags (rows are ready by
      // their tags, not by this flag, so it goes first; a remote receiver gets it after the
      // NVSHMEM puts instead).
      if (freed && blockIdx.x == 0) push::signal_data(ps, threadIdx.x, par, es, p.T);
    }
    __shared__ unsigned int first_ticket;  // the block's first send tickets (one atomic)
    if (threadIdx.x == 0) first_ticket = push::take_block_tickets(me, push::kSend, kWarps);
    // A receiver never freed its half (the wait gave up): this block sends nothing.
    const bool held = __syncthreads_or(!freed);
    if (threadIdx.x == 0) diag_max(ps, p.diag, trace::kDiagPastWaitFreed);
    const int rows = p.T * R;
    const int parts = row_parts(p.E, rows);
    const int n = p.E + rows * parts;  // >= 1: the close always runs
    bool closer = false;
    for (int fin = 0; !held; fin = 1) {  // warp-uniform
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
  push::leave_kernel(ps, p.mode, es, p.outputs);
}

}  // namespace

// Neither kernel holds every SM: one that did while it spins on its peers could starve a kernel
// that XLA runs beside it (a NCCL collective on another stream) and that the peers wait on.
// Work is taken by tickets, so blocks that are not resident only cost time.
// The dispatch: three quarters of the SMs. At R = 4 on H200 it took 26.9 us on 99 blocks and
// 29.0 on 132 (docs/design.md#grid-sizes).
int dispatch_grid_size(int sms) { return sms * 3 / 4 > 0 ? sms * 3 / 4 : (sms > 0 ? 1 : 0); }

cudaError_t launch_dispatch(const DispatchParams& p, int grid, cudaStream_t stream) {
  // V: the BF16 payload copies (x rows, recv_x rows); FP8 rows always move as 16-byte vectors.
  const int vw = p.use_fp8 ? 16
                           : vec_bytes({(uintptr_t)(2 * p.H), reinterpret_cast<uintptr_t>(p.x),
                                        reinterpret_cast<uintptr_t>(p.recv_x)});
  // The results a wait that gave up poisons (transport/poison.cuh).
  DispatchParams q = p;
  q.outputs = {};
  const int64_t RM = static_cast<int64_t>(p.ps.num_ranks) * p.M, LRM = p.L * RM;
  if (p.mode & push::kModeSend) poison::add(q.outputs, p.stats, 2 * 4);
  if (p.mode & push::kModeRecv) {
    poison::add(q.outputs, p.recv_x, LRM * p.H * (p.use_fp8 ? 1 : 2));
    poison::add(q.outputs, p.recv_scales, LRM * p.G * 4);
    poison::add(q.outputs, p.recv_count, static_cast<int64_t>(p.L) * 4);
    poison::add(q.outputs, p.recv_src, LRM * 4);
    poison::add(q.outputs, p.recv_slot, LRM * 4);
    poison::add(q.outputs, p.src_rows, RM * p.K * 4);
  }
  launch_gated(JAX_EP_LL_BY_VEC_WIDTH(dispatch_kernel, vw), "low-latency dispatch", grid, kThreads,
               0, stream, q);
  return cudaGetLastError();
}

}  // namespace ll
}  // namespace jax_ep
