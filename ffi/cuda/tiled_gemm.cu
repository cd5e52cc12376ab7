// The tiled grouped GEMM (see tiled_gemm.h): one thread block per kBM x kBN output tile, one warpgroup
// (four warps) on the tensor cores, operands staged through shared memory by a kStages-deep cp.async
// pipeline. On Hopper (built for sm_90a) a k-step is four asynchronous warpgroup MMAs (wgmma) reading
// both operands from shared memory; elsewhere each warp computes 16 rows with mma.sync m16n8k16 on
// fragments read by ldmatrix. Operands are copied in their global orientation into the swizzled layout
// that both read (Swizzled); a transposed operand is read transposed, not transposed in memory.
#include "tiled_gemm.h"

#include <cuda_pipeline.h>

#include <string>
#include <type_traits>

#include "elements.cuh"
#include "group_scan.cuh"
#include "launch.cuh"

namespace jaxmlp {
namespace {

// Small problems have few tiles, one block each, and a block's time is mostly its warps' instruction
// latency (Nsight Compute: ~1 warp per scheduler). Measured on an H200 (benchmarks/NOTES.md): 64-deep
// steps with 4 stages (3 blocks per SM) beat 3 stages (also with mma.sync) for launches of one wave, and
// with the earlier WMMA version 6 stages, 32-deep steps, 8 warps per tile and split-K. A launch of more
// blocks than fit at once takes 3 stages where that fits more blocks per SM (RunTiledGemms).
constexpr int kBM = 64, kBN = 64, kBK = 64, kThreads = 128;
constexpr int kVec = 8;                  // 16-bit elements per 16-byte copy
// An operand tile (64 x 64, either orientation), a float accumulator tile and a split's partial sums
// all have kTiledTileElems elements: 32 per thread.
static_assert(kBM == kBN && kBM == kBK && kBM * kBK == kTiledTileElems && kTiledTileElems == 32 * kThreads);
constexpr int kLdc = kBN + 4;            // float accumulator tile rows in the epilogue
template <int kStages>
constexpr int kStageBytes = kStages * 2 * kTiledTileElems * 2;  // 48 or 64 KiB of operand tiles
static_assert(kBM * kLdc * 4 <= kStageBytes<3>, "the epilogue reuses the pipeline's shared memory");
constexpr int kSwizzleAtom = 1024;  // bytes: 8 tile rows of 128, over which the swizzle pattern repeats
template <int kStages>
constexpr int kSmemBytes = kStageBytes<kStages> + kSwizzleAtom;  // dynamic shared memory, aligned in the kernel
constexpr int kStepsPerSplit = 8, kMinSplits = 2, kMaxSplits = 4;  // split-K (RunTiledGemms)

// An operand tile in shared memory (64 x 64 16-bit elements, rows and columns as in global memory) is
// in wgmma's 128-byte swizzled layout: row r at r * 128 bytes, its 16-byte chunk c at position c ^ r % 8
// in the row. So a warp's 16-byte copies of 4 whole rows, and ldmatrix's reads of one chunk in 8 rows,
// are free of bank conflicts. The tile starts at a multiple of kSwizzleAtom bytes, as wgmma applies the
// pattern to the shared-memory address.
__device__ __forceinline__ int Swizzled(int row, int chunk) { return row * 64 + (chunk ^ row % 8) * 8; }

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

// Copies 64 x 64 tiles of a row-major matrix (rows of ld elements) into the swizzled layout, one tile
// per k-step of the reduction, which runs along the tile's rows (kReduceRows) or its columns. Each
// thread's 16-byte copies are set up once per output tile: a step only moves them by k and checks the
// reduction bound (the integer work per copy dominated a step otherwise). Elements past the matrix
// bounds become zeros, by a plain store (visible to all threads after the __syncthreads that also
// publishes the copies); the bound of the contiguous dimension is a multiple of kVec, so a copy is
// wholly inside or wholly outside.
template <bool kReduceRows, typename T>
class TileLoader {
 public:
  // Tile corner (o0, i0) at k = 0; elements at or past (o_end, i_end) are outside.
  __device__ TileLoader(const T* base, int64_t ld, int64_t o0, int64_t o_end, int64_t i0, int64_t i_end)
      : dst0_(Swizzled(threadIdx.x / kPerRow, threadIdx.x % kPerRow)),
        step_(kReduceRows ? ld : 1),
        reduce_end_(kReduceRows ? o_end : i_end) {
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {  // copy c: row o, chunk i / kVec; rows kRowsPerPass apart
      const int o = threadIdx.x / kPerRow + c * kRowsPerPass, i = threadIdx.x % kPerRow * kVec;
      src_[c] = base + (o0 + o) * ld + i0 + i;
      reduce_index_[c] = kReduceRows ? o0 + o : i0 + i;
      fixed_inside_[c] = kReduceRows ? i0 + i < i_end : o0 + o < o_end;
    }
  }

