// The tiled grouped GEMM's kernel (see tiled_gemm.h): one thread block per kBM x kBN output tile, one warpgroup
// (four warps) on the tensor cores, operands staged through shared memory by a kStages-deep cp.async
// pipeline. On Hopper (built for sm_90a) a k-step is four asynchronous warpgroup MMAs (wgmma) reading
// both operands from shared memory; elsewhere each warp computes 16 rows with mma.sync m16n8k16 on
// fragments read by ldmatrix. Operands are copied in their global orientation into the swizzled layout
// that both read (Swizzled); a transposed operand is read transposed, not transposed in memory.
// Here: which tile a block computes, its pipeline, split-K and epilogue; the tiles and their loader are
// tiled_staging.cuh, the k-step tiled_mma_*.cuh, the dispatch tiled_gemm.cu (the only includer).
#pragma once

#include <cuda_pipeline.h>

#include "cuda/elements.cuh"
#include "cuda/group_scan.cuh"
#include "cuda/launch.cuh"
#include "cuda/gemm/tiled_gemm.h"
#include "cuda/gemm/tiled_staging.cuh"

// A k-step on the tensor cores (FenceForTensorCores, MmaStep): wgmma where this is compiled for sm_90a,
// mma.sync elsewhere.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "cuda/gemm/tiled_mma_wgmma.cuh"
#else
#include "cuda/gemm/tiled_mma_sync.cuh"
#endif

