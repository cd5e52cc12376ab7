// A main loop for CUTLASS's ptr-array grouped kernels in which no TMA descriptor is rewritten inside the
// kernel. The ptr-array main loop gives every group its own A and B descriptors, rewritten (in shared memory,
// then copied to global memory behind a proxy fence) whenever a CTA's next tile lies in another group, which
// with many small groups is nearly every tile. Here each operand is one tensor for the whole call:
//   A: the rows of every group, one descriptor over all of them ((rows, K) and a batch mode of 1; rows sorted
//      by group, so group g's rows are rows [offsets[g], offsets[g] + M_g)); a tile of group g loads from row
//      offsets[g] + m * BLK_M on. Rows past the group's end belong to the next group, or are padding past
//      the last group (any value, NaN included), or lie past the tensor (TMA fills zeros): each output row
//      depends on its own A row only, and these reach accumulator rows that the epilogue does not store (the
//      problem's M is M_g). TMA bounds every load by the descriptors, whatever the offsets hold.
//   B: one 3-D descriptor over the groups' matrices (N, K, groups), a tile of group g at batch coordinate g.
//      With kSplitB (a gated FC1, whose epilogue pairs each gate column with its up column), output tile n
//      is pairs of 64-column pieces of B, gate [64 i, +64) and up [up + 64 i, +64) (Arguments::up_column)
//      for i = BLK_N / 128 n + j, j < BLK_N / 128, loaded into the stage as gate, up, gate, up, ...: within
//      each 128 columns of the tile (a warpgroup's, in the 128x256 kernel), accumulator columns c and c + 64
//      are a gate column and its up column.
//   With kGatherA (FC1 of the MoE layer, whose rows are tokens of x chosen by the dispatch plan), A is the
//      tokens (sources, K) and row r of the product is token gather[r] / gather_div of it (the plan's choice
//      t k + j: token t), zeros where gather[r] < 0 (padding) or the token is past the tokens: no gathered
//      copy of the rows is ever written. Hopper's TMA cannot gather rows, so the producer warpgroup's 128
//      threads load A's tiles by cp.async (GatherSplitN, cutlass_gather_kernel.cuh, calls load with all
//      of them), thread 0 also B's by TMA: each stage's full barrier then completes on 1 + 128 arrivals
//      (NumProducerThreadEvents, which the kernel reads), thread 0's with B's transaction bytes alone and
//      each thread's when its copies have landed (cp.async.mbarrier.arrive.noinc), as CUTLASS's
//      TMA-and-cp.async pipelines signal them. Rows past the group's end are zero filled (nothing read).
// A group change moves only the coordinates (tensors_perform_update); the kernel's tensormap hooks are empty.
// This serves the products whose ragged dimension is M (kNN, kNT); the reduction K is the same for all groups.
// The epilogue is the kernel's own (per-group D pointers, rows past M_g not stored), or the activation's
// (cutlass_activation_epilogue.cuh).
//
// This relies on how CUTLASS 4.2's ptr-array kernels drive their main loop (the build pins nvidia-cutlass
// 4.2.*): tensors_perform_update before the first load of every group (including a CTA's first tile), the
// tensormap hooks as the only users of per-group descriptors, no descriptor prefetch, no auxiliary load.
#pragma once

#include <cstdint>

#include "cute/arch/copy_sm80.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/version.h"

static_assert(CUTLASS_MAJOR == 4 && CUTLASS_MINOR == 2,
              "jaxmlp's varlen main loop is checked against CUTLASS 4.2's ptr-array kernels only");

namespace jaxmlp::cutlass_detail {

// The TMA copy of one operand, (mn, k, l) with the given strides, loading (tile mode kMode, K) boxes into one
// stage of SmemLayout, multicast over the cluster's mode kMulticastMode.
template <class TileShape, class ClusterShape, class GmemCopy, class SmemLayout, int kMode, int kMulticastMode,
          class Element, class Stride>
auto MakeOperandTma(Element const* ptr, int32_t mn, int32_t k, int32_t l, Stride stride) {
  auto tensor = cute::make_tensor(ptr, cute::make_layout(cute::make_shape(mn, k, l), stride));
  return cute::make_tma_copy(GmemCopy{}, tensor, SmemLayout{}(cute::_, cute::_, cute::Int<0>{}),
                             cute::make_shape(cute::shape<kMode>(TileShape{}), cute::shape<2>(TileShape{})),
                             cute::size<kMulticastMode>(ClusterShape{}));
}

// The operands' element types as the TMA copies them: the 16-bit main loop's InternalElementA/B (unsigned
// integers of the width), where the FP8 main loop (which has none) copies its ElementA/B.
template <class Base, class = void>
struct CopiedElements {
  using A = typename Base::ElementA;
  using B = typename Base::ElementB;
};
template <class Base>
struct CopiedElements<Base, cute::void_t<typename Base::InternalElementA>> {
  using A = typename Base::InternalElementA;
  using B = typename Base::InternalElementB;
};

// Base: the CollectiveMma that CUTLASS's builder makes for a ptr-array kernel (its pipeline, shared memory
// layouts and wgmma consumer are kept; its loads and operand descriptors are replaced).
template <class Base, bool kSplitB = false, bool kGatherA = false>
struct VarlenMainloop : Base {
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  using InternalElementA = typename CopiedElements<Base>::A;
  using InternalElementB = typename CopiedElements<Base>::B;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;