  // Starts the copies of the tile at reduction offset k.
  __device__ __forceinline__ void Load(T* stage, int64_t k) const {
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      T* dst = stage + dst0_ + c * kRowsPerPass * 64;  // kRowsPerPass is a multiple of 8: same swizzle
      if (fixed_inside_[c] && reduce_index_[c] + k < reduce_end_)
        __pipeline_memcpy_async(dst, src_[c] + k * step_, 16);
      else
        *reinterpret_cast<int4*>(dst) = int4{0, 0, 0, 0};
    }
  }

 private:
  static constexpr int kPerRow = 64 / kVec, kRowsPerPass = kThreads / kPerRow, kCopies = 64 / kRowsPerPass;
  static_assert(kRowsPerPass % 8 == 0);
  const T* src_[kCopies];
  int64_t reduce_index_[kCopies];
  bool fixed_inside_[kCopies];
  int dst0_;
  int64_t step_, reduce_end_;
};

// The block's accumulators: warp w holds rows 16w ... 16w + 15 of the tile, acc[n][r] the element at row
// 16w + lane / 4 + 8 (r / 2), column 8n + 2 (lane % 4) + r % 2. That is the register order of wgmma's
// m64n64 accumulators, and of eight mma.sync m16n8 accumulators side by side.
using Accumulators = float[8][4];

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Hopper's warpgroup MMA (sm_90a): a k-step is 4 instructions for the warpgroup instead of 32 MMAs and
// 20 ldmatrix per warp. Measured on an H200 (benchmarks/NOTES.md), the MMAs now take about half of a
// k-step; the rest is issuing the next stage's copies and waiting for them.

// The shared-memory matrix descriptor of a staged operand tile (Swizzled's layout: 128-byte swizzling,
// kSwizzleAtom bytes between groups of 8 rows; the leading offset is unused, as a tile row is one swizzle row).
__device__ __forceinline__ uint64_t Descriptor(const void* tile) {
  return uint64_t((SharedAddress(tile) & 0x3ffff) >> 4) | uint64_t(1) << 16 | uint64_t(kSwizzleAtom >> 4) << 32 |
         uint64_t(1) << 62;
}

// Keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs' fences.
__device__ __forceinline__ void PinAccumulators(Accumulators& d) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(d[n][r])::"memory");
}

// d (64 x 64) += A (64 x 16) B (16 x 64), A and B from shared memory; kTransA / kTransB: the operand's
// tile is MN-major (its rows run along the reduction).
template <typename T, bool kTransA, bool kTransB>
__device__ __forceinline__ void Wgmma(Accumulators& d, uint64_t a, uint64_t b) {
  // Operands: the 32 accumulators, A's and B's descriptors, scale-d (1: accumulate), the transposes.
#define JAXMLP_WGMMA(type)                                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type " "                              \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                    \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "          \
               "%32, %33, p, 1, 1, %35, %36;\n}"                                                            \
               : JAXMLP_ACC(0), JAXMLP_ACC(1), JAXMLP_ACC(2), JAXMLP_ACC(3),                                \
                 JAXMLP_ACC(4), JAXMLP_ACC(5), JAXMLP_ACC(6), JAXMLP_ACC(7)                                 \
               : "l"(a), "l"(b), "r"(1), "n"(int(kTransA)), "n"(int(kTransB)))
