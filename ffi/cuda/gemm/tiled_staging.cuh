// The tiled GEMM's tiles (see tiled_gemm.h): their geometry, the swizzled shared-memory layout that both
// MMA versions read, the cp.async loader that fills it, and the accumulators' register layout. Part of
// the tiled kernel, included by tiled_kernel.cuh (internal linkage, as all of the kernel's pieces).
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>

#include "cuda/gemm/tiled_gemm.h"

namespace jaxmlp {
namespace {

// Small problems have few tiles, one block each, and a block's time is mostly its warps' instruction
// latency, with few warps per scheduler to hide it. So the geometry favours a block's own pipeline:
// 64-deep steps with 4 stages (3 blocks per SM) for launches of one wave; the alternatives measured
// against it are in docs/performance.md ("The tiled path", "Kernel measurements").
// A launch of more blocks than fit at once takes 3 stages where that fits more blocks per SM
// (RunTiledGemms).
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

}  // namespace
}  // namespace jaxmlp