namespace jaxmlp {
namespace {

struct Product {
  GemmSpec s;
  int64_t first_block;  // products occupy consecutive ranges of blockIdx.x
  int32_t tiles_i;      // kTN: tiles over the K rows of out[g]
  int32_t tiles_j;      // tiles over the output columns
  int32_t out_bytes;    // bytes per output element
  int32_t splits;       // kNN/kNT: blocks per output tile, each reducing over one part of the k-steps
  int32_t split_tile0;  // with splits > 1: the product's first arrival counter in the split-K scratch,
  int32_t split_slot0;  // and its first partial-sum slot (splits per tile)
};

struct Params {
  TiledGroups groups;
  int64_t row_tiles;    // kNN/kNT blocks per tile column: the most row tiles any group_sizes can make
  int32_t n;
  bool early;           // read group_sizes and call inputs before WaitForPrevious (RunTiledGemms)
  Product prod[kMaxGemms];
};

// Where a block's tile lies: the group, its rows [start, start + count), and for kNN/kNT the index of
// the tile among the group's row tiles. group < 0: the block has no tile (grids are sized for the worst
// case of group_sizes). Also the scan's totals: rows in groups (the rest is padding) and row tiles used.
struct Site {
  int32_t group;
  int64_t start, count, tile;
  int64_t valid_rows, used_row_tiles;
};

// Finds the group of row tile `target` (by_row_tile) or group `target` (ScanGroups' policy); block 0 of a
// call's first launch (write_arrays) also writes the arrays.
__device__ Site FindSite(const TiledGroups& gr, bool write_arrays, bool by_row_tile, int64_t target) {
  write_arrays = write_arrays && blockIdx.x == 0 && threadIdx.x < 32;
  Site site{-1, 0, 0, 0, 0, 0};
  int64_t carry_tiles = 0;
  site.valid_rows = ScanGroups(gr.sizes, gr.E, gr.M, write_arrays ? gr.counts : nullptr,
                               write_arrays ? gr.offsets : nullptr, [&](int64_t g, int64_t start, int64_t count) {
    const int64_t tiles = (count + kBM - 1) / kBM;
    int64_t pass_tiles;
    const int64_t tile_end = carry_tiles + BlockInclusiveSum<1>(tiles, &pass_tiles), first_tile = tile_end - tiles;
    const bool here = g < gr.E && (by_row_tile ? target >= first_tile && target < tile_end : g == target);
    if (const unsigned found = __ballot_sync(~0u, here)) {  // one lane at most: the row tiles are disjoint
      const int src = __ffs(found) - 1;
      site.group = int32_t(g - threadIdx.x % 32 + src);
      site.start = __shfl_sync(~0u, start, src);
      site.count = __shfl_sync(~0u, count, src);
      site.tile = target - __shfl_sync(~0u, first_tile, src);
    }
    carry_tiles += pass_tiles;
  });
  site.used_row_tiles = carry_tiles;
  return site;
}

// A kNN/kNT block whose row tile holds no rows writes zeros to the rows past the groups (padding)
// instead, so that no kernel of its own has to: spare block `spare` of `spares` takes the padding's
// kBM-row slices spare, spare + spares, ... in its tile's columns. RunTiledGemms sizes the grid so that
// there is a spare block whenever there is padding.
__device__ void ZeroPaddingSlices(const Product& q, const Site& site, int64_t M, int64_t spare, int64_t spares,
                                  int64_t tile_j) {
  // In 16-byte units: the row length is a multiple of 8 elements of at least 2 bytes (TiledGemmSupports).
  const int64_t units = (q.s.op == GemmOp::kNN ? q.s.N : q.s.K) * q.out_bytes / 16;
  const int64_t u0 = tile_j * kBN * q.out_bytes / 16, width = min(int64_t(kBN) * q.out_bytes / 16, units - u0);
  int4* out = static_cast<int4*>(q.s.out);
  for (int64_t r0 = site.valid_rows + spare * kBM; r0 < M; r0 += spares * kBM)
    for (int64_t v = threadIdx.x; v < kBM * width && r0 + v / width < M; v += kThreads)
      out[(r0 + v / width) * units + u0 + v % width] = int4{0, 0, 0, 0};
}


// A pair that device code can build (std::pair's constructors are host functions to nvcc).
template <typename A, typename B>
struct Both {
  A a;
  B b;
};
template <typename A, typename B>
Both(A, B) -> Both<A, B>;

// Which part of a tile's reduction a block computes: split `index` of `count`. A split tile has an
// arrival counter `tile` and partial-sum slots slot0 ... slot0 + count - 1 in the split-K scratch.
struct Split {
  int32_t index, count, tile, slot0;
};

// Sums the partial sums of all blocks of a split output tile into acc, in the block that finishes last;
// returns false in the others. Each block leaves its accumulators in its slot, every thread its own
// registers at [register][thread], so the last block reads them back in its own registers' order. The
// sum runs over the splits in index order whichever block is last, so the result is deterministic.
__device__ bool GatherSplits(Accumulators& acc, const TiledGroups& gr, const Split& split) {
  float* flat = &acc[0][0];
  float* slot = gr.split_partials + int64_t(split.slot0 + split.index) * kTiledTileElems;
#pragma unroll
  for (int r = 0; r < 32; ++r) slot[r * kThreads + threadIdx.x] = flat[r];
  __threadfence();  // the partial sums are visible before this block counts as arrived
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    last = atomicAdd(&gr.split_arrivals[split.tile], 1) == split.count - 1;
    if (last) gr.split_arrivals[split.tile] = 0;  // ready for the next split launch of the call
  }
  __syncthreads();
  if (!last) return false;
  __threadfence();
  const float* slots = gr.split_partials + int64_t(split.slot0) * kTiledTileElems + threadIdx.x;
#pragma unroll
  for (int r = 0; r < 32; ++r) {  // unrolled whole, so that the loads are in flight together
    float total = 0.0f;
#pragma unroll
    for (int other = 0; other < kMaxSplits; ++other)
      if (other < split.count)
        total += other == split.index ? flat[r] : __ldcg(slots + other * kTiledTileElems + r * kThreads);
    flat[r] = total;
  }
  return true;
}

// One output tile of product q (see GemmOp in codes.h for the three products). In kBK-deep steps over
// the reduction: A is the kBM x kBK slice of the left factor, B the kBK x kBN slice of the right one,
// each staged as it lies in memory, so K-major (the reduction along the staged tile's columns) or
// MN-major (along its rows):
//   kNN: A = lhs rows (K-major),      B = rhs[g] (MN-major),                    reduction over K
//   kNT: A = lhs rows (K-major),      B = rhs[g]^T (rhs[g] rows: K-major),       reduction over N
//   kTN: A = lhs rows^T (MN-major),   B = rhs rows (MN-major),                  reduction over the group's rows
// early: this block has not waited for the kernel ahead yet (Params::early); it starts the copies of the
// operands that are call inputs first.
template <GemmOp kOp, int kStages, typename T, typename OutT>
__device__ void Tile(const GemmSpec& q, const TiledGroups& gr, const Site& site, int64_t tile_i, int64_t tile_j,
                     Split split, T* smem, bool early) {
  constexpr bool kAKMajor = kOp != GemmOp::kTN, kBKMajor = kOp == GemmOp::kNT;
  const int64_t K = q.K, N = q.N, g = site.group, start = site.start, count = site.count;
  const T* lhs = static_cast<const T*>(q.lhs);
  const T* rhs = static_cast<const T*>(q.rhs);
  const int64_t i0 = (kOp == GemmOp::kTN ? tile_i : site.tile) * kBM, j0 = tile_j * kBN;
  const int64_t reduction = kOp == GemmOp::kNN ? K : kOp == GemmOp::kNT ? N : count;

  auto a_tile = [&](int stage) { return smem + stage * 2 * kTiledTileElems; };
  auto b_tile = [&](int stage) { return smem + stage * 2 * kTiledTileElems + kTiledTileElems; };
  // A's and B's tiles at k = 0 (see the table above); the reduction runs along kReduceRows.
  auto loaders = [&] {
    if constexpr (kOp == GemmOp::kNN)
      return Both{TileLoader<false, T>(lhs + start * K, K, i0, count, 0, K),
                  TileLoader<true, T>(rhs + g * K * N, N, 0, K, j0, N)};
    else if constexpr (kOp == GemmOp::kNT)
      return Both{TileLoader<false, T>(lhs + start * N, N, i0, count, 0, N),
                  TileLoader<false, T>(rhs + g * K * N, N, j0, K, 0, N)};
    else
      return Both{TileLoader<true, T>(lhs + start * K, K, 0, count, i0, K),
                  TileLoader<true, T>(rhs + start * N, N, 0, count, j0, N)};
  }();
  auto load = [&](int stage, int64_t k0) {
    loaders.a.Load(a_tile(stage), k0);
    loaders.b.Load(b_tile(stage), k0);
  };
  // This block's k-steps: split.index's share of the reduction.
  const int64_t all_steps = (reduction + kBK - 1) / kBK, per_split = (all_steps + split.count - 1) / split.count;
  const int64_t k_first = split.index * per_split * kBK;
  const int64_t steps = max(int64_t(0), min(all_steps - split.index * per_split, per_split));
  // The pipeline's first stages. The copies started before the wait join the first commit group, which
  // the first k-step waits for.
  const bool a_early = early && q.lhs_is_input, b_early = early && q.rhs_is_input;
  for (int s = 0; s < kStages - 1 && s < steps; ++s) {
    if (a_early) loaders.a.Load(a_tile(s), k_first + s * kBK);
    if (b_early) loaders.b.Load(b_tile(s), k_first + s * kBK);
  }
  if (early) WaitForPrevious();
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps && !a_early) loaders.a.Load(a_tile(s), k_first + s * kBK);
    if (s < steps && !b_early) loaders.b.Load(b_tile(s), k_first + s * kBK);
    __pipeline_commit();
  }

  Accumulators acc = {};
  for (int64_t step = 0; step < steps; ++step) {
    __pipeline_wait_prior(kStages - 2);
    FenceForTensorCores();
    __syncthreads();  // the stage is complete for all threads, and the one refilled below is consumed
    if (step + kStages - 1 < steps) load((step + kStages - 1) % kStages, k_first + (step + kStages - 1) * kBK);
    __pipeline_commit();
    MmaStep<kAKMajor, kBKMajor>(acc, a_tile(step % kStages), b_tile(step % kStages));
  }
  __pipeline_wait_prior(0);
  if (split.count > 1 && !GatherSplits(acc, gr, split)) return;
  __syncthreads();  // all warps are done with the operand tiles: the accumulators go where they were

  float* c = reinterpret_cast<float*>(smem);
  const int lane = threadIdx.x % 32, row = threadIdx.x / 32 * 16 + lane / 4, col = lane % 4 * 2;
