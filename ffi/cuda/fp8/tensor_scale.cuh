// The tensorwise recipe's scale of a tensor with absolute maximum amax (jaxmlp/fp8/tensorwise.py,
// inverse_scale and scale_of), the quantization by it, and the float maximum its kernels reduce amax with.
#pragma once

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

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

// e4m3 of a and b by the inverse scale (tensorwise.quantize_e4m3: v * 448 / amax in float32, to nearest
// even, saturating at +-448), little-endian as the bytes lie in memory.
__device__ __forceinline__ uint16_t QuantizeByInverse(float a, float b, float inverse) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a * inverse, b * inverse), __NV_SATFINITE, __NV_E4M3);
}

// Non-negative floats order as their bit patterns: one integer atomicMax is a float max.
__device__ __forceinline__ void AtomicMaxNonNegative(float* amax, float v) {
  atomicMax(reinterpret_cast<int*>(amax), __float_as_int(v));
}

}  // namespace jaxmlp
