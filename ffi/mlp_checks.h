// The grouped-MLP call of both backends: its operands, gradients and activation attributes as the handlers
// bind them, and the checks of their shapes and dtypes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "checks.h"
#include "codes.h"

namespace jaxmlp {

// The operands every grouped-MLP call starts with, on both backends: x, w1, w2, group_sizes, b1, b2,
// scales (optional: Present). The backward appends h and dy.
template <typename Binding>
auto BindMlpOperands(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()       // w1
      .template Arg<ffi::AnyBuffer>()       // w2
      .template Arg<ffi::AnyBuffer>()       // group_sizes
      .template Arg<ffi::AnyBuffer>()       // b1
      .template Arg<ffi::AnyBuffer>()       // b2
      .template Arg<ffi::AnyBuffer>();      // scales
}

// The gradient results of the backward, in the order CheckMlpBackward validates them.
template <typename Binding>
auto BindMlpGradients(Binding b) {
  return std::move(b).template Ret<ffi::AnyBuffer>()  // dx
      .template Ret<ffi::AnyBuffer>()       // dw1
      .template Ret<ffi::AnyBuffer>()       // dw2
      .template Ret<ffi::AnyBuffer>()       // db1
      .template Ret<ffi::AnyBuffer>()       // db2
      .template Ret<ffi::AnyBuffer>();      // dscales
}

// The activation attributes (jaxmlp/_ffi.py _act_attrs).
template <typename Binding>
auto BindActivationAttrs(Binding b) {
  return std::move(b).template Attr<int32_t>("activation").template Attr<float>("alpha").template Attr<float>("limit");
}

// Shapes of one grouped MLP call, read off the buffers.
struct MlpDims {
  int64_t M, d, f, F1, E;  // F1 = 2f for gated activations, f otherwise
  bool has_b1, has_b2, has_scales;
};

// The shapes of CheckMlp alone (the FP8 backward checks the dtypes of its e4m3 x, w1 and w2 itself).
// rows >= 0: the call's M where x holds tokens that the call gathers rows from (the gathered forward).
inline ffi::Error CheckMlpShapes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w1, const ffi::AnyBuffer& w2,
                                 const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& b1,
                                 const ffi::AnyBuffer& b2, const ffi::AnyBuffer& scales, int32_t act,
                                 MlpDims* out, int64_t rows = -1) {
  if (act < 0 || act >= static_cast<int32_t>(Act::kCount))
    return ffi::Error::InvalidArgument("jaxmlp: unknown activation id " + std::to_string(act));
  if (x.dimensions().size() != 2 || w1.dimensions().size() != 3 || w2.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("jaxmlp: expected x [M, d], w1 [E, d, F1], w2 [E, f, d], got " +
                                       Dims(x.dimensions()) + ", " + Dims(w1.dimensions()) + ", " +
                                       Dims(w2.dimensions()));
  MlpDims m;
  m.M = rows >= 0 ? rows : x.dimensions()[0];
  m.d = x.dimensions()[1];
  m.E = w1.dimensions()[0];
  m.F1 = w1.dimensions()[2];
  m.f = IsGated(static_cast<Act>(act)) ? m.F1 / 2 : m.F1;
  if (IsGated(static_cast<Act>(act)) && m.F1 % 2 != 0)
    return ffi::Error::InvalidArgument("jaxmlp: a gated activation needs an even w1.shape[2], got " +
                                       std::to_string(m.F1));
  JAXMLP_RETURN_IF_ERROR(CheckShape("w1", w1, {m.E, m.d, m.F1}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("w2", w2, {m.E, m.f, m.d}));
  JAXMLP_RETURN_IF_ERROR(CheckExtents({m.M, x.dimensions()[0], m.d, m.F1, m.E}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("group_sizes", group_sizes, {m.E}));
  if (group_sizes.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jaxmlp: group_sizes must be int32");
  m.has_b1 = Present(b1);
  m.has_b2 = Present(b2);
  m.has_scales = Present(scales);
  if (m.has_b1) JAXMLP_RETURN_IF_ERROR(CheckShape("b1", b1, {m.E, m.F1}));
  if (m.has_b2) JAXMLP_RETURN_IF_ERROR(CheckShape("b2", b2, {m.E, m.d}));
  if (m.has_scales) JAXMLP_RETURN_IF_ERROR(CheckShape("scales", scales, {m.M}));
  *out = m;
  return ffi::Error::Success();
}

// Validates x [M, d], w1 [E, d, F1], w2 [E, f, d], group_sizes [E] int32, and the optional b1 [E, F1],
// b2 [E, d], scales [M] (each optional: Present). All float operands share x's dtype.
inline ffi::Error CheckMlp(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w1, const ffi::AnyBuffer& w2,
                           const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& b1,
                           const ffi::AnyBuffer& b2, const ffi::AnyBuffer& scales, int32_t act,
                           MlpDims* out, int64_t rows = -1) {
  JAXMLP_RETURN_IF_ERROR(CheckMlpShapes(x, w1, w2, group_sizes, b1, b2, scales, act, out, rows));
  ffi::DataType t = x.element_type();
  if (!IsFloat(t)) return ffi::Error::InvalidArgument("jaxmlp: x must be float32, bfloat16 or float16");
  for (const ffi::AnyBuffer* b : {&w1, &w2, &b1, &b2, &scales})
    if (b->element_type() != t)
      return ffi::Error::InvalidArgument("jaxmlp: x, w1, w2, b1, b2 and scales must share one dtype");
  return ffi::Error::Success();
}

// The forward's results: y [M, d] and the FC1 output h [M, F1], in x's dtype.
inline ffi::Error CheckMlpForward(const MlpDims& m, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                                  const ffi::AnyBuffer& h) {
  JAXMLP_RETURN_IF_ERROR(CheckResult("y", y, {m.M, m.d}, x.element_type()));
  return CheckResult("h", h, {m.M, m.F1}, x.element_type());
}

// The backward's extra operands (h [M, F1], dy [M, d], in x's dtype) and its gradients, for dims m
// from CheckMlp; db1, db2 and dscales only where b1, b2 and scales are present.
inline ffi::Error CheckMlpBackward(const MlpDims& m, const ffi::AnyBuffer& x, const ffi::AnyBuffer& h,
                                   const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dw1,
                                   const ffi::AnyBuffer& dw2, const ffi::AnyBuffer& db1, const ffi::AnyBuffer& db2,
                                   const ffi::AnyBuffer& dscales) {
  JAXMLP_RETURN_IF_ERROR(CheckShape("h", h, {m.M, m.F1}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("dy", dy, {m.M, m.d}));
  if (dy.element_type() != x.element_type() || h.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("jaxmlp: h and dy must have x's dtype");
  const ffi::DataType t = x.element_type();
  JAXMLP_RETURN_IF_ERROR(CheckResult("dx", dx, {m.M, m.d}, t));
  JAXMLP_RETURN_IF_ERROR(CheckResult("dw1", dw1, {m.E, m.d, m.F1}, t));
  JAXMLP_RETURN_IF_ERROR(CheckResult("dw2", dw2, {m.E, m.f, m.d}, t));
  if (m.has_b1) JAXMLP_RETURN_IF_ERROR(CheckResult("db1", db1, {m.E, m.F1}, t));
  if (m.has_b2) JAXMLP_RETURN_IF_ERROR(CheckResult("db2", db2, {m.E, m.d}, t));
  if (m.has_scales) JAXMLP_RETURN_IF_ERROR(CheckResult("dscales", dscales, {m.M}, t));
  return ffi::Error::Success();
}

}  // namespace jaxmlp
