#include "cuda/fp8/fp8_quantize_kernels.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/elements.cuh"
#include "cuda/fp8/tensor_scale.cuh"
#include "cuda/fp8/transposed_tile.cuh"
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
// (128 contiguous bytes a row) and leaves them in shared memory; then the block stores the tile's columns
// into the transposed layout (transposed_tile.cuh), with the zeros of the padded layout after a group's last
// row (so no pass zeroes cols_out before). C % V == 0.
//
// Why this size: with 64 x 64 tiles (4 KB of FP8 a block) each block waited on its rows' group lookups and
// one load per thread before its stores; a 128 x 128 tile spreads those waits over four times the data. Why
// 4 blocks an SM (64 registers): a block's phases (loads, quantization, transposed stores) run in turn, so
// more blocks keep more loads in flight; 3 were 5-11% slower, 5 spill (docs/performance.md, "Kernel
// measurements").
template <typename T>
__global__ void __launch_bounds__(kTileThreads, 4) QuantizeTileKernel(const T* v, int64_t R, int64_t C, const float* amax,
                                                                   float* scale_out, Fp8Outputs o, Fp8Rows from,
                                                                   float* seen) {
  constexpr int V = 16 / sizeof(T), kRowThreads = kTile / V, kRowsPerPass = kTileThreads / kRowThreads;
  constexpr int kPasses = kTile / kRowsPerPass;
  __shared__ alignas(16) uint8_t tile[kTile * kTile];  // [row][column], swizzled
  __shared__ int64_t dest[kTile];                      // cols_out index of (row, column 0); -1: none
  __shared__ int8_t padding[kTile];                    // zeros after the row in cols_out
  __shared__ uint32_t windows[kTile];
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
  // The group lookups while the loads are in flight.
  const int64_t base = o.cols_out ? TileDestinations(o, r0, valid, dest, padding) : -1;
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
  const TransposedStores plan = PlanTransposedStores(base, dest, padding, windows);
  StoreTransposedTile(plan, tile, dest, padding, windows, static_cast<uint8_t*>(o.cols_out) + c0 * o.ld, o.ld,
                      C - c0);
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
