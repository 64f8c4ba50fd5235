// The FP8 block-scaled mainloop's consumer side, with the promotion overlapped with the tensor
// cores (docs/kernels.md#fp8-overlapped-promotion).
//
// CUTLASS's SM90 blockwise-scaled mainloop multiplies each 128-deep K tile into a temporary
// accumulator, waits for those wgmmas, then adds temporary * scales into the float32 accumulator
// (DeepGEMM's promotion). Between the wait and the next K tile's wgmmas the warpgroup's tensor
// cores idle, and both consumer warpgroups reach that point together (they read the same
// shared-memory stage). This mainloop keeps two temporary accumulators: K tile k + 1's wgmmas
// are issued before K tile k is promoted, so the promotion's FFMAs run while the tensor cores
// work. Everything else (the TMA and scale loads of the producer, the shared-memory layouts, the
// pipeline, mma_tail) is the CUTLASS collective's, which this type derives from: the kernel
// dispatches on the inherited DispatchPolicy and calls this mma().
#pragma once
#include "common/warp.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "testing/mutations.h"

namespace jax_ep::gemm {

template <class Base>
struct OverlappedPromotion : Base {
  using typename Base::ElementBlockScale;
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;
  // One promotion per K tile, per-row A scales, one B scale per tile: the configuration of
  // impl.cuh's FP8 kernels (1 x 128 and 128 x 128 blocks, 128-deep K tiles).
  static_assert(Base::ScalePromotionInterval == 4, "one promotion per K tile");
  static_assert(Base::ScaleNsPerTile == 1, "one B scale per tile");
  static_assert(Base::ScaleMsPerTile > 1, "per-row A scales");

  // Consumer warpgroups: accum = sum over K tiles of (A_k @ B_k) * sfa_k * sfb_k. Releases the
  // stages of all K tiles but the last (mma_tail releases that one), as the base mma does.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    // Scales seen as (BLK_M, BLK_N, (BLK_K, PIPE)) tensors broadcast along the other mode, so
    // that they partition like the accumulator.
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(
            make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                       make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
            make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                        make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(
            make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                       make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
            make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                        make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const Layout group_layout =
        make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int group = __shfl_sync(kFull, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(group_layout(group));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA,M,N,(K,PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,M,K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,N,K,PIPE)
    constexpr int kBlocks = size<2>(decltype(tCrA){});                     // wgmmas per K tile

    // Two temporaries and their scales (sfa * sfb, one per row of the thread's fragment).
    Tensor t0 = make_fragment_like(accum);
    Tensor t1 = make_fragment_like(accum);
    Tensor s0 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    Tensor s1 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    Tensor sb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));

    // Wait for K tile `read`, load its scales into s, issue its wgmmas into t.
    auto issue = [&](auto& t, auto& s) {
      pipeline.consumer_wait(smem_pipe_read);
      const int stage = smem_pipe_read.index();
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), s);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sb);
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(t);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kBlocks; ++k) {
        cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), t);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(t);
      const ElementBlockScale b = sb(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(s)); ++i) filter_zeros(s)(i) *= b;
      ++smem_pipe_read;
    };
    // After `pending` newer batches' wgmmas were issued: wait for t's, then accum += t * s.
    PipelineState smem_pipe_release = smem_pipe_read;
    auto promote = [&](auto& t, auto& s, auto pending, bool release) {
      warpgroup_wait<decltype(pending)::value>();
      warpgroup_fence_operand(t);
      if (release) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += t(i) * s(i);
      warpgroup_fence_operand(accum);
    };

    // K tiles alternate between t0 and t1: an even count ends in t1, an odd one in t0. (The
    // compiler waits for K tile 0 once, where the loop starts; inside the loop nothing waits but
    // promote's warpgroup_wait.)
    clear(accum);
    if (k_tile_count <= 0) return;
    issue(t0, s0);
    int k = 1;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k + 1 < k_tile_count; k += 2) {
      issue(t1, s1);
      promote(t0, s0, _1{}, true);
      issue(t0, s0);
      promote(t1, s1, _1{}, true);
    }
    if (k < k_tile_count) {
      issue(t1, s1);
      promote(t0, s0, _1{}, true);
      if constexpr (JAX_EP_PLANTED(kFp8StaleScales))
        promote(t1, s0, _0{}, false);
      else
        promote(t1, s1, _0{}, false);
    } else {
      promote(t0, s0, _0{}, false);
    }
  }
};

}  // namespace jax_ep::gemm
