#include "cuda/fp8/fp8_adam_kernels.h"

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

// A block per tile: AdamTile, the tile's maximum into *amax (one atomic a tile), and the held weights
// quantized by the delayed maximum, as tensorwise.quantize_e4m3 (v * 448 / amax in float32, to nearest
// even, saturating at +-448).
template <typename R, typename G>
__global__ void __launch_bounds__(256, 3) AdamWeightTensorKernel(AdamStep s, const G* grad, int64_t K, int64_t N,
                                                              const float* delayed, uint8_t* q, uint8_t* qt,
                                                              float* amax) {
  const WeightTile t(K, N);
  const float inverse = InverseScale(delayed);
  HeldTile<R> held;
  const float tile_max = BlockMax<8>(AdamTile(s, grad, t, held));
  if (threadIdx.x == 0 && tile_max > 0.0f) AtomicMaxNonNegative(amax, tile_max);
  WriteWeightTile(t, held, [inverse](float a, float b) { return QuantizeByInverse(a, b, inverse); }, q, qt);
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
    AdamWeightTensorKernel<decltype(rounded)><<<WeightTiles(E, K, N), 256, 0, stream>>>(s, grad, K, N, delayed, q,
                                                                                       qt, amax);
  });
  return CheckCuda(cudaGetLastError(), "launching the adam step's tensorwise quantizer");
}

}  // namespace jaxmlp