  // The operands' strides with a dynamic batch mode: (M, K, 1) for A, (N, K, groups) for B. The ptr-array
  // strides have the batch mode static; one of M/N and K is the static unit stride, the other the leading
  // dimension.
  using StrideA3 = decltype(cute::replace<2>(typename Base::InternalStrideA{}, int64_t{}));
  using StrideB3 = decltype(cute::replace<2>(typename Base::InternalStrideB{}, int64_t{}));
  template <class Stride>
  static Stride MakeStride(int64_t ld, int64_t batch) {
    Stride s{};
    if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) cute::get<1>(s) = ld;
    else cute::get<0>(s) = ld;
    cute::get<2>(s) = batch;
    return s;
  }

  // kSplitB: B's loads are 64-column pieces into consecutive pieces of a stage. They must be contiguous in
  // shared memory, as CUTLASS lays out an N-major B (its 64-column swizzle atoms along K first): then each
  // piece starts a whole number of swizzle periods in, and one piece layout serves all.
  static constexpr int kBlkN = cute::size<1>(TileShape{}), kBlkK = cute::size<2>(TileShape{});
  static constexpr int kStages = cute::size<2>(SmemLayoutB{});
  static constexpr int kBlkM = cute::size<0>(TileShape{});
  static constexpr int kPieceN = kSplitB ? 64 : kBlkN, kPieces = kBlkN / kPieceN;
  using BTileShape = cute::Shape<cute::Int<kBlkM>, cute::Int<kPieceN>, cute::Int<kBlkK>>;
  using SmemLayoutBLoad = cute::conditional_t<kSplitB,
      decltype(cute::composition(SmemLayoutB{}, cute::make_layout(
          cute::make_shape(cute::Int<kPieceN>{}, cute::Int<kBlkK>{}, cute::Int<kStages>{}),
          cute::make_stride(cute::_1{}, cute::Int<kBlkN>{}, cute::Int<kBlkN * kBlkK>{})))),
      SmemLayoutB>;
  static constexpr int kPieceB = kPieceN * kBlkK;  // elements of one piece of a stage
  static_assert(!kSplitB || (kBlkN % 128 == 0 && SmemLayoutB{}(kPieceN, 0, 0) == kPieceB),
                "B's pieces are not contiguous in a stage");

  // kGatherA: the producer warpgroup's cp.async arrivals and thread 0's; else the leader's alone.
  static constexpr int kGatherThreads = cutlass::NumThreadsPerWarpGroup;
  static constexpr int NumProducerThreadEvents = kGatherA ? 1 + kGatherThreads : Base::NumProducerThreadEvents;
  static constexpr uint32_t kTmaBytesB = cutlass::bits_to_bytes(
      cute::size<0>(SmemLayoutB{}) * cute::size<1>(SmemLayoutB{}) * uint32_t(cutlass::sizeof_bits<ElementB>::value));
  // kGatherA's cp.async tiling of a stage of A (K-major, rows of BLK_K 16-bit elements): 16-byte chunks, 8
  // threads a row (a row's 128 bytes in one instruction), 16 rows a pass; each thread copies the same chunk
  // of kPasses rows, whose sources it reads once a tile. Four warps so laid out keep pace with the wgmma main
  // loop where one warp cannot (docs/engine-performance.md, "Rows gathered in FC1's loads").
  static constexpr int kChunk = 16 / int(sizeof(InternalElementA));
  static constexpr int kChunksPerRow = kBlkK / kChunk;
  static constexpr int kRowsPerPass = kGatherThreads / kChunksPerRow;
  static constexpr int kPasses = kBlkM / kRowsPerPass;
  static_assert(!kGatherA || (kBlkK * sizeof(InternalElementA) == 128 && kBlkM % kRowsPerPass == 0),
                "the gathered loads are laid out for 128-byte rows of A's stage and whole passes of rows");
  static_assert(!kGatherA || cute::is_same_v<typename Base::GmemTiledCopyA, cute::SM90_TMA_LOAD>,
                "A gathered by each CTA itself: no multicast along the cluster's N mode");