#define JAXMLP_ACC(n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
  if constexpr (std::is_same_v<T, __nv_bfloat16>) JAXMLP_WGMMA("bf16");
  else JAXMLP_WGMMA("f16");
#undef JAXMLP_ACC
#undef JAXMLP_WGMMA
}

// Orders this thread's writes to shared memory (cp.async copies that have landed, zero stores) before
// the tensor cores' reads of it, which go through the async proxy.
__device__ __forceinline__ void FenceForTensorCores() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// acc += A B over one kBK-deep step. kAKMajor / kBKMajor: the operand's tile has the reduction along
// its columns (else along its rows: read transposed).
template <bool kAKMajor, bool kBKMajor, typename T>
__device__ __forceinline__ void MmaStep(Accumulators& acc, const T* a, const T* b) {
  // The next 16 of k, in the descriptor's 16-byte units: 2 chunks along a row (K-major), or 16 rows.
  constexpr uint64_t kAk16 = kAKMajor ? 2 : 16 * 128 / 16, kBk16 = kBKMajor ? 2 : 16 * 128 / 16;
  const uint64_t da = Descriptor(a), db = Descriptor(b);
  PinAccumulators(acc);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) Wgmma<T, !kAKMajor, !kBKMajor>(acc, da + kAk16 * kk, db + kBk16 * kk);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  PinAccumulators(acc);
}

#else
// mma.sync m16n8k16 with ldmatrix (compute capability 8.0+), where wgmma is not available. They replaced
// WMMA's fragments: the stack of small layers in benchmarks/overhead.py ran 10% faster.

// Four 8x8 matrices of 16-bit elements, lane l giving the shared address of row l % 8 of matrix l / 8;
// kTrans transposes each. Register i of every lane holds its two elements of matrix i.
template <bool kTrans>
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], uint32_t address) {
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// acc (16 x 8, float) += A (16 x 16, row-major fragment a) * B (16 x 8, column-major fragment b0, b1).
template <typename T>
__device__ __forceinline__ void Mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void FenceForTensorCores() {}  // ldmatrix reads through the generic proxy

// acc += A B over one kBK-deep step (see the wgmma version).
template <bool kAKMajor, bool kBKMajor, typename T>
__device__ __forceinline__ void MmaStep(Accumulators& acc, const T* a, const T* b) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, j = lane / 8, r = lane % 8;
  // Lane l points at row l % 8 of matrix j = l / 8, the matrices in the order of mma.sync's fragment
  // registers. A (rows 16 warp ..., 16 of k): matrix j at rows + 8 (j % 2), k + 8 (j / 2). B (16 of k,
  // 16 columns, two 8-column fragments): k + 8 (j % 2), columns + 8 (j / 2). An MN-major tile (k along
  // its rows) is read transposed, which swaps the lane's row and column.
  const int a_m = 16 * warp + j % 2 * 8, a_k = j / 2 * 8, b_k = j % 2 * 8, b_n = j / 2 * 8;
  const uint32_t a_base = SharedAddress(a), b_base = SharedAddress(b);
  auto a_at = [&](int k) {  // bytes, at k
    return sizeof(T) * (kAKMajor ? Swizzled(a_m + r, (k + a_k) / 8) : Swizzled(k + a_k + r, a_m / 8));
  };
  auto b_at = [&](int k, int n) {  // bytes, at k and column n
    return sizeof(T) * (kBKMajor ? Swizzled(n + b_n + r, (k + b_k) / 8) : Swizzled(k + b_k + r, (n + b_n) / 8));
  };
#pragma unroll
  for (int kk = 0; kk < kBK; kk += 16) {
    uint32_t fa[4];
    LoadMatrices<!kAKMajor>(fa, a_base + a_at(kk));
#pragma unroll
    for (int p = 0; p < kBN / 16; ++p) {
      uint32_t fb[4];
      LoadMatrices<!kBKMajor>(fb, b_base + b_at(kk, 16 * p));
      Mma<T>(acc[2 * p], fa, fb[0], fb[1]);
      Mma<T>(acc[2 * p + 1], fa, fb[2], fb[3]);
    }
  }
}
#endif

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

