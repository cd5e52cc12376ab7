// The tensorwise recipe's scale of a tensor with absolute maximum amax (jaxmlp/fp8/tensorwise.py,
// inverse_scale and scale_of), and the float maximum its kernels reduce amax with.
#pragma once

#include <cfloat>

namespace jaxmlp {

constexpr float kE4m3Max = 448.0f;

// 448 / amax (1 where amax is 0 or absent): IEEE division, as the emulation's float32 jnp division. Where it
// overflows (amax < 448 / FLT_MAX: denormals and the smallest normals), 0 x inf would be NaN: it is clamped
// to FLT_MAX, as TransformerEngine does, and the dequantization scale is then FLT_MAX's float32 reciprocal
// 2^-128 (tensorwise.inverse_scale and scale_of; every larger amax gives 448 / a and a / 448 as before).
constexpr float kScaleAtClamp = 0x1p-128f;
__device__ __forceinline__ float InverseScale(const float* amax) {
  const float a = amax ? *amax : 0.0f;
  return a > 0.0f ? fminf(kE4m3Max / a, FLT_MAX) : 1.0f;
}
__device__ __forceinline__ float DequantScale(float a) {
  return a > 0.0f ? (isinf(kE4m3Max / a) ? kScaleAtClamp : a / kE4m3Max) : 1.0f;
}

// Non-negative floats order as their bit patterns: one integer atomicMax is a float max.
__device__ __forceinline__ void AtomicMaxNonNegative(float* amax, float v) {
  atomicMax(reinterpret_cast<int*>(amax), __float_as_int(v));
}

}  // namespace jaxmlp
