// A block's 128 x 128 tiles of e4m3 values, held in shared memory row-major, stored into the transposed
// layout the FP8 weight gradients read (Fp8Outputs' cols_out: per group, or the padded layout with the zeros
// after each group's rows): what QuantizeTileKernel (fp8_quantize_kernels.cu) and the backward's activation
// pass over tiles (fp8_mlp_kernels.cu) share. A block's tiles share their rows, so it finds where they go
// once (TileDestinations, PlanTransposedStores) and stores each of its tiles by that (StoreTransposedTile).
//
// Two ways to store, chosen for the whole tile:
//   chunks   where every row's destination is aligned as its place in the tile (d % 16 == row % 16; the
//            weights, and activations in groups of multiples of 16): each thread takes 16 rows of 4 columns
//            and stores each column's 16 bytes as one 16-byte store where they are consecutive there, else
//            byte by byte; eight threads store a column's 128 rows, 128 contiguous bytes.
//   windows  otherwise (any routing but groups of multiples of 16): the 16-byte windows aligned in the
//            transposed layout that the tile's rows fill (TransposedWindows), one store each, byte stores only
//            for a window the tile shares with a neighbour or another group: at most two a column and group.
// Either is right for any layout; the choice is speed alone.
//
// Why two ways: in chunks, every chunk of a group that starts off a multiple of 16 stores 16 bytes one by one
// (3.5x the time of aligned groups at dsv3's x, windows 1.4x); windows alone cost 20% on aligned tiles, their
// scan and the stores' indexing.
//
// Shared memory: row r's 16-byte chunk j lies at chunk j ^ (r / 16 % 8): the loads of a warp (4 columns,
// or 4 quads of columns, by the 8 chunks of 16 rows) then touch 8 different banks (32 for quads), one per
// row (unswizzled, every row of a column is in one bank).
#pragma once

#include <cstdint>

#include "cuda/fp8/fp8_quantize_kernels.h"
#include "cuda/group_scan.cuh"

