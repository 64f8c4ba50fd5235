// CUTLASS grouped GEMMs (SM90 pointer-array, TMA, warp-specialised) and the small kernels that
// prepare their per-group arguments on the device: group sizes never reach the host, so the
// calls are CUDA-graph safe. Included only by the instantiation units inst_*.cu (each CUTLASS
// instantiation compiles for minutes: one per unit, so they build in parallel).
#pragma once
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <mutex>
#include <string>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "kernels/gemm/fp8_mainloop.cuh"
#include "kernels/gemm/grouped_gemm.h"
#include "kernels/gemm/workspace.h"

namespace jax_ep::gemm {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using RowMajor = cutlass::layout::RowMajor;
using ColMajor = cutlass::layout::ColumnMajor;

// ---------------------------------------------------------------------------------------------
// Kernel configurations. D = A @ B per group, A (M, K), B (N, K) in CUTLASS's terms; D row-major.
// ---------------------------------------------------------------------------------------------

// ElementC void: D = acc (no source read); else D = acc + C, C read from D's own memory (the
// weight gradient accumulating into its output, run_config).
template <class Tile, class Cluster, class EpiSchedule, class ElementD, class ElementC = void>
using EpilogueFor = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, RowMajor*,
    16 / sizeof(ElementD), ElementD, RowMajor*, 16 / sizeof(ElementD), EpiSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

// 16-bit operands (bf16 / f16), float32 accumulation, output in the operand dtype.
// ElementC: void, or T for a call that adds its product to the output's contents.
template <class T, class LayoutA, class LayoutB, class Tile, class Cluster, class Schedule,
          class EpiSchedule, class ElementC_ = void>
struct Cfg16 {
  static constexpr bool kFp8 = false;
  using ElementA = T;
  using ElementB = T;
  using ElementC = ElementC_;
  using ElementD = T;
  using Epilogue = EpilogueFor<Tile, Cluster, EpiSchedule, ElementD, ElementC>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, 8, ElementB,
      LayoutB*, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// FP8 e4m3 x e4m3 with float32 block scales (1 x 128 for A, 128 x 128 for B), promoted into the
// float32 accumulator every 128 of K (DeepGEMM's scheme); bf16 output. A and B K-major.
using Fp8ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kFp8Block, kFp8Block>;
using LayoutSFA = decltype(Fp8ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(Fp8ScaleConfig::deduce_layoutSFB());

template <class Tile, class Cluster, class Schedule, class EpiSchedule>
struct CfgFp8 {
  static constexpr bool kFp8 = true;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  using Epilogue = EpilogueFor<Tile, Cluster, EpiSchedule, ElementD>;
  using Mainloop = OverlappedPromotion<typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<RowMajor*, LayoutSFA*>, 16, ElementB, cute::tuple<ColMajor*, LayoutSFB*>, 16,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using namespace cute;
using Coop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using PingpongEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

// Large tiles for many rows per group; 64-row tiles when groups are small (the masked layout of
// decoding, where the weights' bytes bound the time). Clusters pair tiles along N, never M: a
// group's row count is arbitrary, and a cluster along M would idle half of it on every group with
// an odd number of row tiles (measured: a quarter-used buffer took 0.59 of the full time).
// Tiles whose rows are the groups' rows are 128 rows tall, not 256: a group's last row tile is
// mostly padding when routing sets the sizes, and a 128-row one wastes half as much; on equal
// groups the two are within 1-2 % (docs/kernels.md#gemm-uneven-groups).
template <class T>
using Fwd = Cfg16<T, RowMajor, RowMajor, cute::Shape<_128, _256, _64>, cute::Shape<_1, _1, _1>,
                  Coop, CoopEpi>;
template <class T>
using FwdSmall = Cfg16<T, RowMajor, RowMajor, cute::Shape<_64, _256, _64>, cute::Shape<_1, _1, _1>,
                       Pingpong, PingpongEpi>;
template <class T>  // rhs stored [G, N, K]: the lhs gradient dout @ w^T
using FwdNK = Cfg16<T, RowMajor, ColMajor, cute::Shape<_128, _256, _64>, cute::Shape<_1, _1, _1>,
                    Coop, CoopEpi>;
// lhs^T @ rhs2 per group: the weight gradient (ElementC T: added to the output's contents)
template <class T, class ElementC = void>
using Tgrad = Cfg16<T, ColMajor, RowMajor, cute::Shape<_256, _128, _64>, cute::Shape<_1, _2, _1>,
                    Coop, CoopEpi, ElementC>;
template <class T>  // GemmShape::accumulate
using TgradAcc = Tgrad<T, T>;
// FP8: cooperative 128 x 128 tiles (larger ones need more accumulator registers than a thread
// has: blockwise scaling keeps temporaries beside the accumulator, fp8_mainloop.cuh); 64 x 128
// ping-pong tiles for few rows per group. On one H200, 32 groups of 1024 rows at (K, N) =
// (7168, 4096), normal data: the cooperative tiles 1135 TFLOP/s against 915 for the ping-pong
// ones in one run, and 1158 against 1129-1134 with clusters along M in another
// (docs/kernels.md#fp8-overlapped-promotion).
using Fp8Fwd =
    CfgFp8<cute::Shape<_128, _128, _128>, cute::Shape<_1, _2, _1>,
           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, CoopEpi>;
using Fp8FwdSmall =
    CfgFp8<cute::Shape<_64, _128, _128>, cute::Shape<_1, _1, _1>,
           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise, PingpongEpi>;

// ---------------------------------------------------------------------------------------------
// Argument preparation on the device
// ---------------------------------------------------------------------------------------------

inline constexpr int kSetupThreads = 256;

template <class C>
struct Args {
  using Kernel = typename C::Kernel;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using EA = typename C::ElementA;
  using EB = typename C::ElementB;
  using ED = typename C::ElementD;
  static_assert(sizeof(StrideA) <= kStrideBytes && sizeof(StrideB) <= kStrideBytes &&
                sizeof(StrideD) <= kStrideBytes);
  static_assert(sizeof(LayoutSFA) <= kScaleLayoutBytes && sizeof(LayoutSFB) <= kScaleLayoutBytes);
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int));
};

// One block: group offsets by a block-wide scan of the sizes, then every group's problem shape,
// operand pointers, strides (and FP8 scale pointers / layouts).
template <class C>
__global__ void __launch_bounds__(kSetupThreads) setup_kernel(Call c, Carved w) {
  using A = Args<C>;
  using Scan = cub::BlockScan<long long, kSetupThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ long long carry;
  const GemmShape& s = c.s;
  const long long G = s.G, M = s.M, K = s.K, N = s.N;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (long long base = 0; base < G; base += kSetupThreads) {
    const long long g = base + threadIdx.x;
    long long size = 0;
    if (g < G) size = max(0LL, min(static_cast<long long>(c.sizes[g]), M));
    long long excl = 0, total = 0;
    Scan(tmp).ExclusiveSum(size, excl, total);
    const long long off = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry = min(carry + total, M);
    if (g < G) {
      long long start, rows;
      if (s.mode == Mode::kMasked) {
        start = g * M;
        rows = size;  // counts clipped to [0, C]
      } else {
        start = min(off, M);
        rows = min(off + size, M) - start;
        // the weight gradient with row_counts: the first row_counts[g] rows of the segment
        if (s.mode == Mode::kTransposed && c.row_counts)
          rows = max(0LL, min(static_cast<long long>(c.row_counts[g]), rows));
      }
      w.start[g] = start;
      w.rows[g] = static_cast<int>(rows);
      const int r = static_cast<int>(rows);
      auto* shapes = static_cast<typename ProblemShape::UnderlyingProblemShape*>(w.shapes);
      const auto* lhs = static_cast<const typename A::EA*>(c.lhs);
      auto* out = static_cast<typename A::ED*>(c.out);
      auto* sa = reinterpret_cast<typename A::StrideA*>(w.stride_a);
      auto* sb = reinterpret_cast<typename A::StrideB*>(w.stride_b);
      auto* sd = reinterpret_cast<typename A::StrideD*>(w.stride_d);
      if (s.mode == Mode::kTransposed) {
        // out[g] (K x N) = lhs_g^T (K x rows) @ rhs2_g (rows x N): A = lhs_g^T, M-major.
        const auto* rhs2 = static_cast<const typename A::EB*>(c.rhs);
        shapes[g] = {r > 0 ? static_cast<int>(K) : 0, static_cast<int>(N), r};
        w.ptr_a[g] = lhs + start * K;
        w.ptr_b[g] = rhs2 + start * N;
        w.ptr_d[g] = out + g * K * N;
        sa[g] = cutlass::make_cute_packed_stride(typename A::StrideA{}, {int(K), r, 1});
        sb[g] = cutlass::make_cute_packed_stride(typename A::StrideB{}, {int(N), r, 1});
        sd[g] = cutlass::make_cute_packed_stride(typename A::StrideD{}, {int(K), int(N), 1});
      } else {
        const auto* rhs = static_cast<const typename A::EB*>(c.rhs);
        shapes[g] = {r, static_cast<int>(N), static_cast<int>(K)};
        w.ptr_a[g] = lhs + start * K;
        w.ptr_b[g] = rhs + g * K * N;
        w.ptr_d[g] = out + start * N;
        sa[g] = cutlass::make_cute_packed_stride(typename A::StrideA{}, {r, int(K), 1});
        sb[g] = cutlass::make_cute_packed_stride(typename A::StrideB{}, {int(N), int(K), 1});
        sd[g] = cutlass::make_cute_packed_stride(typename A::StrideD{}, {r, int(N), 1});
        if constexpr (C::kFp8) {
          const long long KB = K / kFp8Block, NB = N / kFp8Block;
          w.ptr_sfa[g] = w.sfa_t + start * KB;
          w.ptr_sfb[g] = c.rhs_scales + g * KB * NB;
          reinterpret_cast<LayoutSFA*>(w.layout_sfa)[g] =
              Fp8ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(r, int(N), int(K), 1));
          reinterpret_cast<LayoutSFB*>(w.layout_sfb)[g] =
              Fp8ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(r, int(N), int(K), 1));
        }
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) w.start[G] = s.mode == Mode::kMasked ? G * M : carry;
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

template <class C>
size_t cutlass_workspace(int G, int sm_count) {
  typename C::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {G, nullptr, nullptr};
  args.hw_info.sm_count = sm_count;
  return C::Gemm::get_workspace_size(args);
}

template <class C>
std::string run_config(const Call& c, cudaStream_t stream) {
  using A = Args<C>;
  using Gemm = typename C::Gemm;
  const GemmShape& s = c.s;
  const int G = static_cast<int>(s.G);
  Carved w = carve(c.workspace, s, cutlass_workspace<C>(G, c.sm_count));
  if (w.total > c.workspace_bytes)
    return "workspace has " + std::to_string(c.workspace_bytes) + " bytes, needs " +
           std::to_string(w.total);
  setup_kernel<C><<<1, kSetupThreads, 0, stream>>>(c, w);
  if (auto err = launch_prologue(c, w, stream); !err.empty()) return err;

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {G, static_cast<typename ProblemShape::UnderlyingProblemShape*>(w.shapes),
                        nullptr};
  if constexpr (C::kFp8) {
    args.mainloop = {reinterpret_cast<const typename A::EA**>(w.ptr_a),
                     reinterpret_cast<typename A::StrideA*>(w.stride_a),
                     reinterpret_cast<const typename A::EB**>(w.ptr_b),
                     reinterpret_cast<typename A::StrideB*>(w.stride_b),
                     const_cast<const float**>(w.ptr_sfa),
                     reinterpret_cast<LayoutSFA*>(w.layout_sfa),
                     const_cast<const float**>(w.ptr_sfb),
                     reinterpret_cast<LayoutSFB*>(w.layout_sfb)};
  } else {
    args.mainloop = {reinterpret_cast<const typename A::EA**>(w.ptr_a),
                     reinterpret_cast<typename A::StrideA*>(w.stride_a),
                     reinterpret_cast<const typename A::EB**>(w.ptr_b),
                     reinterpret_cast<typename A::StrideB*>(w.stride_b)};
  }
  args.epilogue.ptr_D = reinterpret_cast<typename A::ED**>(w.ptr_d);
  args.epilogue.dD = reinterpret_cast<typename A::StrideD*>(w.stride_d);
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  if constexpr (std::is_void_v<typename C::ElementC>) {
    args.epilogue.ptr_C = nullptr;
    fusion.beta = 0.0f;
  } else {
    // D = acc + D in place: every element is read (as C) and then written (as D) by the one
    // tile that owns it, so C and D may be the same memory.
    using StrideC = typename C::Kernel::InternalStrideC;
    static_assert(std::is_same_v<StrideC, typename A::StrideD>);
    args.epilogue.ptr_C = static_cast<const typename C::ElementC**>(static_cast<void*>(w.ptr_d));
    args.epilogue.dC = reinterpret_cast<StrideC*>(w.stride_d);
    fusion.beta = 1.0f;
  }
  args.hw_info.device_id = c.device;
  args.hw_info.sm_count = c.sm_count;
  args.hw_info.max_active_clusters = 0;

  Gemm gemm;
  cutlass::Status st = gemm.initialize(args, w.cutlass, stream);
  if (st != cutlass::Status::kSuccess)
    return std::string("CUTLASS initialize: ") + cutlass::cutlassGetStatusString(st);
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess)
    return std::string("CUTLASS run: ") + cutlass::cutlassGetStatusString(st);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("CUTLASS launch: ") + cudaGetErrorString(e);
  return {};
}

}  // namespace jax_ep::gemm

// One variant per translation unit: its run and workspace functions (declared in variants.h).
#define JAX_EP_GEMM_VARIANT(name, ...)                                                            \
  namespace jax_ep::gemm::variants {                                                              \
  std::string run_##name(const Call& c, cudaStream_t s) { return run_config<__VA_ARGS__>(c, s); } \
  size_t workspace_##name(int G, int sm_count) {                                                  \
    return cutlass_workspace<__VA_ARGS__>(G, sm_count);                                           \
  }                                                                                               \
  }