#pragma unroll
  for (int n = 0; n < 8; ++n) {  // see Accumulators
    float* r = c + row * kLdc + n * 8 + col;
    r[0] = acc[n][0], r[1] = acc[n][1];
    r[8 * kLdc] = acc[n][2], r[8 * kLdc + 1] = acc[n][3];
  }
  __syncthreads();

  // Output tile rows [i0, row_end) and columns [j0, col_end) of a row-major matrix with ld columns.
  OutT* out = static_cast<OutT*>(q.out);
  int64_t ld, row_end;
  if constexpr (kOp == GemmOp::kTN) out += g * K * N, ld = N, row_end = K;
  else out += start * (kOp == GemmOp::kNN ? N : K), ld = kOp == GemmOp::kNN ? N : K, row_end = count;
  const int64_t col_end = kOp == GemmOp::kNT ? K : N;
  for (int v = threadIdx.x; v < kBM * kBN / kVec; v += kThreads) {
    const int i = v / (kBN / kVec), j = v % (kBN / kVec) * kVec;
    if (i0 + i >= row_end || j0 + j >= col_end) continue;
    OutT* dst = out + (i0 + i) * ld + j0 + j;
    Vec<OutT, kVec> o;
    if (q.beta != 0.0f) o = Load<OutT, kVec>(dst);  // accumulate onto a prefilled bias
    for (int k = 0; k < kVec; ++k)
      o.v[k] = Conv<OutT>::From(c[i * kLdc + j + k] + (q.beta != 0.0f ? q.beta * Conv<OutT>::To(o.v[k]) : 0.0f));
    Store<OutT, kVec>(dst, o);
  }
}

