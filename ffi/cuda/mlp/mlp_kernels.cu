#include "cuda/mlp/mlp_kernels.h"

#include <algorithm>

#include "activations.h"
#include "cuda/block_reduce.cuh"
#include "cuda/elements.cuh"
#include "cuda/group_scan.cuh"
#include "cuda/launch.cuh"
#include "cuda/mlp/row_bias.cuh"

namespace jaxmlp {
namespace {

constexpr int kThreads = 128;

template <typename T, int V>
__device__ void ZeroRow(T* row, int64_t n) {
  Vec<T, V> z;
  for (int k = 0; k < V; ++k) z.v[k] = Conv<T>::From(0.0f);
  for (int64_t j = threadIdx.x * V; j < n; j += blockDim.x * V) Store<T, V>(row + j, z);
}

// One block per row: the row's work is a few KB, and a block-wide loop keeps the group lookup and the
// row scale to one per row. The activation is a template parameter: no dispatch in the loop.
template <typename T, int V, Act kAct>
__global__ void __launch_bounds__(kThreads) ActForwardKernel(ActParams p, const int64_t* offsets, int64_t E,
                                                             int64_t f, int64_t d, T* h, const T* b1,
                                                             const T* scales, T* a, T* y, const T* b2,
                                                             bool zero_padding) {
  WaitForPrevious();
  constexpr bool kGated = IsGated(kAct);
  const int64_t row = blockIdx.x;
  const int64_t F1 = kGated ? 2 * f : f;
  if (row >= offsets[E]) {  // padding: the cuBLAS GEMMs write only group rows; h and a are never read there
    if (zero_padding) ZeroRow<T, V>(y + row * d, d);
    return;
  }
  const int64_t g = (b1 || b2) ? GroupOf(offsets, E, row) : 0;
  const float s = scales ? Conv<T>::To(scales[row]) : 1.0f;
  T* hr = h + row * F1;
  for (int64_t j = threadIdx.x * V; j < f; j += blockDim.x * V) {
    Vec<T, V> gate = Load<T, V>(hr + j), up;
    if (kGated) up = Load<T, V>(hr + f + j);
    if (b1) {  // the saved pre-activation includes b1
      gate = PlusBias<T, V>(gate, b1 + g * F1 + j);
      Store<T, V>(hr + j, gate);
      if (kGated) {
        up = PlusBias<T, V>(up, b1 + g * F1 + f + j);
        Store<T, V>(hr + f + j, up);
      }
    }
    Vec<T, V> out;
    for (int k = 0; k < V; ++k) {
      float u = kGated ? Conv<T>::To(up.v[k]) : 0.0f;
      out.v[k] = Conv<T>::From(ActivationGradOf<kAct>(p, Conv<T>::To(gate.v[k]), u).val * s);
    }
    Store<T, V>(a + row * f + j, out);
  }
  if (b2) ScaledBiasRow<T, V>(y + row * d, b2 + g * d, s, d);
}

template <typename T, int V, Act kAct>
__global__ void __launch_bounds__(kThreads) ActBackwardKernel(ActParams p, const int64_t* offsets, int64_t E,
                                                              int64_t f, int64_t d, const T* h, const T* da,
                                                              const T* scales, T* a_s, T* dh, T* dscales,
                                                              T* dx, const T* dy, const T* b2, bool zero_padding,
                                                              const float* ds_parts, int64_t parts) {
  WaitForPrevious();
  constexpr bool kGated = IsGated(kAct);
  const int64_t row = blockIdx.x;
  const int64_t F1 = kGated ? 2 * f : f;
  if (row >= offsets[E]) {  // padding: dh is never read there (the dx and dw1 products take group rows)
    if (zero_padding) ZeroRow<T, V>(dx + row * d, d);
    if (dscales && threadIdx.x == 0) dscales[row] = Conv<T>::From(0.0f);
    return;
  }
  const float s = scales ? Conv<T>::To(scales[row]) : 1.0f;
  const T* hr = h + row * F1;
  float ds = 0.0f;
  for (int64_t j = threadIdx.x * V; j < f; j += blockDim.x * V) {
    Vec<T, V> gate = Load<T, V>(hr + j), up, dav = Load<T, V>(da + row * f + j);
    if (kGated) up = Load<T, V>(hr + f + j);
    Vec<T, V> as, dg, du;
    for (int k = 0; k < V; ++k) {
      ActGrad r = ActivationGradOf<kAct>(p, Conv<T>::To(gate.v[k]), kGated ? Conv<T>::To(up.v[k]) : 0.0f);
      float dak = Conv<T>::To(dav.v[k]);
      ds += dak * r.val;
      as.v[k] = Conv<T>::From(r.val * s);
      dg.v[k] = Conv<T>::From(dak * s * r.dgate);
      du.v[k] = Conv<T>::From(dak * s * r.dup);
    }
    Store<T, V>(a_s + row * f + j, as);
    Store<T, V>(dh + row * F1 + j, dg);
    if (kGated) Store<T, V>(dh + row * F1 + f + j, du);
  }
  if (ds_parts && threadIdx.x == 0)
    for (int64_t i = 0; i < parts; ++i) ds += ds_parts[row * parts + i];
  if (dscales && b2) ds += BiasDotShare<T, V>(dy + row * d, b2 + GroupOf(offsets, E, row) * d, d);
  if (dscales) {
    ds = BlockSum<kThreads / 32>(ds);
    if (threadIdx.x == 0) dscales[row] = Conv<T>::From(ds);
  }
}

// Per-group column sums without atomics, so that db1 and db2 are the same bits on every run. Block (x, y)
// sums its columns over rows [y * rows_per_block, +rows_per_block), one sum per group it meets, and
// stores each in its own slot of `partials` [slots, n]; GroupSumKernel then adds each group's slots in
// block order. Along the rows, the block b and the group g of these pieces only grow, and from one piece
// to the next at least one of them grows: slot b + g is unique, below blocks + E.
template <typename T>
__global__ void __launch_bounds__(kThreads) ColumnSumKernel(const int64_t* offsets, int64_t E, int64_t n,
                                                            int64_t rows_per_block, const T* v, const T* scales,
                                                            float* partials) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b = blockIdx.y;
  const int64_t r1 = min((b + 1) * rows_per_block, offsets[E]);
  int64_t r = b * rows_per_block;
  if (j >= n || r >= r1) return;
  // r < r1 <= offsets[E] holds in the loop, so g stays below E; empty groups are passed, not stored.
  for (int64_t g = GroupOf(offsets, E, r); r < r1; ++g) {
    const int64_t start = r, end = min(offsets[g + 1], r1);
    float sum = 0.0f;
#pragma unroll 4
    for (; r < end; ++r)
      sum += scales ? Conv<T>::To(v[r * n + j]) * Conv<T>::To(scales[r]) : Conv<T>::To(v[r * n + j]);
    if (r > start) partials[(b + g) * n + j] = sum;
  }
}

// out[g, j] = the sum of group g's slots in `partials`, in block order (0 for a group with no rows).
template <typename T>
__global__ void GroupSumKernel(const int64_t* offsets, int64_t E, int64_t n, int64_t rows_per_block,
                               const float* partials, T* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < E * n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = i / n, j = i % n, start = offsets[g], end = offsets[g + 1];
    float sum = 0.0f;
    if (end > start)
      for (int64_t b = start / rows_per_block; b <= (end - 1) / rows_per_block; ++b) sum += partials[(b + g) * n + j];
    out[i] = Conv<T>::From(sum);
  }
}

