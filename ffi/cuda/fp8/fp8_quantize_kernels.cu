#include "cuda/fp8/fp8_quantize_kernels.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/elements.cuh"
#include "cuda/fp8/tensor_scale.cuh"
#include "cuda/group_scan.cuh"
#include "cuda/launch.cuh"

namespace jaxmlp {
namespace {

// Where row r of a quantizer's input [.., n] starts (Fp8Rows), null for a gathered row of zeros.
template <typename T>
__device__ __forceinline__ const T* RowStart(const T* v, int64_t r, int64_t n, const Fp8Rows& from) {
  if (!from.gather) return v + r * n;
  const int32_t slot = from.gather[r];
  return slot >= 0 && slot / from.top_k < from.tokens ? v + int64_t(slot / from.top_k) * n : nullptr;
}

// Four independent 16-byte loads in flight per thread and iteration: one at a time left the kernel
// latency-bound at a third of the memory bandwidth. kGathered: the rows as `from` places them (n % V == 0),
// a zero row skipped.
template <typename T, int V, bool kGathered>
__global__ void AbsMaxKernel(const T* v, const int64_t* offsets, int64_t E, int64_t rows, int64_t n, float* amax,
                             Fp8Rows from, const float* skip) {
  if (skip && *skip > 0.0f) return;  // the whole grid alike
  constexpr int kUnroll = 4;
  const int64_t count = (offsets ? offsets[E] : rows) * n;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  float m = 0.0f;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < count; i += kUnroll * stride) {
    const T* at[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = i + u * stride;
      const T* row = e < count && kGathered ? RowStart(v, e / n, n, from) : nullptr;
      at[u] = e >= count ? nullptr : kGathered ? (row ? row + e % n : nullptr) : v + e;
    }
    Vec<T, V> x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (at[u]) x[u] = Load<T, V>(at[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (at[u])
#pragma unroll
        for (int k = 0; k < V; ++k) m = fmaxf(m, fabsf(ToFloat(x[u].v[k])));
  }
  ReduceAbsMax(m, amax);
}

// Quantization into the input's layout alone: 16-byte loads, V-byte stores, rows past the valid ones
// skipped. C % V == 0. seen: where given, max |v| of the rows quantized reaches it (delayed scaling).
// Blocks of kElementwiseThreads.
constexpr int kElementwiseThreads = 256;
template <typename T, int V>
__global__ void __launch_bounds__(kElementwiseThreads)
    QuantizeElementwiseKernel(const T* v, int64_t R, int64_t C, const float* amax, float* scale_out, Fp8Outputs o,
                              float* seen) {
  if (scale_out && blockIdx.x == 0 && threadIdx.x == 0) *scale_out = amax ? DequantScale(*amax) : 1.0f;
  const int64_t count = (o.row_offsets ? o.row_offsets[o.E] : R) * C;
  const float inv = InverseScale(amax);
  uint8_t* out = static_cast<uint8_t*>(o.rows_out);
  float m = 0.0f;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < count;
       i += int64_t(gridDim.x) * blockDim.x * V) {
    const Vec<T, V> x = Load<T, V>(v + i);
    Bytes<V> q;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      q.b[k] = ToE4m3(ToFloat(x.v[k]) * inv);
      m = fmaxf(m, fabsf(ToFloat(x.v[k])));
    }
    *reinterpret_cast<Bytes<V>*>(out + i) = q;
  }
  if (seen) BlockReduceAbsMax<kElementwiseThreads / 32>(m, seen);  // the whole grid alike
}

// One 128 x 128 tile of v per block, rows along blockIdx.x. Each thread loads its 16-byte chunks of the
// tile's rows (V elements each) all at once, then quantizes them, stores them in the input's layout if asked
// (128 contiguous bytes a row) and leaves them in shared memory row-major; then the block stores the tile's
// columns into the transposed layout, with the zeros of the padded layout after a group's last row (so no
// pass zeroes cols_out before), in one of two ways, chosen for the whole tile:
//   chunks   where every row's destination is aligned as its place in the tile (d % 16 == row % 16; the
//            weights, and activations in groups of multiples of 16): each thread gathers 16 rows of one
//            column, four times, and stores each as one 16-byte store where they are consecutive there, else
//            byte by byte; eight threads store a column's 128 rows, 128 contiguous bytes.
//   windows  otherwise (any routing but groups of multiples of 16): the 16-byte windows aligned in the
//            transposed layout that the tile's rows fill (TransposedWindows), one store each, byte stores only
//            for a window the tile shares with a neighbour or another group: at most two a column and group.
// Either is right for any layout; the choice is speed alone. C % V == 0.
//
// Why two ways: in chunks, every chunk of a group that starts off a multiple of 16 stores 16 bytes one by one
// (3.5x the time of aligned groups at dsv3's x, windows 1.4x); windows alone cost 20% on aligned tiles, their
// scan and the stores' indexing.
//
// Why this size: with 64 x 64 tiles (4 KB of FP8 a block) each block waited on its rows' group lookups and
// one load per thread before its stores; a 128 x 128 tile spreads those waits over four times the data. Why
// 4 blocks an SM (64 registers): a block's phases (loads, quantization, transposed stores) run in turn, so
// more blocks keep more loads in flight; 3 were 5-11% slower, 5 spill (docs/performance.md, "Kernel
// measurements").
//
// Shared memory: row r's 16-byte chunk j lies at chunk j ^ (r / 16 % 8): the byte loads of a warp (4
// columns by the 8 chunks of 16 rows) then touch 8 different banks, one per row (unswizzled, every row of a
// column is in one bank).
constexpr int kTile = 128, kTileThreads = 256;
__device__ __forceinline__ int Swizzled(int row, int col) { return row * kTile + (col ^ (row / 16 % 8 * 16)); }

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

template <typename T>
__global__ void __launch_bounds__(kTileThreads, 4) QuantizeTileKernel(const T* v, int64_t R, int64_t C, const float* amax,
                                                                   float* scale_out, Fp8Outputs o, Fp8Rows from,
                                                                   float* seen) {
  constexpr int V = 16 / sizeof(T), kRowThreads = kTile / V, kRowsPerPass = kTileThreads / kRowThreads;
  constexpr int kPasses = kTile / kRowsPerPass;
  __shared__ alignas(16) uint8_t tile[kTile * kTile];  // [row][column], swizzled
  __shared__ int64_t dest[kTile];                      // cols_out index of (row, column 0); -1: none
  __shared__ int8_t padding[kTile];                    // zeros after the row in cols_out
  const int64_t valid = o.row_offsets ? o.row_offsets[o.E] : R;
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  if (scale_out && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    *scale_out = amax ? DequantScale(*amax) : 1.0f;
  if (r0 >= valid) return;  // the same for the whole block
  const int cc = (threadIdx.x % kRowThreads) * V, first_row = threadIdx.x / kRowThreads;
  uint4 x[kPasses];  // 16 bytes a chunk (as uint4: one byte a register would spill the e4m3 chunks)
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int64_t r = r0 + first_row + i * kRowsPerPass;
    if (r < valid && c0 + cc < C) {
      const T* row = RowStart(v, r, C, from);
      x[i] = row ? *reinterpret_cast<const uint4*>(row + c0 + cc) : make_uint4(0, 0, 0, 0);  // e4m3 zeros
    }
  }
  int64_t base = -1;  // this thread's row's dest
  if (o.cols_out && threadIdx.x < kTile) {  // the group lookups while the loads are in flight
    const int64_t r = r0 + threadIdx.x;
    int pad = 0;
    if (r < valid) {
      const int64_t g = o.row_offsets ? GroupOf(o.row_offsets, o.E, r) : r / o.group_rows;
      const int64_t first = o.row_offsets ? o.row_offsets[g] : g * o.group_rows;
      base = g * o.group_stride + (o.col_offsets ? o.col_offsets[g] : 0) + r - first;
      // The padded layout: a group's columns start at a multiple of 16 and run to one.
      if (o.col_offsets && r + 1 == o.row_offsets[g + 1]) pad = int((16 - (r + 1 - first) % 16) % 16);
    }
    dest[threadIdx.x] = base;
    padding[threadIdx.x] = int8_t(pad);
  }
  const float inv = InverseScale(amax);
  uint8_t* rows_out = static_cast<uint8_t*>(o.rows_out);
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int rr = first_row + i * kRowsPerPass;
    const int64_t r = r0 + rr;
    Bytes<V> q{};
    if (r < valid && c0 + cc < C) {
      if constexpr (std::is_same_v<T, Fp8>) {  // a transposition of e4m3 data (amax null): its bytes
        q = *reinterpret_cast<const Bytes<V>*>(&x[i]);
      } else {
        const Vec<T, V>& xv = *reinterpret_cast<const Vec<T, V>*>(&x[i]);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          q.b[k] = ToE4m3(ToFloat(xv.v[k]) * inv);
          m = fmaxf(m, fabsf(ToFloat(xv.v[k])));
        }
      }
      if (rows_out) *reinterpret_cast<Bytes<V>*>(rows_out + r * C + c0 + cc) = q;
    }
    *reinterpret_cast<Bytes<V>*>(&tile[Swizzled(rr, cc)]) = q;  // V <= 16: within one chunk
  }
  if (seen) BlockReduceAbsMax<kTileThreads / 32>(m, seen);  // every thread of the block reaches it
  if (!o.cols_out) return;  // the rows alone: gathered ones, which QuantizeElementwiseKernel does not read
  if (__syncthreads_and(base < 0 || base % 16 == threadIdx.x % 16)) {  // chunks (rows past kTile: base -1)
    // kTile columns x kTile / 16 chunks of 16 rows = 4 kTileThreads chunks: four per thread, a column each.
    constexpr int kChunks = kTile / 16;
#pragma unroll 1
    for (int pass = 0; pass < kTile * kChunks / kTileThreads; ++pass) {
      const int unit = pass * kTileThreads + threadIdx.x;
      const int col = unit / kChunks, first = (unit % kChunks) * 16;
      if (c0 + col >= C) break;  // the columns grow with the pass
      uint32_t packed[4] = {};
#pragma unroll
      for (int k = 0; k < 16; ++k) packed[k / 4] |= uint32_t(tile[Swizzled(first + k, col)]) << (8 * (k % 4));
      uint8_t* cols_out = static_cast<uint8_t*>(o.cols_out) + (c0 + col) * o.ld;
      const int64_t d0 = dest[first], d15 = dest[first + 15];
      if (d0 >= 0 && d15 == d0 + 15 && d0 % 16 == 0 && o.ld % 16 == 0) {
        *reinterpret_cast<uint4*>(cols_out + d0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      } else {
        for (int k = 0; k < 16; ++k) {
          const int64_t d = dest[first + k];
          if (d < 0) continue;
          cols_out[d] = uint8_t(packed[k / 4] >> (8 * (k % 4)));
          for (int z = 1; z <= padding[first + k]; ++z) cols_out[d + z] = 0;
        }
      }
    }
    return;
  }
  __shared__ uint32_t windows[kTile];  // windows: each unit one window of one column, columns in turn
  const int count = TransposedWindows(dest, padding, windows);
  const bool wide = o.ld % 16 == 0;  // a window's 16 bytes aligned in memory
#pragma unroll 1
  for (int unit = threadIdx.x; unit < count * kTile; unit += kTileThreads) {
    const int col = unit / count, w = windows[unit % count];
    if (c0 + col >= C) break;  // the columns grow with the unit
    const int first = w & 0xff, lead = (w >> 8) & 0xff, rows = (w >> 16) & 0xff, pad = w >> 24;
    uint64_t lo = 0, hi = 0;  // the window's rows from its byte 0, then moved to byte `lead`
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (k < rows) (k < 8 ? lo : hi) |= uint64_t(tile[Swizzled(first + k, col)]) << (8 * (k % 8));
    uint8_t* at = static_cast<uint8_t*>(o.cols_out) + (c0 + col) * o.ld + dest[first] - lead;
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

__global__ void ScalesKernel(const float* amax, int n, float* scale) {
  if (threadIdx.x < n) scale[threadIdx.x] = DequantScale(amax[threadIdx.x]);
}

}  // namespace

ffi::Error AbsMax(cudaStream_t stream, ffi::DataType t, const void* v, const int64_t* offsets, int64_t E,
                  int64_t rows, int64_t n, float* amax, const Fp8Rows& from, const float* skip) {
  if (from.gather && (n % 8 || from.top_k < 1))
    return ffi::Error::InvalidArgument("jaxmlp: a gathered FP8 amax needs rows of a multiple of 8, top_k >= 1");
  By16BitType(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const unsigned grid = AmaxGridBlocks(rows * n, 256 * V);
    const T* tv = static_cast<const T*>(v);
    if (from.gather) AbsMaxKernel<T, V, true><<<grid, 256, 0, stream>>>(tv, offsets, E, rows, n, amax, from, skip);
    else if (n % V == 0)
      AbsMaxKernel<T, V, false><<<grid, 256, 0, stream>>>(tv, offsets, E, rows, n, amax, from, skip);
    else AbsMaxKernel<T, 1, false><<<grid, 256, 0, stream>>>(tv, offsets, E, rows, n, amax, from, skip);
  });
  return CheckCuda(cudaGetLastError(), "launching the FP8 amax kernel");
}

