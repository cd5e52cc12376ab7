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

// Tensorwise with the delayed scale, known before the step: each pass's new weights are rounded to R and
// quantized at once (tensorwise.quantize_e4m3: v * 448 / amax in float32, to nearest even, saturating at
// +-448), nothing held in registers (as AdamWeightBlocksKernel holds its tile until it has the tile's
// maximum). A block per kRows rows x 128 columns of one expert (kScaleBlock / kRows blocks a tile), 256
// threads, each eight consecutive columns of every 16th row; q written as it lies, qt through shared memory
// in kRows bytes a column (32: whole sectors); the block's maximum into *amax (one atomic a block). 32 rows,
// four blocks an SM: 52-56 registers, more loads in flight than a block a tile holding it (80 registers, three
// blocks; docs/performance.md, "Kernel measurements"; the probe times other sizes).
constexpr int kTensorRows = 32;  // AdamWeightTensorKernel's rows a block

template <typename R, typename G, int kRows = kTensorRows, int kMinBlocks = 4>
__global__ void __launch_bounds__(256, kMinBlocks) AdamWeightTensorKernel(AdamStep s, const G* grad, int64_t K,
                                                                         int64_t N, const float* delayed, uint8_t* q,
                                                                         uint8_t* qt, float* amax) {
  static_assert(kScaleBlock % kRows == 0 && kRows % 16 == 0, "whole passes of 16 rows, whole blocks a tile");
  constexpr int kSplit = kScaleBlock / kRows, kPasses = kRows / 16;
  __shared__ uint8_t tile[kRows][kScaleBlock + 4];
  const int64_t n0 = int64_t(blockIdx.x / kSplit) * kScaleBlock;
  const int64_t k0 = int64_t(blockIdx.y) * kScaleBlock + blockIdx.x % kSplit * kRows;
  const int j = threadIdx.x % 16 * 8, first_row = threadIdx.x / 16;
  const float inverse = InverseScale(delayed), neg_lr = s.hyper[0], c1 = s.hyper[1], c2 = s.hyper[2];
  float m = 0.0f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int row = first_row + 16 * p;
    if (k0 + row >= K || n0 + j >= N) continue;  // K, N multiples of 16: all eight columns in or all past
    const int64_t o = (int64_t(blockIdx.z) * K + k0 + row) * N + n0 + j;
    const Vec<float, 8> w = AdamEight(s, neg_lr, c1, c2, grad, o);
    uint64_t packed = 0;
#pragma unroll
    for (int u = 0; u < 8; u += 2) {
      const float2 r = RoundedPair<R>::To(RoundPair<R>(w.v[u], w.v[u + 1], m));
      packed |= uint64_t(QuantizeByInverse(r.x, r.y, inverse)) << (8 * u);
    }
    for (int u = 0; u < 8; ++u) tile[row][j + u] = uint8_t(packed >> (8 * u));
    *reinterpret_cast<uint64_t*>(q + o) = packed;
  }
  m = BlockMax<8>(m);  // its barrier also orders the tile's shared writes before StoreTransposed's reads
  StoreTransposed(tile, n0, k0, K, N, qt);
  if (threadIdx.x == 0 && m > 0.0f) AtomicMaxNonNegative(amax, m);
}

// The grid of a kernel of `split` blocks per 128 x 128 tile of [E, K, N], consecutive in x (the handlers check
// that WeightTiles' y and z fit; x, ScaleBlocks(N) * split, fits for any N a buffer can hold).
inline dim3 SplitTiles(int64_t E, int64_t K, int64_t N, int split) {
  dim3 grid = WeightTiles(E, K, N);
  grid.x *= split;
  return grid;
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
    AdamWeightTensorKernel<decltype(rounded)><<<SplitTiles(E, K, N, kScaleBlock / kTensorRows), 256, 0, stream>>>(
        s, grad, K, N, delayed, q, qt, amax);
  });
  return CheckCuda(cudaGetLastError(), "launching the adam step's tensorwise quantizer");
}

}  // namespace jaxmlp
