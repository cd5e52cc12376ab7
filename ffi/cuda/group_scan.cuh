// The group_sizes policy on the device (ffi/group_offsets.h's GroupOffsets is the host's): the one scan that
// the setup kernel of the cuBLAS paths and every block of the tiled kernel run over group_sizes.
#pragma once

#include <cstdint>

namespace jaxmlp {

// Inclusive prefix sum over the lanes of a warp.
__device__ __forceinline__ int64_t WarpInclusiveSum(int64_t v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int64_t other = __shfl_up_sync(~0u, v, d);
    if (lane >= d) v += other;
  }
  return v;
}

// Inclusive prefix sum over the threads of a block of kWarps full warps, in thread order; *total is the
// sum over the block. Every thread of the block calls it (with kWarps > 1 it has two barriers).
template <int kWarps>
__device__ __forceinline__ int64_t BlockInclusiveSum(int64_t v, int64_t* total) {
  v = WarpInclusiveSum(v);
  if constexpr (kWarps == 1) {
    *total = __shfl_sync(~0u, v, 31);
    return v;
  } else {
    __shared__ int64_t warp_sums[kWarps];
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 31) warp_sums[warp] = v;
    __syncthreads();
    int64_t before = 0, sum = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int64_t s = warp_sums[w];
      before += w < warp ? s : 0;
      sum += s;
    }
    __syncthreads();  // before the next call writes warp_sums again
    *total = sum;
    return v + before;
  }
}

// Walks the groups 32 * kWarps at a time, on one full warp (kWarps = 1: every warp of a block may walk
// them on its own) or on a whole block of kWarps warps: each size clamped to [0, M] before the int64
// running sum, offsets capped at M, so every row index derived here lies in [0, M] whatever the sizes
// hold. Thread t (threadIdx.x % (32 * kWarps)) calls visit(g, start, count) for group g = base + t, rows
// [start, start + count), on every thread (g >= E past the last group, with count 0), so visit may use
// warp collectives (and block ones where kWarps > 1). Where counts and offsets are given, it also writes the group arrays that the
// other kernels of a call read: counts[g], offsets[g] = start, and offsets[E] = the rows in groups.
// Returns the rows in groups (the rest of the M rows is padding). One warp's shuffles and no block-wide
// barrier: cheaper than a block scan for the few groups that each tiled block scans before its first
// k-step (docs/performance.md, "Kernel measurements"). A whole block
// where there are many groups: each pass waits for one load of group_sizes.
template <int kWarps = 1, typename Visit>
__device__ __forceinline__ int64_t ScanGroups(const int32_t* sizes, int64_t E, int64_t M, int32_t* counts,
                                              int64_t* offsets, Visit&& visit) {
  constexpr int kWidth = 32 * kWarps;
  int64_t carry = 0;
  for (int64_t base = 0; base < E; base += kWidth) {
    const int64_t g = base + threadIdx.x % kWidth;
    const int64_t size = g < E ? min(int64_t(max(sizes[g], 0)), M) : 0;
    int64_t pass_rows;
    const int64_t end = carry + BlockInclusiveSum<kWarps>(size, &pass_rows);
    const int64_t start = min(end - size, M), count = min(end, M) - start;
    if (counts && g < E) {
      counts[g] = int32_t(count);
      offsets[g] = start;
      if (g == E - 1) offsets[E] = start + count;
    }
    visit(g, start, count);
    carry += pass_rows;
  }
  return min(carry, M);
}

// Group of a valid row (row < offsets[E]), for the offsets [E + 1] ScanGroups writes: the first g with
// offsets[g + 1] > row (empty groups are skipped).
__device__ __forceinline__ int64_t GroupOf(const int64_t* offsets, int64_t E, int64_t row) {
  int64_t lo = 0, hi = E - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if (offsets[mid + 1] > row) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

}  // namespace jaxmlp
