// Element types of the CUDA kernels: float32, bfloat16 and float16 values are converted to float for
// arithmetic, and moved V at a time (16-byte accesses where row lengths allow).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "checks.h"

namespace jaxmlp {

template <typename T>
struct Conv;
template <>
struct Conv<float> {
  static __device__ __forceinline__ float To(float v) { return v; }
  static __device__ __forceinline__ float From(float v) { return v; }
};
template <>
struct Conv<__nv_bfloat16> {
  static __device__ __forceinline__ float To(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 From(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Conv<__half> {
  static __device__ __forceinline__ float To(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half From(float v) { return __float2half_rn(v); }
};

// V elements moved as one access (16 bytes when V * sizeof(T) == 16).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> Load(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}
template <typename T, int V>
__device__ __forceinline__ void Store(T* p, const Vec<T, V>& v) {
  *reinterpret_cast<Vec<T, V>*>(p) = v;
}

// Calls fn(T{}) with the CUDA element type of t.
template <typename Fn>
void ByType(ffi::DataType t, Fn fn) {
  if (t == ffi::DataType::BF16) fn(__nv_bfloat16{});
  else if (t == ffi::DataType::F16) fn(__half{});
  else fn(float{});
}

// The same for the 16-bit types alone (the FP8 path takes no float32): bfloat16, else float16.
template <typename Fn>
void By16BitType(ffi::DataType t, Fn fn) {
  if (t == ffi::DataType::BF16) fn(__nv_bfloat16{});
  else fn(__half{});
}

}  // namespace jaxmlp
