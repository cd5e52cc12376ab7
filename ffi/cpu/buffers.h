// The CPU handlers' buffer helpers: dtype conversion to and from float, and output poisoning.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "checks.h"
#include "poison.h"

namespace jaxmlp {

using ffi::AnyBuffer;
using ffi::DataType;

inline float Bf16ToFloat(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                          // round to nearest even
  return uint16_t(u >> 16);
}

inline std::vector<float> ToFloat(const AnyBuffer& b) {
  size_t n = b.element_count();
  std::vector<float> out(n);
  switch (b.element_type()) {
    case DataType::F32:
      std::memcpy(out.data(), b.untyped_data(), n * 4);
      break;
    case DataType::BF16: {
      auto* p = static_cast<const uint16_t*>(b.untyped_data());
      for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(p[i]);
      break;
    }
    default: {  // F16 (validated by the callers)
      auto* p = static_cast<const _Float16*>(b.untyped_data());
      for (size_t i = 0; i < n; ++i) out[i] = float(p[i]);
    }
  }
  return out;
}

// Rounds v to `t` and back: the value a buffer of dtype t would hold.
inline float RoundTo(DataType t, float v) {
  if (t == DataType::BF16) return Bf16ToFloat(FloatToBf16(v));
  if (t == DataType::F16) return float(_Float16(v));
  return v;
}

inline void RoundAll(DataType t, std::vector<float>& v) {
  if (t != DataType::F32)
    for (float& e : v) e = RoundTo(t, e);
}

inline void Store(const float* v, AnyBuffer out) {
  size_t n = out.element_count();
  switch (out.element_type()) {
    case DataType::F32:
      std::memcpy(out.untyped_data(), v, n * 4);
      break;
    case DataType::BF16: {
      auto* p = static_cast<uint16_t*>(out.untyped_data());
      for (size_t i = 0; i < n; ++i) p[i] = FloatToBf16(v[i]);
      break;
    }
    default: {
      auto* p = static_cast<_Float16*>(out.untyped_data());
      for (size_t i = 0; i < n; ++i) p[i] = _Float16(v[i]);
    }
  }
}

inline void Store(const std::vector<float>& v, AnyBuffer out) { Store(v.data(), out); }

// A buffer's elements as float: the buffer itself when it is float32, a converted copy otherwise (no copy
// of float32 operands: at the CPU's small shapes the copies cost as much as a GEMM).
class FloatIn {
 public:
  explicit FloatIn(const AnyBuffer& b) {
    if (b.element_type() == DataType::F32) {
      p_ = static_cast<const float*>(b.untyped_data());
    } else {
      copy_ = ToFloat(b);
      p_ = copy_.data();
    }
  }
  const float* data() const { return p_; }
  float operator[](size_t i) const { return p_[i]; }

 private:
  std::vector<float> copy_;
  const float* p_;
};

// A result computed in float: written in place when the buffer is float32, otherwise into a scratch array
// that Finish() stores, rounded, into the buffer.
class FloatOut {
 public:
  explicit FloatOut(AnyBuffer b) : b_(b) {
    if (b.element_type() == DataType::F32) {
      p_ = static_cast<float*>(b.untyped_data());
    } else {
      copy_.reset(new float[b.element_count()]);  // uninitialised: the handlers write every element
      p_ = copy_.get();
    }
  }
  float* data() { return p_; }
  void Finish() {
    if (copy_) Store(p_, b_);
  }

 private:
  AnyBuffer b_;
  std::unique_ptr<float[]> copy_;
  float* p_;
};

inline void Poison(std::initializer_list<AnyBuffer*> outs) {
  if (PoisonOutputs())
    for (AnyBuffer* b : outs) std::memset(b->untyped_data(), 0xFF, b->size_bytes());
}

}  // namespace jaxmlp