// Adds the partial sums of the other blocks of a split output tile to acc, in the block that finishes
// last; returns false in the others. Each block leaves its accumulators in its slot, every thread its
// own registers at [register][thread], so the last block reads them back in its own registers' order.
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
    float others = 0.0f;
#pragma unroll
    for (int other = 0; other < kMaxSplits; ++other)
      if (other < split.count && other != split.index) others += __ldcg(slots + other * kTiledTileElems + r * kThreads);
    flat[r] += others;
  }
  return true;
}

// One output tile of product q (see GemmOp in common.h for the three products). In kBK-deep steps over
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

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Which MMA the kernel's code for the current device uses, for TiledPathAvailable's report: each
// compilation for a device architecture has its own value, and a module holds the one of its code.
__device__ const bool kTiledUsesWgmma =
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    true;
#else
    false;
#endif

// Whether `s` can run here: 16-bit inputs, any float output, K and N multiples of 8.
bool TiledGemmSupports(const GemmSpec& s) {
  const bool sixteen_bit = s.in_type == ffi::DataType::BF16 || s.in_type == ffi::DataType::F16;
  return sixteen_bit && IsFloat(s.out_type) && s.K % kVec == 0 && s.N % kVec == 0;
}

}  // namespace

bool TiledPathAvailable(std::string* reason) {
  int device = 0, major = 0, minor = 0;
  cudaFuncAttributes attrs{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaFuncGetAttributes(&attrs, TiledGemmKernel<__nv_bfloat16, __nv_bfloat16, 4>) != cudaSuccess) {
    cudaGetLastError();  // clear it: the call is only a query
    return *reason = "no CUDA device, or the tiled kernel has no code for it", false;
  }
  if (major < 8)
    return *reason = "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
                     ": the tiled kernel needs 8.0 or newer", false;
  // The code that runs was compiled for compute capability ptxVersion / 10 (a build for 7.5 alone, JIT
  // compiled for this device, would hold the empty kernel).
  if (attrs.ptxVersion < 80)
    return *reason = "the tiled kernel was compiled for compute capability " + std::to_string(attrs.ptxVersion / 10) +
                     "." + std::to_string(attrs.ptxVersion % 10) + " (rebuild with CMAKE_CUDA_ARCHITECTURES "
                     "including 80 or newer)", false;
  bool wgmma = false;
  if (cudaMemcpyFromSymbol(&wgmma, kTiledUsesWgmma, sizeof(wgmma)) != cudaSuccess) cudaGetLastError();
  return *reason = std::string("jaxmlp's tiled tensor-core kernel (") + (wgmma ? "wgmma" : "mma.sync") + ")", true;
}