// Rows per ColumnSumKernel block: 64, or more where that would take over kColumnSumBlocks blocks (which
// bounds the scratch to (kColumnSumBlocks + E) * n floats, and GroupSumKernel's sums to as many terms).
constexpr int64_t kColumnSumBlocks = 1024;
int64_t ColumnSumRowsPerBlock(int64_t M) {
  return std::max<int64_t>(64, (M + kColumnSumBlocks - 1) / kColumnSumBlocks);
}
int64_t ColumnSumBlocks(int64_t M) {
  return std::max<int64_t>(1, (M + ColumnSumRowsPerBlock(M) - 1) / ColumnSumRowsPerBlock(M));
}

// 16-byte accesses when every row length allows them, scalar ones otherwise.
template <typename T>
bool Vectorizable(std::initializer_list<int64_t> row_lengths) {
  constexpr int V = 16 / sizeof(T);
  return std::all_of(row_lengths.begin(), row_lengths.end(), [](int64_t n) { return n % V == 0; });
}

}  // namespace

ffi::Error ActivationForward(cudaStream_t stream, int device, ffi::DataType t, const ActParams& p,
                             const int64_t* offsets, int64_t E, int64_t M, int64_t f, int64_t d, void* h,
                             const void* b1, const void* scales, void* a, void* y, const void* b2,
                             bool zero_padding, bool activation) {
  cudaError_t e = cudaSuccess;
  if (!activation) f = 0;  // no columns of h and a: the rows' y work only
  ByType(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    auto args = std::make_tuple(p, offsets, E, f, d, static_cast<T*>(h), static_cast<const T*>(b1),
                                static_cast<const T*>(scales), static_cast<T*>(a), static_cast<T*>(y),
                                static_cast<const T*>(b2), zero_padding);
    ByAct(p.act, [&](auto act) {
      constexpr Act A = decltype(act)::value;
      auto kernel = Vectorizable<T>({f, d}) ? ActForwardKernel<T, V, A> : ActForwardKernel<T, 1, A>;
      std::apply([&](auto... xs) { e = LaunchOverlapped(kernel, unsigned(M), kThreads, 0, stream, device, xs...); },
                 args);
    });
  });
  return CheckCuda(e, "launching the activation forward kernel");
}

