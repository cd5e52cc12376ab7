// The checks every FFI handler of both backends runs on its buffers: shapes, extents, dtypes and the
// optional operands (Present). Python validates the same things at trace time with clearer messages; the
// handlers check again because nothing stops a user from calling the FFI targets directly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

namespace ffi = xla::ffi;

inline bool IsFloat(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

inline std::string Dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Checks that `buf` has exactly the shape `want`.
inline ffi::Error CheckShape(const char* name, const ffi::AnyBuffer& buf, std::initializer_list<int64_t> want) {
  auto d = buf.dimensions();
  bool ok = d.size() == want.size() && std::equal(want.begin(), want.end(), d.begin());
  if (ok) return ffi::Error::Success();
  std::string w = "[";
  int i = 0;
  for (int64_t v : want) w += (i++ ? ", " : "") + std::to_string(v);
  return ffi::Error::InvalidArgument(std::string("jaxmlp: ") + name + " has shape " + Dims(d) +
                                     ", expected " + w + "]");
}

#define JAXMLP_RETURN_IF_ERROR(expr)      \
  do {                                    \
    ffi::Error err_ = (expr);             \
    if (!err_.success()) return err_;     \
  } while (0)

// An optional operand (b1, b2, scales; combine's weights and rows) or result is absent where the Python
// wrappers pass a scalar (jaxmlp/_ffi.py ABSENT), which no present one is. Not a 0-element array: jax
// 0.11.2's partitioner crashed (segmentation fault) compiling a custom call's 0-element operands inside
// a loop under shard_map (gradient accumulation over the expert-parallel layer).
inline bool Present(const ffi::AnyBuffer& b) { return b.dimensions().size() != 0; }
// An optional operand's data, null where it is absent.
inline void* DataIfPresent(const ffi::AnyBuffer& b) { return Present(b) ? b.untyped_data() : nullptr; }

// The sizes the kernels index with: at least 1, as the Python API computes empty problems without a
// custom call (the GEMM libraries and the tiled kernel's launches assume work), and below 2^31, as GEMM
// dimensions and per-group row counts are passed as int32.
inline ffi::Error CheckExtents(std::initializer_list<int64_t> sizes) {
  for (int64_t v : sizes)
    if (v < 1 || v > INT32_MAX)
      return ffi::Error::InvalidArgument("jaxmlp: every dimension (M, d, f and E; m, k, n and groups) must be in "
                                         "[1, 2^31), got " + std::to_string(v));
  return ffi::Error::Success();
}

// Checks that `buf` has exactly the shape `want` and the dtype t, which the error calls `dtype`.
inline ffi::Error CheckShapeAndType(const char* name, const ffi::AnyBuffer& buf, std::initializer_list<int64_t> want,
                                    ffi::DataType t, const char* dtype) {
  JAXMLP_RETURN_IF_ERROR(CheckShape(name, buf, want));
  if (buf.element_type() != t)
    return ffi::Error::InvalidArgument(std::string("jaxmlp: ") + name + " must have " + dtype);
  return ffi::Error::Success();
}

// Checks that result `buf` has exactly the shape `want` and the dtype t: the handlers write every result
// in the operands' dtype.
inline ffi::Error CheckResult(const char* name, const ffi::AnyBuffer& buf, std::initializer_list<int64_t> want,
                              ffi::DataType t) {
  return CheckShapeAndType(name, buf, want, t, "x's dtype");
}

}  // namespace jaxmlp