  // A multicasts along the cluster's N mode (its tile is shared by the CTAs of one M), B along M.
  using TmaA = decltype(MakeOperandTma<TileShape, ClusterShape, GmemTiledCopyA, SmemLayoutA, 0, 1>(
      static_cast<InternalElementA const*>(nullptr), 0, 0, 0, StrideA3{}));
  using TmaB = decltype(MakeOperandTma<BTileShape, ClusterShape, GmemTiledCopyB, SmemLayoutBLoad, 1, 0>(
      static_cast<InternalElementB const*>(nullptr), 0, 0, 0, StrideB3{}));

  struct Arguments {
    ElementA const* A;          // [rows, K] or its transpose per the layout, leading dimension lda
    int64_t rows, lda;
    ElementB const* B;          // groups x (N, K), each packed, leading dimension ldb
    int64_t groups, ldb;
    int64_t N, K;               // CUTLASS's N and K of every group
    int64_t const* offsets;     // [groups] the first row of each group in A (device)
    int64_t up_column = 0;      // kSplitB: the first up column of B (a multiple of 64)
    int32_t const* gather = nullptr;  // kGatherA: [rows] each row's source (any values; see above)
    int32_t gather_div = 1;           // kGatherA: row r is token gather[r] / gather_div of A
    int64_t sources = 0;              // kGatherA: A's rows (tokens)
  };