template <typename T, typename OutT, int kStages>
__global__ void __launch_bounds__(kThreads) TiledGemmKernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // No bf16 tensor cores or cp.async: never launched (TiledPathAvailable checks the compiled version).
#else
  // A launch after one of the call's own kernels finds its tile before waiting for that kernel: no
  // kernel of the call writes group_sizes, and the kernels before that one have completed (it waited
  // for them before letting this launch start). The first launch waits at once.
  if (!p.early) WaitForPrevious();
  extern __shared__ __align__(128) char dynamic_smem[];
  const uint32_t misalign = SharedAddress(dynamic_smem) % kSwizzleAtom;
  T* smem = reinterpret_cast<T*>(dynamic_smem + (kSwizzleAtom - misalign) % kSwizzleAtom);
  int which = 0;
  while (which + 1 < p.n && blockIdx.x >= p.prod[which + 1].first_block) ++which;
  const Product& q = p.prod[which];
  // 32-bit index arithmetic (the grid has < 2^31 blocks): a 64-bit division is a long instruction
  // sequence on every block's way to its first copy. The splits of a tile are adjacent blocks; b
  // numbers the tiles.
  const int32_t split_index = int32_t(blockIdx.x - q.first_block) % q.splits;
  const int32_t b = int32_t(blockIdx.x - q.first_block) / q.splits;
  const bool by_row_tile = q.s.op != GemmOp::kTN;
  const Site site = FindSite(p.groups, !p.early, by_row_tile,
                             by_row_tile ? b / q.tiles_j : b / (q.tiles_i * q.tiles_j));
  const int32_t tile_i = b / q.tiles_j % q.tiles_i, tile_j = b % q.tiles_j;
  if (!p.early && blockIdx.x == 0 && p.groups.split_arrivals)  // for the call's split launches, all after this one
    for (int i = threadIdx.x; i < kTiledSplitSlots; i += kThreads) p.groups.split_arrivals[i] = 0;
  if (site.group < 0) {  // only kNN/kNT blocks: a kTN block's group always exists
    if (p.early) WaitForPrevious();
    if (split_index != 0) return;
    return ZeroPaddingSlices(q, site, p.groups.M, b / q.tiles_j - site.used_row_tiles,
                             p.row_tiles - site.used_row_tiles, tile_j);
  }
  const Split split{split_index, q.splits, q.split_tile0 + b, q.split_slot0 + b * q.splits};
  switch (q.s.op) {
    case GemmOp::kNN:
      return Tile<GemmOp::kNN, kStages, T, OutT>(q.s, p.groups, site, tile_i, tile_j, split, smem, p.early);
    case GemmOp::kNT:
      return Tile<GemmOp::kNT, kStages, T, OutT>(q.s, p.groups, site, tile_i, tile_j, split, smem, p.early);
    default:
      return Tile<GemmOp::kTN, kStages, T, OutT>(q.s, p.groups, site, tile_i, tile_j, split, smem, p.early);
  }
#endif
}

}  // namespace
}  // namespace jaxmlp
