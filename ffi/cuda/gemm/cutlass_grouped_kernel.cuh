// The engine's kernels (cutlass_grouped.h): CUTLASS 3.x's ptr-array grouped kernel with jaxmlp's varlen main
// loop (cutlass_varlen_mainloop.cuh), and their launch from the device arrays of one product. Included by
// the per-op translation units only (cutlass_grouped_<op>.cu), which are compiled for sm_90a alone.
#pragma once

#include <cuda_runtime.h>

#include <string>

// Before CUTLASS's headers: those leave -Wmissing-field-initializers an error, which XLA's FFI headers
// (jax 0.11) trip.
#include "cuda/gemm/cutlass_grouped.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cuda/gemm/cutlass_activation_epilogue.cuh"
#include "cuda/gemm/cutlass_gather_kernel.cuh"
#include "cuda/gemm/cutlass_varlen_mainloop.cuh"

namespace jaxmlp {

namespace cutlass_detail {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

// The tile configuration: 128x128 output tiles, two consumer warpgroups taking turns (ping-pong: one's
// epilogue under the other's main loop), a cluster of two CTAs along M sharing B's loads (TMA multicast).
// With equal groups CUTLASS's batched kernel of this configuration runs 8-16% faster than of cooperative
// 128x256 tiles at the MoE shapes (docs/engine-performance.md, "The engine against cuBLASLt"); the varlen main loop is
// measured with this one, with and without the cluster (below).
struct Pingpong128x128 {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// A configuration without the cluster, for products where sharing B's loads gains less than the cluster costs:
// groups of one 128-row tile (on average: M <= 128 E), where the cluster's second CTA gets a tile past the
// group's rows and computes nothing (half the SMs idle at decode sizes), and skewed routing over small
// experts, where many groups have an odd number of tiles; with an expert's weights at most
// kSmallExpertWeights elements, L2 serves the repeated loads of B that the cluster would have shared. Larger
// experts' steps lose time without it (docs/engine-performance.md, "The cluster").
template <class Config>
struct NoCluster : Config {
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
};
constexpr int64_t kSmallExpertWeights = int64_t(4) << 20;

// The gathered FC1's configuration (GatherSplitN): 128x256 tiles, the two consumer warpgroups side by side
// along N over the same A stage (CUTLASS's cooperative kernel's host side), with the cluster or without it
// (NoCluster, as above).
struct SplitN128x256 {
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Collective with its TiledMma replaced (the builder lays a cooperative kernel's warpgroups along M).
template <class Collective, class TiledMma>
struct WithTiledMma;
template <class Policy, class Tile, class EA, class SA, class EB, class SB, class Old, class GA, class LA, class CA,
          class XA, class GB, class LB, class CB, class XB, class TiledMma>
struct WithTiledMma<cutlass::gemm::collective::CollectiveMma<Policy, Tile, EA, SA, EB, SB, Old, GA, LA, CA, XA, GB, LB,
                                                             CB, XB>,
                    TiledMma> {
  using type = cutlass::gemm::collective::CollectiveMma<Policy, Tile, EA, SA, EB, SB, TiledMma, GA, LA, CA, XA, GB, LB,
                                                        CB, XB>;
};
// Two warpgroups along N, each 64x128 wgmma atoms (twice along M for its 128 x 128): A K-major, B N-major
// (row-major A [rows, K] and B [K, N]: the gathered FC1's kNN).
template <typename T>
using SplitNTiledMma = decltype(cute::make_tiled_mma(
    cute::SM90::GMMA::ss_op_selector<T, T, float, cute::Shape<cute::_64, cute::_128, cute::_64>,
                                     cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
    cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>{}));
inline bool WithoutCluster(const CutlassLaunch& l) {
  constexpr int64_t kTileRows = cute::size<0>(Pingpong128x128::Tile{});
  return l.rows <= kTileRows * l.E || l.K * l.N <= kSmallExpertWeights;
}

// FP8 e4m3 operands (both reduction-major: kNT), the tensorwise recipe's: 128-element (128-byte) k-tiles, as the
// 16-bit kernels' 64, and CUTLASS's FP8 schedules: fast accumulation (wgmma's accumulator throughout, as
// cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM) on the ping-pong kernel, or the FP8 main loop that adds the wgmma
// accumulator into a float32 one after every k-tile (cuBLASLt's default accumulation) on the cooperative
// kernel: two accumulators of a 128 x 128 tile in one warpgroup spill (168 registers, 744 bytes of spills; the
// step 0.76-0.89x cuBLASLt's), those of its 64 x 128 half in each of two do not.
template <class Config, bool kFastAccumulation>
struct Fp8 : Config {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Kernel = cute::conditional_t<kFastAccumulation,
                                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using Epilogue = cute::conditional_t<kFastAccumulation, typename Config::Epilogue,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// The tensorwise FP8 product's epilogue: D = (scale_a scale_b) acc + beta C, the two dequantization scales
// device floats (read by the kernel: nothing syncs) multiplied first, as the recipe defines the product
// (jaxmlp/fp8/tensorwise.py). CUTLASS's LinearCombination with its alpha a broadcast of two scalars; C is
// loaded only where beta is not 0 (CUTLASS's multiply-add node over a scalar and the source).
constexpr auto kToNearest = cutlass::FloatRoundStyle::round_to_nearest;
template <typename T>
using TensorScaled = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, T, float, kToNearest>,
    cutlass::epilogue::fusion::Sm90ScalarBroadcastPtrArray<float, cute::Stride<cute::_0, cute::_0, int64_t>>,
    cutlass::epilogue::fusion::Sm90SrcFetch<T>,
    cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, kToNearest>,
        cutlass::epilogue::fusion::Sm90ScalarBroadcastPtrArray<float, cute::Stride<cute::_0, cute::_0, int64_t>, 2>,
        cutlass::epilogue::fusion::Sm90AccFetch>>;

// What a kernel computes beside its product, in its epilogue (cutlass_activation_epilogue.cuh): kGatedFc1 a
// gated activation in FC1 (kNN; B's tiles in gate and up halves), kFc1 an ungated one, kGatedDgrad a gated
// activation's backward from FC2's data gradient (kNT), kDgrad an ungated one's.
enum class Fusion { kNone, kGatedFc1, kFc1, kGatedDgrad, kDgrad };
constexpr bool IsGatedFusion(Fusion f) { return f == Fusion::kGatedFc1 || f == Fusion::kGatedDgrad; }
constexpr bool IsDgradFusion(Fusion f) { return f == Fusion::kGatedDgrad || f == Fusion::kDgrad; }

// The grouped GEMM D = A B (+ beta D) of element T, A and B in the given layouts, D row-major, rows ragged;
// with kGather A's rows gathered from tokens (VarlenMainloop's kGatherA, GatherSplitN). With TIn an FP8 type,
// A and B are TIn (Config an Fp8) and the product is scaled by their tensorwise scales (TensorScaled).
template <typename T, typename LayoutA, typename LayoutB, typename Config, Fusion kFusion = Fusion::kNone,
          bool kGather = false, typename TIn = T>
struct Grouped {
  static constexpr bool kFp8 = !cute::is_same_v<TIn, T>;
  // 16 bytes: rows of K and N multiples of 8 16-bit elements or 16 FP8 ones (CutlassSupports)
  static constexpr int kAlign = 8, kAlignIn = 16 / int(sizeof(TIn));
  static_assert(!kFp8 || (kFusion == Fusion::kNone && !kGather), "FP8 products run without fusions");
  using TmaEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, T, cutlass::layout::RowMajor*, kAlign, T,
      cutlass::layout::RowMajor*, kAlign, typename Config::Epilogue,
      cute::conditional_t<kFp8, TensorScaled<T>, cutlass::epilogue::fusion::LinearCombination<T, float>>>::CollectiveOp;
  using Epilogue = cute::conditional_t<kFusion == Fusion::kNone, TmaEpilogue,
                                       ActivationEpilogue<TmaEpilogue, IsGatedFusion(kFusion),
                                                          IsDgradFusion(kFusion), kGather>>;
  using PtrArrayMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TIn, LayoutA*, kAlignIn, TIn, LayoutB*, kAlignIn, float,
      typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename TmaEpilogue::SharedStorage) + sizeof(typename Epilogue::TensorStorage) -
          sizeof(typename TmaEpilogue::TensorStorage))>,
      typename Config::Kernel>::CollectiveOp;
  using BuiltMainloop = cute::conditional_t<kGather, typename WithTiledMma<PtrArrayMainloop, SplitNTiledMma<T>>::type,
                                            PtrArrayMainloop>;
  using Mainloop = VarlenMainloop<BuiltMainloop, /*kSplitB=*/kFusion == Fusion::kGatedFc1, kGather>;
  using UniversalKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  // Gathered rows: the cooperative kernel's host side with a device body of our own (cutlass_gather_kernel.cuh).
  static_assert(!kGather || (kFusion == Fusion::kGatedFc1 && cute::is_same_v<LayoutA, cutlass::layout::RowMajor> &&
                             cute::is_same_v<LayoutB, cutlass::layout::RowMajor>),
                "only the gated FC1 (kNN) gathers its rows");
  using Kernel = cute::conditional_t<kGather, GatherSplitN<UniversalKernel>, UniversalKernel>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr Fusion kFuses = kFusion;
  // The activation epilogues' staging leaves the main loop the stages it has without them (6): FC1's lives in
  // Base's shared memory; a gated data gradient's second buffer (16 KB) fits in the ~17 KB the 6 stages leave.
  static_assert(PtrArrayMainloop::DispatchPolicy::Stages >= (kGather ? 4 : kFp8 ? 5 : 6),
                "the epilogue's shared memory costs main-loop stages");
};

// The setup kernel writes one int64 leading dimension of D per group, and three int32 per problem: the
// ptr-array stride of D must be that one int64 (its other modes static), each problem shape three ints.
template <typename Stride>
constexpr bool kOneLeadingDim = sizeof(Stride) == sizeof(int64_t);
static_assert(sizeof(ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int32_t));

inline ffi::Error Check(cutlass::Status st, const char* what) {
  if (st == cutlass::Status::kSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxmlp: CUTLASS grouped GEMM: ") + what + ": " +
                              cutlassGetStatusString(st));
}

// Launches G's Gemm (G a Grouped) over the product's arrays. The problem shapes live on the device only, so
// the kernel's persistent scheduler walks the groups there (no host copy of the group sizes). CUTLASS's (N, K) of a
// group: kNN (N, K), B = rhs[g] [K, N] N-major; kNT (K, N), B = rhs[g] [K, N] read as [K rows of N]. In both
// B's leading dimension is N and A's rows are CUTLASS's K long.
template <typename G>
ffi::Error Launch(const CutlassLaunch& l, bool nt) {
  using Gemm = typename G::Gemm;
  using Kernel = typename Gemm::GemmKernel;
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementD = typename Gemm::ElementD;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(kOneLeadingDim<StrideD>);
  const int64_t E = l.E, n = nt ? l.K : l.N, k = nt ? l.N : l.K;
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {int(E), reinterpret_cast<ProblemShape::UnderlyingProblemShape*>(l.problems->shapes), nullptr};
  args.mainloop = {static_cast<const ElementA*>(l.lhs), l.rows, k, static_cast<const ElementB*>(l.rhs), E, l.N, n, k,
                   l.offsets, G::kFuses == Fusion::kGatedFc1 ? l.N / 2 : 0, l.gather, l.gather_div, l.sources};
  if constexpr (G::kFp8) {
    // TensorScaled's arguments: beta (a scalar), C, then the scales' broadcast (both pointers) and acc.
    args.epilogue.thread = {{{l.beta}}, {}, {{{1.0f, 1.0f}, {l.lhs_scale, l.rhs_scale}}, {}, {}}, {}};
  } else {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = l.beta;
  }
  args.epilogue.ptr_C = static_cast<const ElementD**>(static_cast<void*>(l.out_ptrs));
  args.epilogue.dC = reinterpret_cast<StrideD*>(l.problems->ldd);
  args.epilogue.ptr_D = reinterpret_cast<ElementD**>(l.out_ptrs);
  args.epilogue.dD = reinterpret_cast<StrideD*>(l.problems->ldd);
  if constexpr (G::kFuses != Fusion::kNone) {
    constexpr bool kFc1 = !IsDgradFusion(G::kFuses);
    const CutlassActivation& act = *l.activation;
    args.epilogue.h = static_cast<ElementD*>(kFc1 ? l.out : const_cast<void*>(act.h));
    args.epilogue.a = static_cast<ElementD*>(kFc1 ? act.a : l.out);
    args.epilogue.dh = static_cast<ElementD*>(act.dh);
    args.epilogue.scales = static_cast<const ElementD*>(act.scales);
    args.epilogue.b1 = static_cast<const ElementD*>(act.b1);
    args.epilogue.ds = act.ds_parts;
    args.epilogue.offsets = l.offsets;
    args.epilogue.f = G::kFuses == Fusion::kGatedFc1 ? l.N / 2 : kFc1 ? l.N : l.K;
    args.epilogue.act = act.act;
  }
  // Consecutive tiles along N: the CTAs at work together share A's rows and read each group's weights
  // (at most a few MB) from L2, where along M a large group's rows were read again for every column of
  // tiles (skewed routing at dsv3: 0.92x cuBLASLt along M, 0.96x along N; balanced routing unchanged).
  args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;
  args.hw_info.device_id = l.device;
  args.hw_info.sm_count = l.sm_count;
  if (Gemm::get_workspace_size(args) > CutlassWorkspaceBytes())
    return ffi::Error::Internal("jaxmlp: CUTLASS grouped GEMM needs more workspace than reserved");
  Gemm gemm;
  JAXMLP_RETURN_IF_ERROR(Check(gemm.can_implement(args), "can_implement"));
  JAXMLP_RETURN_IF_ERROR(Check(gemm.initialize(args, l.workspace, l.stream), "initialize"));
  return Check(gemm.run(l.stream), "run");
}

}  // namespace cutlass_detail

// The body of RunCutlass<op>: bfloat16 or float16, with or without the cluster.
template <typename LayoutA, typename LayoutB, typename Config, cutlass_detail::Fusion kFusion, bool kGather>
ffi::Error LaunchTypes(const CutlassLaunch& l, bool nt) {
  using namespace cutlass_detail;
  if (l.bf16) return Launch<Grouped<cutlass::bfloat16_t, LayoutA, LayoutB, Config, kFusion, kGather>>(l, nt);
  return Launch<Grouped<cutlass::half_t, LayoutA, LayoutB, Config, kFusion, kGather>>(l, nt);
}
// The tensorwise FP8 product (kNT) of e4m3 operands, into bfloat16 or float16, with or without the cluster.
template <bool kFastAccumulation>
ffi::Error LaunchFp8(const CutlassLaunch& l) {
  using namespace cutlass_detail;
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
  using E4m3 = cutlass::float_e4m3_t;
  if (WithoutCluster(l)) {
    using Config = Fp8<NoCluster<Pingpong128x128>, kFastAccumulation>;
    if (l.bf16) return Launch<Grouped<cutlass::bfloat16_t, A, B, Config, Fusion::kNone, false, E4m3>>(l, true);
    return Launch<Grouped<cutlass::half_t, A, B, Config, Fusion::kNone, false, E4m3>>(l, true);
  }
  using Config = Fp8<Pingpong128x128, kFastAccumulation>;
  if (l.bf16) return Launch<Grouped<cutlass::bfloat16_t, A, B, Config, Fusion::kNone, false, E4m3>>(l, true);
  return Launch<Grouped<cutlass::half_t, A, B, Config, Fusion::kNone, false, E4m3>>(l, true);
}

template <typename LayoutA, typename LayoutB, cutlass_detail::Fusion kFusion = cutlass_detail::Fusion::kNone,
          bool kGather = false>
ffi::Error LaunchLayouts(const CutlassLaunch& l, bool nt) {
  using namespace cutlass_detail;
  // The gathered FC1 on its split-N tiles (GatherSplitN), every other product on ping-pong 128x128 ones.
  using Config = cute::conditional_t<kGather, SplitN128x256, Pingpong128x128>;
  if (WithoutCluster(l)) return LaunchTypes<LayoutA, LayoutB, NoCluster<Config>, kFusion, kGather>(l, nt);
  return LaunchTypes<LayoutA, LayoutB, Config, kFusion, kGather>(l, nt);
}

}  // namespace jaxmlp