  struct Params : Base::Params {
    TmaA tma_a;
    TmaB tma_b;
    int32_t rows, N, K, groups;
    int64_t const* offsets;
    int32_t up_piece;  // kSplitB: up_column in 64-column pieces
    ElementA const* A;  // kGatherA: the tokens, leading dimension lda
    int64_t lda;
    int32_t const* gather;
    int32_t gather_div, sources;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    Params p{};
    // kGatherA: the descriptor over the tokens is never loaded from (the kernel reads the tile counts of
    // Tiles' coordinates only).
    p.tma_a = MakeOperandTma<TileShape, ClusterShape, GmemTiledCopyA, SmemLayoutA, 0, 1>(
        reinterpret_cast<InternalElementA const*>(args.A), int32_t(kGatherA ? args.sources : args.rows),
        int32_t(args.K), 1, MakeStride<StrideA3>(args.lda, 0));
    p.tma_b = MakeOperandTma<BTileShape, ClusterShape, GmemTiledCopyB, SmemLayoutBLoad, 1, 0>(
        reinterpret_cast<InternalElementB const*>(args.B), int32_t(args.N), int32_t(args.K), int32_t(args.groups),
        MakeStride<StrideB3>(args.ldb, args.N * args.K));
    p.tma_transaction_bytes = kGatherA ? kTmaBytesB : Base::TmaTransactionBytes;
    p.rows = int32_t(args.rows), p.N = int32_t(args.N), p.K = int32_t(args.K), p.groups = int32_t(args.groups);
    p.offsets = args.offsets;
    p.up_piece = int32_t(args.up_column / kPieceN);
    p.A = args.A, p.lda = args.lda, p.gather = args.gather, p.gather_div = args.gather_div;
    p.sources = int32_t(args.sources);
    return p;
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) { return 0; }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  // TMA: 16-byte aligned base addresses and leading dimensions; every extent at least 1 (a descriptor that
  // fails to encode is only an assert in cute) and, with a tile's first row up to rows + BLK_M * cluster
  // rows (a group's tiles are rounded up to whole clusters), within int32 coordinates.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    constexpr int kA = 128 / cutlass::sizeof_bits<ElementA>::value, kB = 128 / cutlass::sizeof_bits<ElementB>::value;
    constexpr int64_t kRowSlack = cute::size<0>(TileShape{}) * cute::size<0>(ClusterShape{});
    const auto extent = [](int64_t n, int64_t most) { return n >= 1 && n <= most; };
    return reinterpret_cast<uintptr_t>(args.A) % 16 == 0 && reinterpret_cast<uintptr_t>(args.B) % 16 == 0 &&
           args.lda % kA == 0 && args.ldb % kB == 0 && args.offsets != nullptr &&
           extent(args.rows, INT32_MAX - kRowSlack) && extent(args.groups, INT32_MAX) && extent(args.N, INT32_MAX) &&
           extent(args.K, INT32_MAX) &&
           (!kSplitB || (args.up_column > 0 && args.up_column % kPieceN == 0 && args.N == 2 * args.up_column)) &&
           (!kGatherA || (args.gather != nullptr && args.gather_div >= 1 && extent(args.sources, INT32_MAX)));
  }

  // The tiled coordinate tensors of group `group`, whose rows start at row `row` of A: (BLK_M, BLK_K, m, k, 1)
  // and (BLK_N, BLK_K, n, k, groups) with the origin moved to batch `group`, so that the kernel's slice at
  // batch 0 (it passes the group's index to the epilogue only) is the group's. The kernel reads the tile
  // counts of these two; the loads read the third, B in the tiles it loads (pieces with kSplitB), and
  // with kGatherA the group's rows [row, row_end).
  CUTLASS_DEVICE static auto Tiles(Params const& p, int32_t row, int32_t group, int32_t row_end) {
    using namespace cute;
    using X = Underscore;
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.rows, p.K, int32_t(1)));
    Tensor mB = domain_offset(make_coord(int32_t(0), int32_t(0), group),
                              p.tma_b.get_tma_tensor(make_shape(p.N, p.K, p.groups)));
    Tensor gA = local_tile(domain_offset(make_coord(row, int32_t(0), int32_t(0)), mA), TileShape{},
                           make_coord(_, _, _), Step<_1, X, _1>{});
    Tensor gB = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});
    Tensor gB_load = local_tile(mB, BTileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});
    return make_tuple(gA, gB, gB_load, row, row_end);
  }

  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const&, Params const& p) const { return Tiles(p, 0, 0, 0); }

  // The group's rows: offsets and the problem's M_g as the setup kernel wrote them (offsets[g] + M_g <= rows).
  template <class Inputs, class ProblemShapeMNKL>
  CUTLASS_DEVICE Inputs tensors_perform_update(Inputs const&, Params const& p, ProblemShapeMNKL const& problem,
                                               int32_t group) {
    const int32_t row = int32_t(p.offsets[group]);
    return Tiles(p, row, group, row + int32_t(cute::get<0>(problem)));
  }

  // The kernel's tensormap hooks: nothing to rewrite.
  CUTLASS_DEVICE auto tensormaps_init(Params const&, typename Base::TensorMapStorage&, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor const*>(nullptr), static_cast<cute::TmaDescriptor const*>(nullptr));
  }
  template <class TensorMaps, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(typename Base::TensorMapStorage&, Params const&, TensorMaps const&,
                                                ProblemShapeMNKL, int32_t) {}
  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(typename Base::TensorMapStorage&, TensorMaps const&) {}
  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_fence_acquire(TensorMaps const&) {}

  // The producer: k_tile_count k-tiles of the tile at blk_coord (m, n, _, 0) into the pipeline's stages, A and
  // B of one stage behind one transaction barrier. CUTLASS's kernel calls it with the whole producer warp
  // (`thread` its lane): one elected thread issues the TMA copies. With kGatherA GatherSplitN calls it with
  // the whole producer warpgroup (`thread` 0 to 127): thread 0, the pipeline's leader, which arrives with the
  // transaction bytes, issues B's copies, every thread its share of A's.
  template <class Inputs, class TensorMaps, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState stage, Inputs const& inputs,
                           TensorMaps const&, BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread, uint32_t block_rank_in_cluster, TensorStorage& storage) {
    using namespace cute;
    const bool issues_tma = kGatherA ? thread == 0 : bool(elect_one_sync());
    if (!kGatherA && !issues_tma) return;
    Tensor sA = make_tensor(make_smem_ptr(storage.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    constexpr uint32_t cluster_m = size<0>(ClusterShape{});
    const uint32_t in_m = block_rank_in_cluster % cluster_m, in_n = block_rank_in_cluster / cluster_m;
    auto tma_a = p.tma_a.get_slice(in_n);
    auto tma_b = p.tma_b.get_slice(in_m);
    auto [m, n, k, l] = blk_coord;
    Tensor tAgA = tma_a.partition_S(get<0>(inputs)(_, _, m, _, l));  // (TMA, TMA_M, TMA_K, k)
    Tensor tAsA = tma_a.partition_D(sA);                             // (TMA, TMA_M, TMA_K, PIPE)
    // Piece q of the stage's B: the whole tile n, or with kSplitB gate piece kPieces / 2 n + q / 2 (even q) or
    // the up piece of the same gate columns (odd q).
    const int n_tile = int(n), l_tile = int(l);  // (a lambda may not capture structured bindings in C++17)
    const auto tBgB = [&](int q) {
      const int piece = kSplitB ? (q % 2 ? p.up_piece : 0) + kPieces / 2 * n_tile + q / 2 : n_tile;
      return tma_b.partition_S(get<2>(inputs)(_, _, piece, _, l_tile));
    };
    const auto tBsB = [&](int q) {
      return tma_b.partition_D(make_tensor(make_smem_ptr(storage.smem_B.data() + q * kPieceB), SmemLayoutBLoad{}));
    };
    // A tile of A is shared by the cluster's CTAs of the same M (along N), one of B by those of the same N.
    uint16_t mask_a = 0, mask_b = 0;
    auto cluster = Layout<ClusterShape>{};  // (m, n) -> block rank
    if constexpr (is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>)
      for (int j = 0; j < size<1>(cluster); ++j) mask_a |= uint16_t(1) << cluster(in_m, j, Int<0>{});
    if constexpr (is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>)
      for (int i = 0; i < size<0>(cluster); ++i) mask_b |= uint16_t(1) << cluster(i, in_n, Int<0>{});
    // kGatherA: this thread's chunk of its rows row0 + kRowsPerPass i of the tile, addressed once a tile: each
    // row's source (its token's row of A at the chunk's column; A's first row for a row of zeros, which reads
    // nothing) and whether it is read (bit i of `reads`), and where the chunk lies in the stages. A stage's
    // rows are 128 bytes (static_assert above) under the 128-byte swizzle, whose pattern repeats every 8 rows:
    // kRowsPerPass rows further down is the same distance for every chunk, and a stage is a whole number of
    // patterns. A copy's addresses are then two additions: the per-copy address arithmetic and the swizzle,
    // recomputed for each copy, had made the producer warps the main loop's bottleneck (docs/engine-performance.md,
    // "Rows gathered in FC1's loads").
    [[maybe_unused]] const int chunk = thread % kChunksPerRow, row0 = thread / kChunksPerRow;
    [[maybe_unused]] InternalElementA const* sources[kPasses];
    [[maybe_unused]] uint32_t reads = 0, smem = 0, pass_bytes = 0, stage_bytes = 0;
    if constexpr (kGatherA) {
      const int32_t first = get<3>(inputs) + int32_t(m) * kBlkM + row0, end = get<4>(inputs);
      const auto* A = reinterpret_cast<InternalElementA const*>(p.A) + chunk * kChunk;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kPasses; ++i) {
        const int32_t r = first + kRowsPerPass * i;
        const int32_t choice = r < end ? p.gather[r] : -1;
        const int32_t token = choice >= 0 ? choice / p.gather_div : p.sources;
        const bool read = token < p.sources;
        sources[i] = A + (read ? int64_t(token) * p.lda : int64_t(0));
        reads |= uint32_t(read) << i;
      }
      smem = cast_smem_ptr_to_uint(&sA(row0, chunk * kChunk, 0));
      pass_bytes = cast_smem_ptr_to_uint(&sA(row0 + kRowsPerPass, chunk * kChunk, 0)) - smem;
      stage_bytes = cast_smem_ptr_to_uint(&sA(row0, chunk * kChunk, 1)) - smem;
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++k_tile_iter, ++stage) {
      pipeline.producer_acquire(stage);
      auto* barrier = pipeline.producer_get_barrier(stage);
      if (issues_tma) {
        if constexpr (!kGatherA)
          copy(p.tma_a.with(*barrier, mask_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage.index()));
        CUTLASS_PRAGMA_UNROLL
        for (int q = 0; q < kPieces; ++q)
          copy(p.tma_b.with(*barrier, mask_b), tBgB(q)(_, _, _, *k_tile_iter), tBsB(q)(_, _, _, stage.index()));
      }
      if constexpr (kGatherA) {
        // Each row is read once (L2 only: .cg). Past K (a last k-tile cut short) nothing is read (zeros; the
        // copies name the chunk's column of the first k-tile).
        const int32_t column = int32_t(*k_tile_iter) * kBlkK;
        const bool in_k = column + chunk * kChunk < p.K;
        const int32_t offset = in_k ? column : 0;
        const uint32_t to = smem + uint32_t(stage.index()) * stage_bytes;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kPasses; ++i) {
          const uint32_t bytes = in_k && (reads >> i & 1u) ? 16u : 0u;  // 0: zero fill
          asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(to + i * pass_bytes),
                       "l"(sources[i] + offset), "r"(bytes));
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t const*>(barrier));
      }
    }
  }

  // kGatherA: every thread's copies landed before it leaves (the stages' barriers count them).
  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState stage) {
    if constexpr (kGatherA) cute::cp_async_wait<0>();
    Base::load_tail(pipeline, stage);
  }
};

}  // namespace jaxmlp::cutlass_detail
