// The tensorwise recipe's scale of a tensor with absolute maximum amax (jaxmlp/fp8/tensorwise.py,
// inverse_scale and scale_of), the quantization by it, and the float maximum its kernels reduce amax with:
// what the quantizers (fp8_quantize_kernels.cu), the activation passes (fp8_mlp_kernels.cu) and the optimizer
// step (fp8_adam_kernels.cu) share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "cuda/block_reduce.cuh"

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

using Fp8 = __nv_fp8_e4m3;

__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(Fp8 v) { return float(v); }

// Round to nearest even, saturating at +-448; NaN stays NaN (jnp.clip then astype in jaxmlp/fp8/quantize.py).
__device__ __forceinline__ uint8_t ToE4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// The block's maximum reaches *amax with one atomic per warp (fmaxf drops NaN: a NaN input quantizes to
// NaN whatever the scale, as in the emulation).
__device__ __forceinline__ void ReduceAbsMax(float v, float* amax) {
  v = WarpMax(v);
  if (threadIdx.x % 32 == 0 && v > 0.0f) AtomicMaxNonNegative(amax, v);
}

// The same with one atomic per block of kWarps full warps, every thread reaching it, for the quantizers of
// many blocks: thousands of blocks' atomics on one address serialize in the L2 (an atomic a warp took
// QuantizeElementwiseKernel from 48 to 135 us at qwen3's x: docs/performance.md, "Kernel measurements").
template <int kWarps>
__device__ __forceinline__ void BlockReduceAbsMax(float v, float* amax) {
  v = BlockMax<kWarps>(v);
  if (threadIdx.x == 0 && v > 0.0f) AtomicMaxNonNegative(amax, v);
}

// V e4m3 values stored as one access.
template <int V>
struct alignas(V) Bytes {
  uint8_t b[V];
};

// Blocks of a grid-stride kernel that reduces an amax: few, so few atomics on one address.
constexpr int64_t kMaxAmaxBlocks = 1024;
inline unsigned AmaxGridBlocks(int64_t work, int64_t per_block) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, kMaxAmaxBlocks)));
}

}  // namespace jaxmlp
