// High-throughput dispatch and gather over peer memory (one process, pull design): the layout
// kernel and the row copy. Every op: publish own operand addresses -> wait until every peer
// published (same epoch) -> read peers' buffers through peer pointers, write own results only ->
// end_barrier. See docs/kernels.md ("High-throughput kernels") and docs/ffi.md for the contract;
// the combine: combine.cu.
#include "kernels/expert_ids.cuh"
#include "kernels/high_throughput.cuh"
#include "kernels/high_throughput/common.cuh"
#include "kernels/launch.cuh"
#include "transport/poison.cuh"

namespace jax_ep {
namespace ht {
namespace {

// ------------------------------------------------------------------------------------------
// Dispatch, kernel 1: layout. grid = R * nch blocks (<= #SMs, co-resident; one grid barrier).
// Block b = s * nch + c handles tokens [c*chunk, min(T, (c+1)*chunk)) of source rank s, in
// sub-chunks of kLayoutThreads tokens (one thread per token). Since blocks are ordered by
// (source, token), the row offset of block b on rank q is sum_{b' < b} cnt[b'][q].
// Scratch (int32 words): mask u8 [R*T] (bit q: token goes to rank q) in the first
// ceil(R*T/4) words, then cnt[R*nch][R], then inv[nch] (invalid ids of own chunks).
// ------------------------------------------------------------------------------------------

// Block-wide copy of n 32-bit words from global (peer) memory into shared memory, for one or
// two arrays at once (sb == nullptr: one), so both arrays' loads are in flight together.
// vec: sa, sb (when given) and da, db are 16-byte aligned.
__device__ __forceinline__ void stage_words(int32_t* __restrict__ da, const int32_t* sa,
                                            int32_t* __restrict__ db, const int32_t* sb, int n,
                                            bool vec) {
  const int tid = threadIdx.x, bd = blockDim.x;
  int done = 0;
  if (vec) {
    const int nv = n >> 2;
    const int4* va = reinterpret_cast<const int4*>(sa);
    const int4* vb = reinterpret_cast<const int4*>(sb);
    int4* wa = reinterpret_cast<int4*>(da);
    int4* wb = reinterpret_cast<int4*>(db);
    for (int base = tid; base < nv; base += 2 * bd) {
      int4 x[2], y[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = base + u * bd;
        if (i < nv) {
          x[u] = ld_nc_v4(va + i);
          if (sb != nullptr) y[u] = ld_nc_v4(vb + i);
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = base + u * bd;
        if (i < nv) {
          wa[i] = x[u];
          if (sb != nullptr) wb[i] = y[u];
        }
      }
    }
    done = nv << 2;
  }
  for (int i = done + tid; i < n; i += bd) {
    const int x = ld_nc_s32(sa + i);
    const int y = sb != nullptr ? ld_nc_s32(sb + i) : 0;
    da[i] = x;
    if (sb != nullptr) db[i] = y;
  }
}

// Rows each source keeps on receiver q (jax_ep/reference.py fair_quotas, the spec): all when
// sum(n) <= C; else min(n[s], level) with the largest level that fits, and the rows left over
// one each to the sources above the level, in the order q + 1, q + 2, ... (mod R).
__device__ void fair_quotas(const int* n, int R, int C, int q, int* k) {
  long long tot = 0;
  int hi = 0;
  for (int i = 0; i < R; ++i) {
    tot += n[i];
    hi = max(hi, n[i]);
  }
  int lo = 0;
  if (tot <= C) {
    lo = hi;
  } else {
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      long long sum = 0;
      for (int i = 0; i < R; ++i) sum += min(n[i], mid);
      if (sum <= C)
        lo = mid;
      else
        hi = mid - 1;
    }
  }
  long long left = C;
  for (int i = 0; i < R; ++i) {
    k[i] = min(n[i], lo);
    left -= k[i];
  }
  for (int i = 0; i < R && left > 0; ++i) {
    const int src = (q + 1 + i) % R;
    if (n[src] > lo) {
      ++k[src];
      --left;
    }
  }
}

__global__ void __launch_bounds__(kLayoutThreads, 1) dispatch_layout_kernel(DispatchArgs a) {
  const PeerSlots& ps = a.ps;
  const int R = ps.num_ranks, me = ps.rank;
  const int T = a.T, K = a.K, E = a.E, L = a.L, C = a.C;
  const int nch = a.plan.nch, chunk = a.plan.chunk;
  const int nblk = static_cast<int>(gridDim.x);  // == R * nch
  const int b = blockIdx.x, s = b / nch, c = b % nch;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const unsigned long long e = call_epoch(ps);
  const int64_t c0 = static_cast<int64_t>(c) * chunk;
  const int t_begin = c0 < T ? static_cast<int>(c0) : T;
  const int64_t c1 = static_cast<int64_t>(t_begin) + chunk;
  const int t_end = c1 < T ? static_cast<int>(c1) : T;
  const int nsub = (t_end - t_begin + kLayoutThreads - 1) / kLayoutThreads;
  trace_mark(ps, trace::kLayoutStart);

  extern __shared__ int4 s_dyn[];  // [kLayoutThreads * K] ids, then [kLayoutThreads * K] weights
  const bool use_smem = static_cast<int64_t>(kLayoutThreads) * K * 8 <= kLayoutSmemBytes;
  int32_t* s_idx = reinterpret_cast<int32_t*>(s_dyn);
  int32_t* s_wt = s_idx + kLayoutThreads * K;

  __shared__ int s_cnt[kMaxRanks];
  __shared__ int s_off[kMaxRanks];
  __shared__ int s_n[kMaxRanks][kMaxRanks];      // [source][receiver]: tokens, all chunks
  __shared__ int s_quota[kMaxRanks][kMaxRanks];  // [source][receiver]: rows kept (fair_quotas)
  __shared__ int s_invalid;
  __shared__ int s_inv_tot;
  __shared__ int s_wtot[kMaxRanks][32];
  __shared__ int s_wpre[kMaxRanks][32];
  __shared__ int s_ctot[kMaxRanks];
  __shared__ int s_tpe[kMaxLocalExperts];
  __shared__ const int32_t* s_idx_ptr;
  __shared__ const float* s_w_ptr;

  const bool tpe_smem = L <= kMaxLocalExperts;
  if (tid < kMaxRanks) s_cnt[tid] = s_off[tid] = 0;
  if (tid < kMaxRanks * kMaxRanks) s_n[tid / kMaxRanks][tid % kMaxRanks] = 0;
  if (tid == 0) s_invalid = s_inv_tot = 0;
  if (tpe_smem)
    for (int l = tid; l < L; l += blockDim.x) s_tpe[l] = 0;
  // Zeroed before the grid barrier; every block adds to it after.
  if (b == 0)
    for (int l = tid; l < L; l += blockDim.x) a.recv_tokens_per_expert[l] = 0;

  const void* ptrs[kNumDispatchPtrs] = {a.x, a.x_scales, a.topk_idx, a.topk_weights};
  if (!publish_and_wait(ps, ptrs, kNumDispatchPtrs, e, a.timeout_ns, "ht_dispatch: wait for peers"))
    return;
  trace_mark(ps, trace::kLayoutPeersReady);
  if (tid == 0) {
    s_idx_ptr = peer_ptr<const int32_t>(ps, s, kPtrTopkIdx);
    s_w_ptr = peer_ptr<const float>(ps, s, kPtrTopkWeights);
  }
  __syncthreads();
  const int32_t* idx_s = s_idx_ptr;
  const float* w_s = s_w_ptr;
  // Chunks start at multiples of 32 tokens and sub-chunks at multiples of 256 after them, so
  // a sub-chunk's first word (t * K) is a multiple of 4: 16-byte loads when the bases allow.
  const bool vec = aligned16(idx_s) && aligned16(w_s);

  uint8_t* mask_s = reinterpret_cast<uint8_t*>(a.scratch) + static_cast<int64_t>(s) * T;
  int32_t* cnt = a.scratch + (static_cast<int64_t>(R) * T + 3) / 4;  // cnt[b][q]
  int32_t* inv_c = cnt + static_cast<int64_t>(nblk) * R;             // inv[c] (s == me)

  // Stages ids (and weights when with_w) of tokens [ts, ts + n) of source s in shared memory.
  auto stage = [&](int ts, int n, bool with_w) {
    const int64_t w0 = static_cast<int64_t>(ts) * K;
    stage_words(s_idx, idx_s + w0, s_wt,
                with_w ? reinterpret_cast<const int32_t*>(w_s) + w0 : nullptr, n * K, vec);
  };

  // Phase 1: destination mask of every token of the chunk, counts per destination, invalid ids.
  int lc[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) lc[q] = 0;
  int inv = 0;
  for (int ts = t_begin; ts < t_end; ts += kLayoutThreads) {
    const int n = min(kLayoutThreads, t_end - ts);
    // With a single sub-chunk the weights stay in shared memory for phase 2.
    if (use_smem) {
      stage(ts, n, nsub == 1);
      __syncthreads();
    }
    if (tid < n) {
      const int t = ts + tid;
      const int32_t* row = use_smem ? s_idx + tid * K : idx_s + static_cast<int64_t>(t) * K;
      uint32_t m = 0;
      for (int k = 0; k < K; ++k) {
        const int raw = row[k];
        if (expert_id_invalid(raw, E))
          ++inv;
        else if (raw >= 0)
          m |= 1u << (raw / L);
      }
      mask_s[t] = static_cast<uint8_t>(m);  // read back in phase 2 by this same thread
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) lc[q] += (m >> q) & 1u;
    }
    if (use_smem && nsub > 1) __syncthreads();  // the next sub-chunk overwrites the staging
  }
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    const int v = warp_sum(lc[q]);
    if (lane == 0 && v != 0) atomicAdd(&s_cnt[q], v);
  }
  inv = warp_sum(inv);
  if (lane == 0 && inv != 0) atomicAdd(&s_invalid, inv);
  __syncthreads();
  if (tid < R) cnt[static_cast<int64_t>(b) * R + tid] = s_cnt[tid];
  if (s == me && tid == 0) inv_c[c] = s_invalid;
  trace_mark(ps, trace::kLayoutCounts);
  if (!grid_barrier(ps, 1, a.timeout_ns, "ht_dispatch: layout grid barrier")) return;
  trace_mark(ps, trace::kLayoutGridBarrier);

