// The router's top-k selection (jaxmlp.dispatch.top_k), shared by the CPU and CUDA handlers: the order it
// selects in, and the shape checks. Semantics: jax.lax.top_k over the last axis, which XLA compares in the
// floats' total order (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN) with ties taken lowest index first.
#pragma once

#include <cstdint>
#include <cstring>

#include "checks.h"

#if defined(__CUDACC__)
#define JAXMLP_HOST_DEVICE __host__ __device__
#else
#define JAXMLP_HOST_DEVICE
#endif

namespace jaxmlp {

// (score, index) as one int64 whose signed order is the selection order: the score's bits mapped to a
// signed integer in the total order above (negative floats have their magnitude bits flipped), then the
// complemented index, so that of equal scores the lower index ranks higher. Keys are unique per row.
JAXMLP_HOST_DEVICE inline int64_t TopKKey(float score, int64_t index) {
  uint32_t bits;
  memcpy(&bits, &score, sizeof bits);
  bits ^= uint32_t(int32_t(bits) >> 31) & 0x7fffffffu;
  return int64_t((uint64_t(bits) << 32) | uint64_t(~uint32_t(index)));
}

JAXMLP_HOST_DEVICE inline int64_t TopKIndexOf(int64_t key) { return int64_t(~uint32_t(uint64_t(key))); }

// The score of a key: the mapping of its bits is its own inverse (the sign bit, which picks it, stays).
JAXMLP_HOST_DEVICE inline float TopKScoreOf(int64_t key) {
  uint32_t bits = uint32_t(uint64_t(key) >> 32);
  bits ^= uint32_t(int32_t(bits) >> 31) & 0x7fffffffu;
  float score;
  memcpy(&score, &bits, sizeof score);
  return score;
}

struct TopKDims {
  int64_t T, E, k;
};

// scores [T, E] float32 -> values [T, k] float32, indices [T, k] int32, with 1 <= k <= E.
inline ffi::Error CheckTopK(const ffi::AnyBuffer& scores, const ffi::AnyBuffer& values,
                            const ffi::AnyBuffer& indices, TopKDims* out) {
  if (scores.dimensions().size() != 2 || values.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxmlp: top_k expects scores [T, E] and values [T, k], got " +
                                       Dims(scores.dimensions()) + ", " + Dims(values.dimensions()));
  if (scores.element_type() != ffi::DataType::F32 || values.element_type() != ffi::DataType::F32 ||
      indices.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jaxmlp: top_k takes float32 scores and returns float32 values and int32 "
                                       "indices");
  TopKDims m{scores.dimensions()[0], scores.dimensions()[1], values.dimensions()[1]};
  JAXMLP_RETURN_IF_ERROR(CheckExtents({m.T, m.E, m.k}));
  if (m.k < 1 || m.k > m.E)
    return ffi::Error::InvalidArgument("jaxmlp: top_k needs 1 <= k <= E, got k = " + std::to_string(m.k) +
                                       ", E = " + std::to_string(m.E));
  JAXMLP_RETURN_IF_ERROR(CheckShape("values", values, {m.T, m.k}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("indices", indices, {m.T, m.k}));
  *out = m;
  return ffi::Error::Success();
}

}  // namespace jaxmlp