ffi::Error RunTiledGemms(cudaStream_t stream, const TiledGroups& groups, const GemmSpec* const* specs, int n,
                         bool follows_own_kernel) {
  if (n < 1 || n > kMaxGemms) return ffi::Error::Internal("jaxmlp: 1 to 4 products per tiled launch");
  Params p{};
  p.groups = groups;
  p.n = n;
  p.early = follows_own_kernel;
  int64_t blocks = 0;
  // Row tiles of kNN/kNT: the groups use sum over groups of ceil(count / kBM) <= floor(R / kBM) + (groups
  // with rows), R being the rows in groups. The unused ones zero the padding rows, and there is one
  // whenever there is padding: row_tiles - used >= ceil(M / kBM) - floor(R / kBM) >= 1 when R < M.
  p.row_tiles = CeilDiv(groups.M, kBM) + std::min(groups.E, groups.M);
  int64_t split_tiles = 0, split_slots = 0;  // taken in the split-K scratch
  for (int i = 0; i < n; ++i) {
    const GemmSpec& s = *specs[i];
    if (!TiledGemmSupports(s) || s.in_type != specs[0]->in_type || s.out_type != specs[0]->out_type)
      return ffi::Error::InvalidArgument("jaxmlp: the tiled GEMM path needs 16-bit inputs, one dtype per launch "
                                         "and row lengths that are multiples of 8; got op " + std::to_string(int(s.op)) +
                                         ", K=" + std::to_string(s.K) + ", N=" + std::to_string(s.N));
    Product& q = p.prod[i];
    q.s = s;
    q.first_block = blocks;
    q.tiles_i = s.op == GemmOp::kTN ? int32_t(CeilDiv(s.K, kBM)) : 1;
    q.tiles_j = int32_t(CeilDiv(s.op == GemmOp::kNT ? s.K : s.N, kBN));
    q.out_bytes = int32_t(ffi::ByteWidth(s.out_type));
    q.splits = 1;
    if (s.op == GemmOp::kTN) {
      blocks += groups.E * q.tiles_i * q.tiles_j;
      continue;
    }
    // A long reduction over few tiles is the critical path of its launch (the FC1 dgrad, 16 k-steps at
    // the host-overhead layer). Split, its k-steps run in parallel blocks, and the last of them adds up
    // the partial sums, which go through L2: ~2.9 us, about 7 k-steps (H200), hence a split per
    // kStepsPerSplit steps. The arrival counters are zeroed by the call's first launch, so only the
    // later launches split.
    const int64_t tiles = p.row_tiles * q.tiles_j, steps = CeilDiv(s.op == GemmOp::kNN ? s.K : s.N, kBK);
    const int64_t splits = std::min<int64_t>(kMaxSplits, steps / kStepsPerSplit);
    if (follows_own_kernel && groups.split_partials && splits >= kMinSplits &&
        split_slots + tiles * splits <= kTiledSplitSlots) {
      q.splits = int32_t(splits);
      q.split_tile0 = int32_t(split_tiles), q.split_slot0 = int32_t(split_slots);
      split_tiles += tiles, split_slots += tiles * splits;
    }
    blocks += tiles * q.splits;
  }
  if (blocks > 0x7fffffff) return ffi::Error::InvalidArgument("jaxmlp: problem too large for the tiled GEMM");
  ByType(specs[0]->in_type, [&](auto in) {
    ByType(specs[0]->out_type, [&](auto out) {
      using T = decltype(in);
      if constexpr (!std::is_same_v<T, float>) {  // 16-bit inputs only (TiledGemmSupports)
        using OutT = decltype(out);
        // How many of the kernel's blocks fit on the GPU at once. Setting its shared memory (above 48 KiB,
        // dynamic shared memory is opt-in per kernel and device) is part of the first query.
        auto resident_blocks = [](auto kernel, int smem) {
          return OncePerDeviceAndKernel(reinterpret_cast<const void*>(kernel),
                                        [&](int device) -> std::optional<int64_t> {
            int sms = 0, per_sm = 0;
            if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
                cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) != cudaSuccess)
              return std::nullopt;  // the launch reports the error; the next call sets and asks again
            return int64_t(sms) * per_sm;
          });
        };
        // A launch of more blocks than fit on the GPU at once with 4 stages takes 3 where that fits more
        // blocks per SM (on Hopper 4 instead of 3, at the wgmma kernel's 128 registers). Measured on an
        // H200 (benchmarks/NOTES.md), a stack of E=8, d=256, f=512 layers: fwd+bwd 2-4% faster for M from
        // 256 to 4096; 3 stages for every launch lose in the forward, whose launches are one wave.
        const int64_t resident_deep = resident_blocks(TiledGemmKernel<T, OutT, 4>, kSmemBytes<4>);
        if (blocks > resident_deep && resident_blocks(TiledGemmKernel<T, OutT, 3>, kSmemBytes<3>) > resident_deep)
          LaunchOverlapped(TiledGemmKernel<T, OutT, 3>, unsigned(blocks), kThreads, kSmemBytes<3>, stream, p);
        else
          LaunchOverlapped(TiledGemmKernel<T, OutT, 4>, unsigned(blocks), kThreads, kSmemBytes<4>, stream, p);
      }
    });
  });
  return CheckCuda(cudaGetLastError(), "launching the tiled GEMM");
}

}  // namespace jaxmlp
