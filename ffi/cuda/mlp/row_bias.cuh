// The experts' biases on one row of a group, shared by the 16-bit (mlp_kernels.cu) and the FP8
// (fp8/fp8_mlp_kernels.cu) activation kernels, so that both round alike. One block per row: each thread
// takes the V-element chunks j = threadIdx.x * V, stepping by blockDim.x * V.
#pragma once

#include "cuda/elements.cuh"

namespace jaxmlp {

// v + b[0, V) rounded to T: a chunk of h with FC1's bias (the saved pre-activation includes it).
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> PlusBias(Vec<T, V> v, const T* b) {
  const Vec<T, V> bv = Load<T, V>(b);
#pragma unroll
  for (int k = 0; k < V; ++k) v.v[k] = Conv<T>::From(Conv<T>::To(v.v[k]) + Conv<T>::To(bv.v[k]));
  return v;
}

// y's row = round(s * b2[g]) (b2 itself for s = 1), for FC2 to accumulate its product onto (beta 1): the
// bias costs no pass over y of its own, and the row scale weighs the whole expert output, b2 included.
template <typename T, int V>
__device__ __forceinline__ void ScaledBiasRow(T* y, const T* b, float s, int64_t d) {
  for (int64_t j = threadIdx.x * V; j < d; j += blockDim.x * V) {
    Vec<T, V> v = Load<T, V>(b + j);
#pragma unroll
    for (int k = 0; k < V; ++k) v.v[k] = Conv<T>::From(Conv<T>::To(v.v[k]) * s);
    Store<T, V>(y + j, v);
  }
}

// The thread's share of <dy's row, b2[g]>: where y = s * (a @ w2 + b2), the row scale's gradient takes it.
template <typename T, int V>
__device__ __forceinline__ float BiasDotShare(const T* dy, const T* b, int64_t d) {
  float sum = 0.0f;
  for (int64_t j = threadIdx.x * V; j < d; j += blockDim.x * V) {
    const Vec<T, V> dv = Load<T, V>(dy + j), bv = Load<T, V>(b + j);
#pragma unroll
    for (int k = 0; k < V; ++k) sum += Conv<T>::To(dv.v[k]) * Conv<T>::To(bv.v[k]);
  }
  return sum;
}

}  // namespace jaxmlp
