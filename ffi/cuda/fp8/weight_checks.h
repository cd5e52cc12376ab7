// The checks of the FP8 quantizers' handlers that the weight quantizers and the optimizer steps share.
#pragma once

#include <cstdint>
#include <string>

#include "checks.h"
#include "codes.h"
#include "cuda/gemm/grouped_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

// A quantizer's input: bfloat16, float16 or float32, of the rank, extents below 2^31, the last one a multiple
// of 16.
inline ffi::Error CheckQuantizerInput(const char* name, const ffi::AnyBuffer& v, size_t rank) {
  const ffi::DataType t = v.element_type();
  if (t != ffi::DataType::BF16 && t != ffi::DataType::F16 && t != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string("jaxmlp: ") + name + " must be bfloat16, float16 or float32");
  if (v.dimensions().size() != rank)
    return ffi::Error::InvalidArgument(std::string("jaxmlp: ") + name + " must have rank " + std::to_string(rank));
  for (int64_t n : v.dimensions())
    if (n > INT32_MAX) return ffi::Error::InvalidArgument("jaxmlp: quantizer extents must be below 2^31");
  if (v.dimensions().back() % 16)
    return ffi::Error::InvalidArgument(std::string("jaxmlp: ") + name + "'s last dimension must be a multiple of 16");
  return ffi::Error::Success();
}

// The computation dtype (ffi/codes.h DType: bfloat16 or float16) that the weights are rounded to first.
inline ffi::Error RoundedType(int32_t dtype, ffi::DataType* rounded) {
  if (dtype != int32_t(DType::kBfloat16) && dtype != int32_t(DType::kFloat16))
    return ffi::Error::InvalidArgument("jaxmlp: FP8 weights are quantized from bfloat16 or float16 (dtype)");
  *rounded = dtype == int32_t(DType::kBfloat16) ? ffi::DataType::BF16 : ffi::DataType::F16;
  return ffi::Error::Success();
}

// The e4m3 layouts of weights [E, K, N]: q [E, K, N] and qt [E, N, K], K a multiple of 16 (qt's rows are
// written 8 bytes at a time; N's is checked with the input), and a grid of their 128 x 128 tiles that fits.
inline ffi::Error CheckWeightLayouts(int64_t E, int64_t K, int64_t N, const ffi::AnyBuffer& q,
                                     const ffi::AnyBuffer& qt) {
  if (K % 16) return ffi::Error::InvalidArgument("jaxmlp: the weights' second dimension must be a multiple of 16");
  JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("q", q, {E, K, N}));
  JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("qt", qt, {E, N, K}));
  if (E > 65535 || ScaleBlocks(K) > 65535)
    return ffi::Error::InvalidArgument("jaxmlp: too many weight blocks for one grid");
  return ffi::Error::Success();
}

// The blockwise quantization's: the layouts, and the exponents e [E, ceil(K / 128), ceil(N / 128)] int32.
inline ffi::Error CheckWeightOutputs(int64_t E, int64_t K, int64_t N, const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt,
                                     const ffi::AnyBuffer& e) {
  JAXMLP_RETURN_IF_ERROR(CheckWeightLayouts(E, K, N, q, qt));
  return CheckShapeAndType("e", e, {E, ScaleBlocks(K), ScaleBlocks(N)}, ffi::DataType::S32, "dtype int32");
}

}  // namespace jaxmlp
