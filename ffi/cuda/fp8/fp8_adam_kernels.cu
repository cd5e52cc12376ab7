#include "cuda/fp8/fp8_adam_kernels.h"

#include <cuda_fp8.h>

#include "cuda/elements.cuh"
#include "cuda/fp8/tensor_scale.cuh"
#include "cuda/fp8/weight_tile.cuh"
#include "cuda/launch.cuh"

namespace jaxmlp {
namespace {

// optax.adam's (adamw's with a weight decay) update of one float32 weight, in its operations' order, each
// rounded once: no fused multiply-adds, so that the result is that of the operations and not of which of
// them a compiler fuses (XLA's CPU and GPU code fuses some: a difference in the last bit). The moments,
// their bias corrections, the step, the weight.
__device__ __forceinline__ void AdamUpdate(const AdamStep& s, float neg_lr, float c1, float c2, float g, float& w,
                                           float& mu, float& nu) {
  mu = __fadd_rn(__fmul_rn(s.one_minus_b1, g), __fmul_rn(s.b1, mu));
  nu = __fadd_rn(__fmul_rn(s.one_minus_b2, __fmul_rn(g, g)), __fmul_rn(s.b2, nu));
  float u = __fdiv_rn(__fdiv_rn(mu, c1), __fadd_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(nu, c2), s.eps_root)), s.eps));
  if (s.weight_decay != 0.0f) u = __fadd_rn(u, __fmul_rn(s.weight_decay, w));  // optax skips a zero decay
  w = __fadd_rn(w, __fmul_rn(u, neg_lr));
}

// AdamUpdate of the eight weights from index o (w, mu and nu read and written back once; the gradient of
// type G, float32 or R): the new weights. The scalars s.hyper holds, read once by the caller: the stores may
// alias them, for all the compiler knows, so a read here would be repeated for every eight weights.
template <typename G>
__device__ __forceinline__ Vec<float, 8> AdamEight(const AdamStep& s, float neg_lr, float c1, float c2, const G* grad,
                                                   int64_t o) {
  Vec<float, 8> w = Load<float, 8>(s.w + o), mu = Load<float, 8>(s.mu + o), nu = Load<float, 8>(s.nu + o);
  const Vec<G, 8> g = Load<G, 8>(grad + o);
  for (int u = 0; u < 8; ++u) AdamUpdate(s, neg_lr, c1, c2, Conv<G>::To(g.v[u]), w.v[u], mu.v[u], nu.v[u]);
  Store<float, 8>(s.w_out + o, w), Store<float, 8>(s.mu_out + o, mu), Store<float, 8>(s.nu_out + o, nu);
  return w;
}

// The adam step of a thread's part of its block's 128 x 128 tile (AdamEight), the new weights rounded to R
// and held (HeldTile): the largest magnitude of the thread's rounded weights.
template <typename R, typename G>
__device__ __forceinline__ float AdamTile(const AdamStep& s, const G* grad, const WeightTile& t, HeldTile<R>& held) {
  const float neg_lr = s.hyper[0], c1 = s.hyper[1], c2 = s.hyper[2];
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < WeightTile::kPasses; ++p) {
    if (!t.Holds(p)) continue;
    const Vec<float, 8> w = AdamEight(s, neg_lr, c1, c2, grad, t.Offset(p));
    amax = fmaxf(amax, held.Hold(p, w.v));
  }
  return amax;
}

// A block per 128 x 128 tile of one expert: AdamTile, then QuantizeWeightTile of the held weights (the tile's
// own scale). Three blocks an SM at least: ptxas fits the held tile in 80 registers (84, two blocks,
// unbounded; nvcc 13.0 spills a few bytes in the float32-gradient instantiations).
template <typename R, typename G>
__global__ void __launch_bounds__(256, 3) AdamWeightBlocksKernel(AdamStep s, const G* grad, int64_t K, int64_t N,
                                                              uint8_t* q, uint8_t* qt, int32_t* e) {
  const WeightTile t(K, N);
  HeldTile<R> held;
  const float amax = AdamTile(s, grad, t, held);
  QuantizeWeightTile(t, amax, held, q, qt, e);
}