  // Phase 2: the tokens of every (source, receiver), the rows each source keeps on each receiver
  // (fair_quotas: short of capacity, every source keeps a fair share), this block's offsets
  // (the kept rows of earlier sources, then of this source's earlier chunks), then rows by a
  // block scan of the masks (ballot + popc per rank), sub-chunk by sub-chunk.
  {
    int before[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) before[q] = 0;
    int itot = 0;
    for (int b2 = tid; b2 < nblk; b2 += blockDim.x) {
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        if (q < R) {
          const int v = __ldcg(cnt + static_cast<int64_t>(b2) * R + q);
          if (b2 < b && b2 >= s * nch) before[q] += v;
          if (v != 0) atomicAdd(&s_n[b2 / nch][q], v);
        }
      }
    }
    if (s == me && c == 0)
      for (int c2 = tid; c2 < nch; c2 += blockDim.x) itot += __ldcg(inv_c + c2);
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      const int v = warp_sum(before[q]);
      if (lane == 0 && v != 0) atomicAdd(&s_off[q], v);
    }
    itot = warp_sum(itot);
    if (lane == 0 && itot != 0) atomicAdd(&s_inv_tot, itot);
    __syncthreads();
  }
  if (tid < R) {  // one thread per receiver
    int n[kMaxRanks], k[kMaxRanks];
    for (int i = 0; i < R; ++i) n[i] = s_n[i][tid];
    fair_quotas(n, R, C, tid, k);
    for (int i = 0; i < R; ++i) s_quota[i][tid] = k[i];
  }
  __syncthreads();
  // Rows of this block on receiver q: from off[q]; this source's rows end at lim[q].
  int off[kMaxRanks], running[kMaxRanks], lim[kMaxRanks];
  int total_me = 0, recv_count = 0;
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    int base = 0;
    for (int i = 0; i < s && q < R; ++i) base += s_quota[i][q];
    off[q] = base + s_off[q];
    lim[q] = q < R ? base + s_quota[s][q] : 0;
    running[q] = 0;
  }
  for (int i = 0; i < R; ++i) {
    total_me += s_n[i][me];
    recv_count += s_quota[i][me];
  }
  int lim_me = 0;  // (no dynamic index into lim: it stays in registers)
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q)
    if (q == me) lim_me = lim[q];
  const unsigned lanes_below = (1u << lane) - 1u;
  int32_t* tpe_counter = tpe_smem ? s_tpe : a.recv_tokens_per_expert;

  for (int ts = t_begin; ts < t_end; ts += kLayoutThreads) {
    const int n = min(kLayoutThreads, t_end - ts);
    const int t = ts + tid;
    const bool has_t = tid < n;
    const uint32_t m = has_t ? mask_s[t] : 0u;
    if (use_smem && nsub > 1) stage(ts, n, true);  // (nsub == 1: still staged from phase 1)
    int pre[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      const unsigned bal = __ballot_sync(kFull, (m >> q) & 1u);
      pre[q] = __popc(bal & lanes_below);
      if (lane == 0) s_wtot[q][warp] = __popc(bal);
    }
    __syncthreads();  // also: staging complete
    if (warp == 0) {
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        const int v = lane < nwarps ? s_wtot[q][lane] : 0;
        int incl = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int nb = __shfl_up_sync(kFull, incl, o);
          if (lane >= o) incl += nb;
        }
        s_wpre[q][lane] = incl - v;
        if (lane == 31) s_ctot[q] = incl;
      }
    }
    __syncthreads();
    int row[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      row[q] = off[q] + running[q] + s_wpre[q][warp] + pre[q];
      running[q] += s_ctot[q];
    }
    if (has_t) {
      int j = -1;
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q)
        if (q == me && ((m >> q) & 1u)) j = row[q];
      if (j >= 0 && j < lim_me) {
        // Row j of this rank receives token t of source s.
        a.recv_src[j] = s * T + t;
        const int32_t* irow = use_smem ? s_idx + tid * K : idx_s + static_cast<int64_t>(t) * K;
        const float* wrow = use_smem ? reinterpret_cast<const float*>(s_wt) + tid * K
                                     : w_s + static_cast<int64_t>(t) * K;
        int32_t* out_idx = a.recv_topk_idx + static_cast<int64_t>(j) * K;
        float* out_w = a.recv_topk_weights + static_cast<int64_t>(j) * K;
        for (int k = 0; k < K; ++k) {
          const int v = sanitize_expert_id(irow[k], E);
          if (v >= 0 && v / L == me) {
            const int l = v - me * L;
            out_idx[k] = l;
            out_w[k] = wrow[k];
            bool dup = false;
            for (int k2 = 0; k2 < k; ++k2) dup |= sanitize_expert_id(irow[k2], E) == v;
            if (!dup) atomicAdd(&tpe_counter[l], 1);
          } else {
            out_idx[k] = -1;
            out_w[k] = 0.f;
          }
        }
      }
      if (s == me) {
        int32_t* sr = a.send_rows + static_cast<int64_t>(t) * R;
#pragma unroll
        for (int q = 0; q < kMaxRanks; ++q)
          if (q < R) sr[q] = (((m >> q) & 1u) && row[q] < lim[q]) ? row[q] : -1;
      }
    }
    __syncthreads();  // s_wtot / s_wpre / s_ctot and the staging are rewritten next sub-chunk
  }

  // Padding rows [recv_count, C), shared by all blocks.
  const int64_t gtid = static_cast<int64_t>(b) * blockDim.x + tid;
  const int64_t gstride = static_cast<int64_t>(nblk) * blockDim.x;
  for (int64_t j = recv_count + gtid; j < C; j += gstride) a.recv_src[j] = -1;
  for (int64_t i = static_cast<int64_t>(recv_count) * K + gtid; i < static_cast<int64_t>(C) * K;
       i += gstride) {
    a.recv_topk_idx[i] = -1;
    a.recv_topk_weights[i] = 0.f;
  }
  if (s == me && c == 0 && tid == 0) {
    a.stats[0] = recv_count;
    a.stats[1] = total_me - recv_count;
    a.stats[2] = s_inv_tot;
    a.stats[3] = 0;
  }
  __syncthreads();
  if (tpe_smem)
    for (int l = tid; l < L; l += blockDim.x)
      if (s_tpe[l] != 0) atomicAdd(&a.recv_tokens_per_expert[l], s_tpe[l]);
  trace_mark(ps, trace::kLayoutEnd);
}