namespace jaxmlp {

constexpr int kTile = 128, kTileThreads = 256;
__device__ __forceinline__ int Swizzled(int row, int col) { return row * kTile + (col ^ (row / 16 % 8 * 16)); }

// Where the tile's rows [r0, r0 + kTile) go in o's transposed layout: thread t < kTile sets dest[t], the
// cols_out index of (row r0 + t, column 0) (-1: none, a row past `valid`), and padding[t], the zeros of the
// padded layout after it (a group's columns start at a multiple of 16 and run to one), and returns its dest
// (-1 for threads from kTile on). No barrier: the caller's next one publishes them.
__device__ __forceinline__ int64_t TileDestinations(const Fp8Outputs& o, int64_t r0, int64_t valid, int64_t* dest,
                                                    int8_t* padding) {
  if (threadIdx.x >= kTile) return -1;
  const int64_t r = r0 + threadIdx.x;
  int64_t base = -1;
  int pad = 0;
  if (r < valid) {
    const int64_t g = o.row_offsets ? GroupOf(o.row_offsets, o.E, r) : r / o.group_rows;
    const int64_t first = o.row_offsets ? o.row_offsets[g] : g * o.group_rows;
    base = g * o.group_stride + (o.col_offsets ? o.col_offsets[g] : 0) + r - first;
    if (o.col_offsets && r + 1 == o.row_offsets[g + 1]) pad = int((16 - (r + 1 - first) % 16) % 16);
  }
  dest[threadIdx.x] = base;
  padding[threadIdx.x] = int8_t(pad);
  return base;
}

// The 16-byte windows, aligned in the transposed layout, that a tile's rows fill in each column: a window
// starts at a valid row (dest >= 0) whose destination is a multiple of 16, follows no row of its group (the
// tile's first row, a group's first), or both; it takes the next rows of its group up to its 16th byte or the
// tile's end. windows[i] = first row | lead << 8 | rows << 16 | pad << 24 (lead: the window's bytes before
// its first row, another tile's or group's; pad: zeros of the padded layout after its last row, a group's
// last). Returns how many, at most kTile. Every thread of the block calls it; it has two barriers.
__device__ __forceinline__ int TransposedWindows(const int64_t* dest, const int8_t* padding, uint32_t* windows) {
  __shared__ int per_warp[kTile / 32];
  const int r = threadIdx.x, lane = r % 32;
  const int64_t d = r < kTile ? dest[r] : -1;
  const bool starts = d >= 0 && (r == 0 || d % 16 == 0 || dest[r - 1] != d - 1);
  const unsigned ballot = __ballot_sync(~0u, starts);  // kTileThreads: whole warps
  if (r < kTile && lane == 0) per_warp[r / 32] = __popc(ballot);
  __syncthreads();
  int before = 0, count = 0;
#pragma unroll
  for (int w = 0; w < kTile / 32; ++w) {
    before += w < r / 32 ? per_warp[w] : 0;
    count += per_warp[w];
  }
  if (starts) {
    const int lead = int(d % 16);
    int rows = 1;
    while (r + rows < kTile && lead + rows < 16 && dest[r + rows] == d + rows) ++rows;
    windows[before + __popc(ballot & ((1u << lane) - 1))] =
        uint32_t(r) | uint32_t(lead) << 8 | uint32_t(rows) << 16 | uint32_t(padding[r + rows - 1]) << 24;
  }
  __syncthreads();
  return count;
}

// How the block stores its tiles: chunks, or `windows` (TransposedWindows) of `count` entries. Every thread
// of the block calls it, after writing its tiles and TileDestinations (its first barrier publishes them);
// `base` is TileDestinations' result.
struct TransposedStores {
  bool chunks;
  int count;
};
__device__ __forceinline__ TransposedStores PlanTransposedStores(int64_t base, const int64_t* dest,
                                                                 const int8_t* padding, uint32_t* windows) {
  if (__syncthreads_and(base < 0 || base % 16 == threadIdx.x % 16)) return {true, 0};  // rows past kTile: -1
  return {false, TransposedWindows(dest, padding, windows)};
}

// Stores the block's tile (swizzled, rows as dest places them) transposed: its column c to cols[c * ld +
// dest[row]], for its first `columns` columns (cols points at the tile's first column's row of the layout;
// columns % 4 == 0).
__device__ __forceinline__ void StoreTransposedTile(const TransposedStores& plan, const uint8_t* tile,
                                                    const int64_t* dest, const int8_t* padding,
                                                    const uint32_t* windows, uint8_t* cols, int64_t ld,
                                                    int64_t columns) {
  if (plan.chunks) {
    // Each thread takes 16 rows of 4 columns (kTile / 16 chunks of rows x kTile / 4 quads of columns =
    // kTileThreads): 16 four-byte loads, one a row, transposed in registers into the 4 columns' 16 bytes. (A
    // warp's loads of a row then touch 32 different banks: 8 chunks, each of its own swizzle, by 4 quads.)
    constexpr int kChunks = kTile / 16;
    static_assert(kChunks * kTile / 4 == kTileThreads, "a chunk of 4 columns a thread");
    const int first = (threadIdx.x % kChunks) * 16, col0 = threadIdx.x / kChunks * 4;
    if (col0 >= columns) return;  // columns % 4 == 0: a quad is all in or all out
    uint32_t w[16];  // row first + k, columns col0 .. col0 + 3 (4-aligned: within one swizzled chunk)
#pragma unroll
    for (int k = 0; k < 16; ++k) w[k] = *reinterpret_cast<const uint32_t*>(&tile[Swizzled(first + k, col0)]);
    const int64_t d0 = dest[first], d15 = dest[first + 15];
    const bool whole = d0 >= 0 && d15 == d0 + 15 && d0 % 16 == 0 && ld % 16 == 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t packed[4];  // column col0 + j: byte i of packed[p] is row first + 4 p + i
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const uint32_t a = w[4 * p], b = w[4 * p + 1], c = w[4 * p + 2], d = w[4 * p + 3];
        const uint32_t ab = __byte_perm(a, b, j < 2 ? 0x5140 : 0x7362), cd = __byte_perm(c, d, j < 2 ? 0x5140 : 0x7362);
        packed[p] = __byte_perm(ab, cd, j % 2 ? 0x7632 : 0x5410);
      }
      uint8_t* column = cols + (col0 + j) * ld;
      if (whole) {
        *reinterpret_cast<uint4*>(column + d0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      } else {
        for (int k = 0; k < 16; ++k) {
          const int64_t d = dest[first + k];
          if (d < 0) continue;
          column[d] = uint8_t(packed[k / 4] >> (8 * (k % 4)));
          for (int z = 1; z <= padding[first + k]; ++z) column[d + z] = 0;
        }
      }
    }
    return;
  }
  const int count = plan.count;
  const bool wide = ld % 16 == 0;  // a window's 16 bytes aligned in memory
#pragma unroll 1
  for (int unit = threadIdx.x; unit < count * kTile; unit += kTileThreads) {
    const int col = unit / count, w = windows[unit % count];
    if (col >= columns) break;  // the columns grow with the unit
    const int first = w & 0xff, lead = (w >> 8) & 0xff, rows = (w >> 16) & 0xff, pad = w >> 24;
    uint64_t lo = 0, hi = 0;  // the window's rows from its byte 0, then moved to byte `lead`
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (k < rows) (k < 8 ? lo : hi) |= uint64_t(tile[Swizzled(first + k, col)]) << (8 * (k % 8));
    uint8_t* at = cols + col * ld + dest[first] - lead;
    if (lead == 0 && rows + pad == 16 && wide) {
      *reinterpret_cast<uint4*>(at) = make_uint4(uint32_t(lo), uint32_t(lo >> 32), uint32_t(hi), uint32_t(hi >> 32));
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k)
        if (k < rows) at[lead + k] = uint8_t((k < 8 ? lo : hi) >> (8 * (k % 8)));
      for (int z = 0; z < pad; ++z) at[lead + rows + z] = 0;
    }
  }
}

}  // namespace jaxmlp
