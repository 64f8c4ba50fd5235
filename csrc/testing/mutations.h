// The planted bugs of the mutation checks: the one place that names them. Test equipment, not
// part of the protocols: every real build has JAX_EP_MUTATION = 0, where no hook plants
// anything and the generated code is that of a build without hooks (scripts/sass_compare.py
// --after-define shows it). A build with CMake's JAX_EP_MUTATION=N (scripts/gpu_check.sh
// mutations and planted; docs/testing.md has what each caught) plants bug N: each site asks
//
//   if constexpr (JAX_EP_PLANTED(kLlStaleTag)) e32 -= 2;
//
// which is a constant, false unless the build carries that bug, so its code compiles away.
// _C.planted_bug() tells the tests which one a build carries. The numbers are what
// gpu_check.sh's MUTATIONS and PLANTED lists name: keep them.
//
// Bugs 1 to 8 sit in code that every one-process run executes, 9 and 10 in per-process code
// only, 11 to 13, 17 to 22, 24 and 25 in the fused kernels, 14 in the FP8 grouped GEMM, 15 in the
// one-GPU multi-rank mode, 16 in every communication kernel's failure path, 23 in the
// expert-major layout's positions kernel. Plain C++ (constants
// only): host code and kernels include it.
#pragma once

#ifndef JAX_EP_MUTATION
#define JAX_EP_MUTATION 0
#endif

namespace jax_ep::mutation {

enum Bug : int {
  kNone = 0,
  // low-latency dispatch: a count or position word of the buffer half's previous use passes as
  // this call's (word_older, kernels/low_latency/common.cuh)
  kLlStaleWord = 1,
  // high-throughput: the wait for the peers' addresses accepts the previous call's
  // (publish_and_wait, kernels/high_throughput/common.cuh)
  kHtStaleAddresses = 2,
  // the ready flag stored relaxed, with no fence after the addresses it publishes (publish,
  // transport/pull.cuh)
  kReadyUnfenced = 3,
  // low-latency: a row tag of the buffer half's previous use passes (tag_older,
  // kernels/low_latency/common.cuh)
  kLlStaleTag = 4,
  // a released lease keeps its slot and buffers: memory never comes back (~Lease,
  // runtime/lease.cc)
  kLeaseKeepsSlot = 5,
  // every push lease takes the first push slot: call sites share epochs and pending sends
  // (take_slot, runtime/lease.cc)
  kOnePushSlot = 6,
  // low-latency combine: a row of y named by a tampered handle is read without the bound
  // (combine_send_item, kernels/low_latency/combine.cu)
  kLlRowUnbounded = 7,
  // a wait that timed out traps, which ends the CUDA context (give_up, transport/peer.cuh)
  kTimeoutTraps = 8,
  // per-process leases are not compared with the peers': the lease ledger goes unread
  // (make_buffers, runtime/mode_per_process.cc)
  kLedgerUnread = 9,
  // the per-process lease ledger skips the peers that loads do not reach (check_lease,
  // nvshmem/symmetric.cc)
  kLedgerSkipsRemote = 10,
  // fused gather + grouped GEMM: a tile does not wait for its rows (kernels/fused/gather_gemm.cu)
  kTileSkipsRows = 11,
  // fused grouped GEMM + combine: a received row's slots are summed without waiting for their
  // tiles (reduce_task, kernels/fused/gemm_combine.cu)
  kCombineSkipsTiles = 12,
  // fused gather + grouped GEMM: a token's first row counts its copies on the rank but does not
  // write them (copy_rows, kernels/fused/gather_gemm.cu)
  kCopiesUnwritten = 13,
  // FP8 grouped GEMM: the last of an even number of K tiles is promoted with the scales of the
  // one before it (OverlappedPromotion::mma, kernels/gemm/fp8_mainloop.cuh)
  kFp8StaleScales = 14,
  // the fused kernels' grids in the one-GPU multi-rank mode: the rank's share of the SMs divided
  // by R once more (fused_split, ffi/high_throughput.cc)
  kFusedShareTwice = 15,
  // an op whose wait gave up leaves its results as they are: the poison fill does nothing
  // (poison::fill, transport/poison.cuh)
  kSkipPoison = 16,
  // fused grouped GEMM + combine: a token's summed row is pulled from a rank without waiting
  // for that rank to have written it (its flag read once; one not yet set counts as no row
  // there: combine_task, kernels/fused/gemm_combine.cu)
  kCombineSkipsSummed = 17,
  // fused gather + grouped GEMM's activation epilogue: the up projection's columns taken for
  // the gate's and the other way round (store_activation, kernels/fused/gather_gemm.cu)
  kActivationSwapsHalves = 18,
  // fused gather + grouped GEMM with h unwritten: the tiles skip the activation epilogue too
  // (run_tiles, kernels/fused/tiles.cuh)
  kUnwrittenHSkipsActivation = 19,
  // fused grouped GEMM + combine: a received row sums only its first group of slots' rows (top-k
  // past kGroup loses the rest; reduce_task, kernels/fused/gemm_combine.cu)
  kCombineOneSlotGroup = 20,
  // fused grouped GEMM + combine: the addend is added whether it is on or not (addend_row,
  // kernels/fused/gemm_combine.cu)
  kAddendIgnoresOn = 21,
  // fused grouped GEMM + combine over several ranks: a received row's sum goes into the row of
  // its last slot here, not its first (the flag names that row, so the output stays right;
  // reduce_task, kernels/fused/gemm_combine.cu)
  kSumInLastSlot = 22,
  // expert positions: the pairs of one expert in one step of a warp take their rows in reverse
  // order, so the sort is no longer stable (place_kernel, kernels/expert_positions.cuh)
  kPositionsUnstable = 23,
  // fused grouped GEMM + combine: a task whose entries stay in the lanes of its waits sums each
  // row with the next row's entries (reduce_task, kernels/fused/gemm_combine.cu)
  kKeptEntriesShifted = 24,
  // fused kernels' half tiles: the first consumer warpgroup (rows [0, kBlockM / 2), with data)
  // leaves out its MMAs instead of the second (run_tiles, kernels/fused/tiles.cuh)
  kHalfTileSkipsRows = 25,
  kLast = kHalfTileSkipsRows,
};

// The bug this build carries (0: none).
inline constexpr int kPlanted = JAX_EP_MUTATION;
static_assert(kPlanted >= kNone && kPlanted <= kLast,
              "JAX_EP_MUTATION names no planted bug (csrc/testing/mutations.h)");

}  // namespace jax_ep::mutation

// Whether this build carries planted bug `bug` (a name of mutation::Bug): a constant.
#define JAX_EP_PLANTED(bug) (::jax_ep::mutation::kPlanted == ::jax_ep::mutation::bug)