ffi::Error ActivationBackward(cudaStream_t stream, int device, ffi::DataType t, const ActParams& p,
                              const int64_t* offsets, int64_t E, int64_t M, int64_t f, int64_t d, const void* h,
                              const void* da, const void* scales, void* a_s, void* dh, void* dscales, void* dx,
                              const void* dy, const void* b2, bool zero_padding, const float* ds_parts) {
  cudaError_t e = cudaSuccess;
  const int64_t parts = ScaleGradientParts(f);
  if (ds_parts) f = 0;  // no columns of h, da, a_s and dh: the rows' scale gradients and padding only
  ByType(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    auto args = std::make_tuple(p, offsets, E, f, d, static_cast<const T*>(h), static_cast<const T*>(da),
                                static_cast<const T*>(scales), static_cast<T*>(a_s), static_cast<T*>(dh),
                                static_cast<T*>(dscales), static_cast<T*>(dx), static_cast<const T*>(dy),
                                static_cast<const T*>(b2), zero_padding, ds_parts, parts);
    ByAct(p.act, [&](auto act) {
      constexpr Act A = decltype(act)::value;
      auto kernel = Vectorizable<T>({f, d}) ? ActBackwardKernel<T, V, A> : ActBackwardKernel<T, 1, A>;
      std::apply([&](auto... xs) { e = LaunchOverlapped(kernel, unsigned(M), kThreads, 0, stream, device, xs...); },
                 args);
    });
  });
  return CheckCuda(e, "launching the activation backward kernel");
}

namespace {

// out[g, :] = sum of v[r, :] * scales[r] over the rows r of group g (v [M, n], out [E, n]).
ffi::Error GroupColumnSums(cudaStream_t stream, ffi::DataType t, const int64_t* offsets, int64_t E, int64_t M,
                           int64_t n, const void* v, const void* scales, float* partials, void* out) {
  const int64_t rows_per_block = ColumnSumRowsPerBlock(M);
  const dim3 grid(unsigned((n + kThreads - 1) / kThreads), unsigned(ColumnSumBlocks(M)));
  ByType(t, [&](auto tag) {
    using T = decltype(tag);
    ColumnSumKernel<T><<<grid, kThreads, 0, stream>>>(offsets, E, n, rows_per_block, static_cast<const T*>(v),
                                                      static_cast<const T*>(scales), partials);
    GroupSumKernel<T><<<unsigned(std::min<int64_t>((E * n + 255) / 256, 4096)), 256, 0, stream>>>(
        offsets, E, n, rows_per_block, partials, static_cast<T*>(out));
  });
  return CheckCuda(cudaGetLastError(), "launching the bias gradient kernels");
}

}  // namespace

int64_t BiasGradientsScratch(const MlpDims& m) {
  return m.has_b1 || m.has_b2 ? (ColumnSumBlocks(m.M) + m.E) * std::max(m.F1, m.d) : 0;
}

ffi::Error BiasGradients(cudaStream_t stream, ffi::DataType t, const int64_t* offsets, const MlpDims& m,
                         const void* dh, const void* dy, const void* scales, float* partials, void* db1, void* db2) {
  if (m.has_b1) JAXMLP_RETURN_IF_ERROR(GroupColumnSums(stream, t, offsets, m.E, m.M, m.F1, dh, nullptr, partials, db1));
  if (m.has_b2) return GroupColumnSums(stream, t, offsets, m.E, m.M, m.d, dy, scales, partials, db2);
  return ffi::Error::Success();
}

}  // namespace jaxmlp
