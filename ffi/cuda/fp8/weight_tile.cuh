// The e4m3 quantization of 128 x 128 weight tiles that the weight quantizers and the optimizer steps share
// (jaxmlp/fp8/blockwise.py's scales, jaxmlp/fp8/tensorwise.py's): a block of 256 threads per tile, each
// thread eight consecutive columns of every 16th row, the tile's e4m3 values written as they lie (q) and,
// through shared memory, transposed (qt). The blockwise scale's primitives too (Exponent, Unscale), which
// the rows-and-columns quantizers use.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/block_reduce.cuh"
#include "cuda/elements.cuh"
#include "cuda/gemm/grouped_gemm.h"

namespace jaxmlp {

// The least e with amax / 448 <= 2^e (0 where amax is 0): jaxmlp.fp8.blockwise.exponent.
__device__ __forceinline__ int Exponent(float amax) {
  if (!(amax > 0.0f)) return 0;
  int e;
  const float mantissa = frexpf(amax / 448.0f, &e);
  return mantissa == 0.5f ? e - 1 : e;
}

// Division by a block's scale 2^e as multiplications by powers of two, exact where the quotient is a normal
// float and else rounded once, as ldexpf(v, -e) (the JAX code's ldexp) rounds it: two multiplies a value,
// where ldexpf takes ~14 instructions (its range handling, per call). Exponents are >= -149 and <= 120
// (amax / 448 is a finite float): 2^-e is one normal float down to e = -126, the product of two past it.
struct Unscale {
  float first, second;
  __device__ explicit Unscale(int e)
      : first(Pow2(e >= -126 ? -e : 126)), second(Pow2(e >= -126 ? 0 : -e - 126)) {}
  __device__ float operator()(float v) const { return v * first * second; }
  static __device__ float Pow2(int n) { return __int_as_float((n + 127) << 23); }  // n in [-126, 127]
};

// e4m3 of v / 2^e for two and four values, round to nearest even, saturating, NaN kept (fp8.to_e4m3):
// the packed conversions of two floats, little-endian as the bytes lie in memory.
__device__ __forceinline__ uint16_t Quantize2(float a, float b, const Unscale& u) {
  return __nv_cvt_float2_to_fp8x2(make_float2(u(a), u(b)), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ uint32_t Quantize4(const float (&v)[4], const Unscale& u) {
  return uint32_t(Quantize2(v[0], v[1], u)) | uint32_t(Quantize2(v[2], v[3], u)) << 16;
}

// v rounded to R (to nearest even, as XLA's convert), as a float: w of type T as the computation dtype R
// takes it. The identity where T is R.
template <typename R, typename T>
__device__ __forceinline__ float RoundedTo(T v) {
  if constexpr (std::is_same_v<R, T>) return Conv<T>::To(v);
  else return Conv<R>::To(Conv<R>::From(Conv<T>::To(v)));
}

// Two floats rounded to R (to nearest even) by one packed conversion into one register, and back.
template <typename R>
struct RoundedPair;
template <>
struct RoundedPair<__nv_bfloat16> {
  using Type = __nv_bfloat162;
  static __device__ __forceinline__ Type From(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 To(Type p) { return __bfloat1622float2(p); }
};
template <>
struct RoundedPair<__half> {
  using Type = __half2;
  static __device__ __forceinline__ Type From(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 To(Type p) { return __half22float2(p); }
};

// a and b rounded to R by one packed conversion; amax raised to the larger magnitude of the rounded values.
template <typename R>
__device__ __forceinline__ typename RoundedPair<R>::Type RoundPair(float a, float b, float& amax) {
  const typename RoundedPair<R>::Type pair = RoundedPair<R>::From(a, b);
  const float2 r = RoundedPair<R>::To(pair);
  amax = fmaxf(amax, fmaxf(fabsf(r.x), fabsf(r.y)));
  return pair;
}

// A thread's part of a 128 x 128 tile of one expert's weights [K, N] (the grid: 128-column blocks, 128-row
// blocks, experts): eight consecutive columns j .. j + 7 of the rows first_row + 16 p, p < kPasses. K and N
// are multiples of 16: a thread's eight columns all lie in the tensor or all past it.
struct WeightTile {
  static constexpr int kRowsPerPass = 16, kPasses = kScaleBlock / kRowsPerPass;
  int64_t K, N, first;  // first: the index of the thread's first element in [E, K, N]
  int j, first_row;
  __device__ WeightTile(int64_t K, int64_t N)
      : K(K), N(N), j(threadIdx.x % 16 * 8), first_row(threadIdx.x / 16) {
    first = ((blockIdx.z * K + k0() + first_row) * N + n0() + j);
  }
  __device__ int64_t k0() const { return int64_t(blockIdx.y) * kScaleBlock; }
  __device__ int64_t n0() const { return int64_t(blockIdx.x) * kScaleBlock; }
  __device__ int Row(int p) const { return first_row + p * kRowsPerPass; }
  __device__ bool Holds(int p) const { return k0() + Row(p) < K && n0() + j < N; }
  // The index of pass p's first element.
  __device__ int64_t Offset(int p) const { return first + int64_t(p) * kRowsPerPass * N; }
};

// The grid of a kernel over the 128 x 128 tiles of [E, K, N] (the handlers check that it fits).
inline dim3 WeightTiles(int64_t E, int64_t K, int64_t N) {
  return dim3(unsigned(ScaleBlocks(N)), unsigned(ScaleBlocks(K)), unsigned(E));
}

// A thread's tile values rounded to R, held in registers as pairs of one packed rounding each: fewer
// registers than as 16-bit vectors or floats (a block more an SM: docs/performance.md, "Kernel
// measurements"). Hold returns the largest magnitude of the rounded values.
template <typename R>
struct HeldTile {
  typename RoundedPair<R>::Type pairs[WeightTile::kPasses][4];
  __device__ float Hold(int p, const float (&v)[8]) {
    float amax = 0.0f;
#pragma unroll
    for (int u = 0; u < 8; u += 2) pairs[p][u / 2] = RoundPair<R>(v[u], v[u + 1], amax);
    return amax;
  }
  __device__ void operator()(int p, float (&v)[8]) const {
#pragma unroll
    for (int u = 0; u < 8; u += 2) {
      const float2 r = RoundedPair<R>::To(pairs[p][u / 2]);
      v[u] = r.x, v[u + 1] = r.y;
    }
  }
};

// A block's kRows x 128 e4m3 values in shared memory (rows k0 .., columns n0 .. of expert blockIdx.z's
// [K, N]) into qt [E, N, K]: eight rows of a column a thread's store, kRows bytes a column; the rows and
// columns past K and N skipped. After a barrier over the shared writes.
template <int kRows>
__device__ __forceinline__ void StoreTransposed(const uint8_t (&tile)[kRows][kScaleBlock + 4], int64_t n0, int64_t k0,
                                                int64_t K, int64_t N, uint8_t* qt) {
  for (int idx = threadIdx.x; idx < kScaleBlock * (kRows / 8); idx += blockDim.x) {  // qt row n0 + n, from k0 + i
    const int n = idx / (kRows / 8), i = idx % (kRows / 8) * 8;
    if (n0 + n >= N || k0 + i >= K) continue;
    uint64_t packed = 0;
    for (int u = 0; u < 8; ++u) packed |= uint64_t(tile[i + u][n]) << (8 * u);
    *reinterpret_cast<uint64_t*>(qt + (int64_t(blockIdx.z) * N + n0 + n) * K + k0 + i) = packed;
  }
}

// The tile's values quantized by quantize2 (two floats to two e4m3 bytes, little-endian), where values(p, v)
// gives pass p's eight values: written as they lie (q) and, through shared memory, transposed (qt). Once per
// block.
template <typename Values, typename Quantize2>
__device__ __forceinline__ void WriteWeightTile(const WeightTile& t, const Values& values, const Quantize2& quantize2,
                                                uint8_t* q, uint8_t* qt) {
  __shared__ uint8_t tile[kScaleBlock][kScaleBlock + 4];
#pragma unroll
  for (int p = 0; p < WeightTile::kPasses; ++p) {
    if (!t.Holds(p)) continue;
    float v[8];
    values(p, v);
    uint64_t packed = 0;
    for (int u = 0; u < 8; u += 2) packed |= uint64_t(quantize2(v[u], v[u + 1])) << (8 * u);
    for (int u = 0; u < 8; ++u) tile[t.Row(p)][t.j + u] = uint8_t(packed >> (8 * u));
    *reinterpret_cast<uint64_t*>(q + t.Offset(p)) = packed;
  }
  __syncthreads();
  StoreTransposed(tile, t.n0(), t.k0(), t.K, t.N, qt);
}

// The blockwise quantization of the tile, once each thread has the largest magnitude of its values (amax)
// and values(p, v) gives pass p's eight values (rounded to the computation dtype): the tile's maximum, its
// exponent (e), its quantized values (WriteWeightTile).
template <typename Values>
__device__ __forceinline__ void QuantizeWeightTile(const WeightTile& t, float amax, const Values& values, uint8_t* q,
                                                   uint8_t* qt, int32_t* e) {
  const int exp = Exponent(BlockMax<8>(amax));  // the tile's maximum (256 threads)
  const Unscale unscale(exp);
  if (threadIdx.x == 0) e[(int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = exp;
  WriteWeightTile(t, values, [&](float a, float b) { return Quantize2(a, b, unscale); }, q, qt);
}

}  // namespace jaxmlp