ffi::Error QuantizeRows(cudaStream_t stream, ffi::DataType t, const void* v, int64_t R, int64_t C, const float* amax,
                        float* scale_out, const Fp8Outputs& out, const Fp8Rows& from, float* seen) {
  if (C % 16) return ffi::Error::InvalidArgument("jaxmlp: FP8 quantization needs rows of a multiple of 16 elements");
  if (seen && t == ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("jaxmlp: an FP8 transposition has no maximum to observe");
  if (from.gather && (t == ffi::DataType::F8E4M3FN || from.top_k < 1))
    return ffi::Error::InvalidArgument("jaxmlp: gathered FP8 quantization reads 16-bit tokens, top_k >= 1");
  const int64_t row_tiles = (R + kTile - 1) / kTile, col_tiles = (C + kTile - 1) / kTile;
  if (row_tiles > INT32_MAX || col_tiles > 65535)
    return ffi::Error::InvalidArgument("jaxmlp: FP8 quantization of a [" + std::to_string(R) + ", " +
                                       std::to_string(C) + "] tensor exceeds the grid");
  const dim3 grid(unsigned(std::max<int64_t>(row_tiles, 1)), unsigned(std::max<int64_t>(col_tiles, 1)));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (out.cols_out || from.gather)
      QuantizeTileKernel<T><<<grid, kTileThreads, 0, stream>>>(static_cast<const T*>(v), R, C, amax, scale_out, out,
                                                               from, seen);
    else
      QuantizeElementwiseKernel<T, V>
          <<<unsigned(std::clamp<int64_t>(R * C / (kElementwiseThreads * V), 1, 16384)), kElementwiseThreads, 0,
             stream>>>(static_cast<const T*>(v), R, C, amax, scale_out, out, seen);
  };
  if (t == ffi::DataType::F8E4M3FN) launch(Fp8{});
  else By16BitType(t, launch);
  return CheckCuda(cudaGetLastError(), "launching the FP8 quantization kernel");
}

__global__ void ZeroPaddedTailKernel(uint8_t* cols, int64_t R, int64_t ld, const int64_t* padded_end) {
  const int64_t end = std::clamp<int64_t>(*padded_end, 0, ld);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x)
    for (int64_t j = end + threadIdx.x; j < ld; j += blockDim.x) cols[r * ld + j] = 0;
}

ffi::Error ZeroPaddedTail(cudaStream_t stream, void* cols, int64_t R, int64_t ld, const int64_t* padded_end) {
  if (R == 0 || ld == 0) return ffi::Error::Success();
  ZeroPaddedTailKernel<<<unsigned(std::min<int64_t>(R, 4096)), 256, 0, stream>>>(static_cast<uint8_t*>(cols), R, ld,
                                                                                 padded_end);
  return CheckCuda(cudaGetLastError(), "launching the padded layout's tail zeroing");
}

ffi::Error ScalesOf(cudaStream_t stream, const float* amax, int n, float* scale) {
  ScalesKernel<<<1, 32, 0, stream>>>(amax, n, scale);
  return CheckCuda(cudaGetLastError(), "launching the FP8 scales kernel");
}

}  // namespace jaxmlp