struct CopyArgs {
  PeerSlots ps;
  int64_t timeout_ns;
  const uint8_t* own_x;  // gather: published here (dispatch: published by the layout kernel)
  const int32_t* recv_src;
  const int32_t* stats;
  int T, C, G;
  int64_t Hb;
  uint8_t* recv_x;
  float* recv_scales;
  poison::Outputs outputs;  // every result of the op (the dispatch: the layout kernel's too)
};

template <bool kGather>
__device__ __forceinline__ void copy_rows(const CopyArgs& a) {
  const PeerSlots& ps = a.ps;
  const int R = ps.num_ranks, tid = threadIdx.x, lane = tid & 31;
  const unsigned long long e = call_epoch(ps);
  __shared__ const uint8_t* s_x[kMaxRanks];
  __shared__ const float* s_sc[kMaxRanks];
  trace_mark(ps, trace::kCopyStart);

  if (kGather) {
    const void* ptrs[1] = {a.own_x};
    if (!publish_and_wait(ps, ptrs, 1, e, a.timeout_ns, "ht_gather: wait for peers")) return;
    trace_mark(ps, trace::kGatherPeersReady);
  } else if (blockIdx.x == 0 && tid == 0) {
    // Every block of the layout kernel has exited (stream order): its grid barrier is done.
    grid_barrier_reset(ps);
  }
  // Peer addresses are remote loads: fetch them once per block, in parallel. The dispatch's copy
  // also reads whether a wait on this device gave up (one thread: publish_and_wait says why):
  // then the layout kernel's outputs are not valid, and the addresses are never followed.
  __shared__ bool s_failed;
  if (tid < R) {
    s_x[tid] = peer_ptr<const uint8_t>(ps, tid, kPtrX);
    s_sc[tid] = kGather ? nullptr : peer_ptr<const float>(ps, tid, kPtrScales);
  }
  if (!kGather && tid == 32) s_failed = device_failed(ps);
  __syncthreads();
  if (!kGather && s_failed) return;
  bool vec = (a.Hb % 16 == 0) && aligned16(a.recv_x);
  for (int s = 0; s < R; ++s) vec = vec && aligned16(s_x[s]);

  const int T = a.T, C = a.C, G = a.G;
  const int64_t Hb = a.Hb;
  const int recv_count = min(max(a.stats[0], 0), C);
  const int warps = blockDim.x >> 5;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * warps;
  // Valid rows are ordered by source rank. Walked in that order, every receiver would pull from
  // rank 0, then all from rank 1...: one source's links saturated, the others idle. Receiver r
  // starts at fraction r / R of its rows instead, so at any moment the ranks read from
  // different sources. Padding rows (>= recv_count) keep their places.
  const int64_t shift = recv_count > 0 ? static_cast<int64_t>(recv_count) * ps.rank / R : 0;
  auto row_of = [&](int64_t v) { return v < recv_count ? (v + shift) % recv_count : v; };
  int64_t v = static_cast<int64_t>(blockIdx.x) * warps + (tid >> 5);
  // recv_src of the warp's next row is loaded one row ahead (hides a local load per row).
  int src_next = v < recv_count ? a.recv_src[row_of(v)] : -1;
  for (; v < C; v += nw) {
    const int64_t j = row_of(v);
    const int src = src_next;
    src_next = v + nw < recv_count ? a.recv_src[row_of(v + nw)] : -1;
    int s = -1;
    int64_t t = 0;
    if (j < recv_count && src >= 0 && T > 0 && src / T < R) {
      s = src / T;
      t = src % T;
    }
    // Scales (lanes g = lane, lane + 32) are loaded before the row so they travel with it.
    float sc0 = 0.f, sc1 = 0.f;
    if (!kGather && G > 0 && s >= 0) {
      const float* sp = s_sc[s] + t * G;
      if (lane < G) sc0 = ld_nc_f32(sp + lane);
      if (lane + 32 < G) sc1 = ld_nc_f32(sp + lane + 32);
    }
    uint8_t* dst = a.recv_x + j * Hb;
    if (s >= 0)
      copy_row(dst, s_x[s] + t * Hb, Hb, vec, lane);
    else
      zero_row(dst, Hb, vec, lane);
    if (!kGather && G > 0) {
      float* d = a.recv_scales + j * G;
      if (lane < G) d[lane] = sc0;
      if (lane + 32 < G) d[lane + 32] = sc1;
      for (int g = lane + 64; g < G; g += 32) d[g] = s >= 0 ? ld_nc_f32(s_sc[s] + t * G + g) : 0.f;
    }
  }
  trace_mark(ps, trace::kCopyLoopDone);
  end_barrier(ps, e, a.timeout_ns, kGather ? "ht_gather: end barrier" : "ht_dispatch: end barrier",
              trace::kCopyAllBlocksArrived);
}