// Tensorwise: the delayed scale is known before the step, so no block waits for a tile's maximum before
// it writes, and the step streams as XLA's adam does, in short-lived blocks (a block per 128 x 128 tile, as
// the blockwise step needs, moved 3.8 TB/s; docs/fp8-performance.md). A block per strip of kRows rows x 128
// columns of one expert (K a multiple of kRows), 16 threads a row, each eight consecutive columns: adam's step (AdamEight), the new
// weights rounded to R and quantized by the delayed maximum, as tensorwise.quantize_e4m3 (v * 448 / amax in
// float32, to nearest even, saturating at +-448), written as they lie (q) and, through shared memory,
// transposed (qt: kRows bytes a column). The strips of a column tile are consecutive blocks (a 1-D grid,
// strips down K first), so the pieces of a qt sector are written by blocks that run together. The block's
// maximum reaches *amax with one atomic, and none where *amax already holds as much: it only grows.
template <typename R, int kRows, typename G>
__global__ void __launch_bounds__(kRows * 16) AdamWeightTensorKernel(AdamStep s, const G* grad, int64_t K, int64_t N,
                                                                    const float* delayed, uint8_t* q, uint8_t* qt,
                                                                    float* amax) {
  static_assert(kRows % 8 == 0 && kRows <= 64, "qt is written 8 bytes at a time, one warp's strip at most");
  __shared__ alignas(8) uint8_t strip[kRows][kScaleBlock];
  const int64_t strips = K / kRows, col_tiles = ScaleBlocks(N);
  const int64_t k0 = blockIdx.x % strips * kRows, n0 = blockIdx.x / strips % col_tiles * kScaleBlock;
  const int64_t expert = blockIdx.x / strips / col_tiles;
  const int row = threadIdx.x / 16, j = threadIdx.x % 16 * 8;
  float m = 0.0f;
  if (n0 + j < N) {  // N is a multiple of 16: the eight columns all lie in the tensor or all past it
    const int64_t o = (expert * K + k0 + row) * N + n0 + j;
    const Vec<float, 8> w = AdamEight(s, s.hyper[0], s.hyper[1], s.hyper[2], grad, o);
    const float inverse = InverseScale(delayed);
    uint64_t packed = 0;
#pragma unroll
    for (int u = 0; u < 8; u += 2) {
      const float2 r = RoundedPair<R>::To(RoundedPair<R>::From(w.v[u], w.v[u + 1]));
      m = fmaxf(m, fmaxf(fabsf(r.x), fabsf(r.y)));
      const uint16_t e4m3 = __nv_cvt_float2_to_fp8x2(make_float2(r.x * inverse, r.y * inverse), __NV_SATFINITE,
                                                     __NV_E4M3);
      packed |= uint64_t(e4m3) << (8 * u);
    }
    *reinterpret_cast<uint64_t*>(q + o) = packed;
    *reinterpret_cast<uint64_t*>(&strip[row][j]) = packed;
  }
  m = BlockMax<kRows / 2>(m);  // its barrier also orders the strip's shared writes before the reads below
  const int n = threadIdx.x;  // qt row n0 + n: the strip's column n, kRows bytes from column k0
  if (n < kScaleBlock && n0 + n < N) {
    Vec<uint64_t, kRows / 8> column;
#pragma unroll
    for (int i = 0; i < kRows; i += 8) {
      uint64_t packed = 0;
#pragma unroll
      for (int u = 0; u < 8; ++u) packed |= uint64_t(strip[i + u][n]) << (8 * u);
      column.v[i / 8] = packed;
    }
    Store<uint64_t, kRows / 8>(reinterpret_cast<uint64_t*>(qt + (expert * N + n0 + n) * K + k0), column);
  }
  // After the stores: the read of *amax waits for L2.
  if (threadIdx.x == 0 && m > 0.0f && m > *static_cast<volatile float*>(amax)) AtomicMaxNonNegative(amax, m);
}

// launch(R(), grad) with the computation dtype R and the gradient as its type: float32 or R.
template <typename Launch>
void ByGradient(ffi::DataType r, ffi::DataType g, const AdamStep& s, const Launch& launch) {
  By16BitType(r, [&](auto rounded) {
    using R = decltype(rounded);
    if (g == ffi::DataType::F32) launch(rounded, static_cast<const float*>(s.g));
    else launch(rounded, static_cast<const R*>(s.g));
  });
}

}  // namespace

ffi::Error AdamWeightBlocks(cudaStream_t stream, ffi::DataType r, ffi::DataType g, const AdamStep& s, int64_t E,
                            int64_t K, int64_t N, uint8_t* q, uint8_t* qt, int32_t* e) {
  if (E == 0 || K == 0 || N == 0) return ffi::Error::Success();
  ByGradient(r, g, s, [&](auto rounded, auto grad) {
    AdamWeightBlocksKernel<decltype(rounded)><<<WeightTiles(E, K, N), 256, 0, stream>>>(s, grad, K, N, q, qt, e);
  });
  return CheckCuda(cudaGetLastError(), "launching the adam step's 128x128 quantizer");
}

ffi::Error AdamWeightTensor(cudaStream_t stream, ffi::DataType r, ffi::DataType g, const AdamStep& s, int64_t E,
                            int64_t K, int64_t N, const float* delayed, uint8_t* q, uint8_t* qt, float* amax) {
  if (E == 0 || K == 0 || N == 0) return ffi::Error::Success();
  ByGradient(r, g, s, [&](auto rounded, auto grad) {
    AdamWeightTensorKernel<decltype(rounded), kTensorAdamRows>
        <<<unsigned(TensorAdamStrips(E, K, N)), kTensorAdamRows * 16, 0, stream>>>(s, grad, K, N, delayed, q, qt, amax);
  });
  return CheckCuda(cudaGetLastError(), "launching the adam step's tensorwise quantizer");
}

}  // namespace jaxmlp