// The op's last kernel: every block, also one that ended early, leaves through the poison step.
template <bool kGather>
__global__ void __launch_bounds__(kCopyThreads) copy_rows_kernel(CopyArgs a) {
  copy_rows<kGather>(a);
  poison::leave(a.ps, a.outputs);
}

}  // namespace

LayoutPlan plan_layout(int R, int T, int max_blocks) {
  LayoutPlan p;
  const int64_t nch_max = max_blocks / R > 1 ? max_blocks / R : 1;
  int64_t chunk = (T + nch_max - 1) / nch_max;
  chunk = (chunk + kLayoutMinChunk - 1) / kLayoutMinChunk * kLayoutMinChunk;
  if (chunk < kLayoutMinChunk) chunk = kLayoutMinChunk;
  int64_t nch = (T + chunk - 1) / chunk;
  if (nch < 1) nch = 1;
  p.chunk = static_cast<int>(chunk);
  p.nch = static_cast<int>(nch);
  // mask bytes, cnt[R * nch][R], inv[nch]
  p.scratch_words = (static_cast<int64_t>(R) * T + 3) / 4 + static_cast<int64_t>(R) * nch * R + nch;
  return p;
}

void launch_dispatch(const DispatchArgs& a, cudaStream_t stream) {
  const size_t smem = static_cast<int64_t>(kLayoutThreads) * a.K * 8 <= kLayoutSmemBytes
                          ? static_cast<size_t>(kLayoutThreads) * a.K * 8
                          : 0;
  const int layout_grid = a.ps.num_ranks * a.plan.nch;
  // Both gates first (kernels/launch.cuh): in the one-GPU multi-rank mode either both kernels
  // launch or neither.
  const bool layout_ok = may_launch(reinterpret_cast<const void*>(dispatch_layout_kernel),
                                    "high-throughput layout", layout_grid, kLayoutThreads, smem);
  const bool copy_ok = may_launch(reinterpret_cast<const void*>(copy_rows_kernel<false>),
                                  "high-throughput copy", a.num_blocks, kCopyThreads, 0);
  if (!layout_ok || !copy_ok) return;
  dispatch_layout_kernel<<<layout_grid, kLayoutThreads, smem, stream>>>(a);
  CopyArgs c{a.ps, a.timeout_ns, a.x,  a.recv_src, a.stats,       a.T,
             a.C,  a.G,          a.Hb, a.recv_x,   a.recv_scales, {}};
  // The copy kernel is the dispatch's last: it poisons the layout kernel's results too.
  const int64_t C = a.C, K = a.K;
  poison::add(c.outputs, a.recv_x, C * a.Hb);
  poison::add(c.outputs, a.recv_scales, C * a.G * 4);
  poison::add(c.outputs, a.recv_topk_idx, C * K * 4);
  poison::add(c.outputs, a.recv_topk_weights, C * K * 4);
  poison::add(c.outputs, a.recv_src, C * 4);
  poison::add(c.outputs, a.send_rows, static_cast<int64_t>(a.T) * a.ps.num_ranks * 4);
  poison::add(c.outputs, a.recv_tokens_per_expert, static_cast<int64_t>(a.L) * 4);
  poison::add(c.outputs, a.stats, 4 * 4);
  copy_rows_kernel<false><<<a.num_blocks, kCopyThreads, 0, stream>>>(c);
}

void launch_gather(const GatherArgs& a, cudaStream_t stream) {
  CopyArgs c{a.ps, a.timeout_ns, a.x,      a.recv_src, a.stats, a.T, a.C,
             0,    a.Hb,         a.recv_x, nullptr,    {}};
  poison::add(c.outputs, a.recv_x, static_cast<int64_t>(a.C) * a.Hb);
  launch_gated(copy_rows_kernel<true>, "high-throughput gather", a.num_blocks, kCopyThreads, 0,
               stream, c);
}

}  // namespace ht
}  // namespace jax_ep