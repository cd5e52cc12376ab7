// The grouped GEMM call of both backends (jaxmlp.ragged_dot): the check of its operands for each GemmOp.
#pragma once

#include <cstdint>
#include <string>

#include "checks.h"
#include "codes.h"

namespace jaxmlp {

// Shapes of one grouped GEMM call (see GemmOp).
struct GemmDims {
  int64_t M, K, N, E;
};

inline ffi::Error CheckGemm(GemmOp op, const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                            const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& out, GemmDims* dims) {
  if (lhs.dimensions().size() != 2 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("jaxmlp: grouped GEMM expects a 2-D lhs and 1-D group_sizes");
  if (group_sizes.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jaxmlp: group_sizes must be int32");
  if (!IsFloat(lhs.element_type()) || rhs.element_type() != lhs.element_type() || !IsFloat(out.element_type()))
    return ffi::Error::InvalidArgument("jaxmlp: grouped GEMM operands must share one float dtype");
  GemmDims g;
  g.M = lhs.dimensions()[0];
  g.E = group_sizes.dimensions()[0];
  switch (op) {
    case GemmOp::kNN:
      g.K = lhs.dimensions()[1];
      if (rhs.dimensions().size() != 3) return CheckShape("rhs", rhs, {g.E, g.K, -1});
      g.N = rhs.dimensions()[2];
      JAXMLP_RETURN_IF_ERROR(CheckShape("rhs", rhs, {g.E, g.K, g.N}));
      JAXMLP_RETURN_IF_ERROR(CheckShape("out", out, {g.M, g.N}));
      break;
    case GemmOp::kNT:
      g.N = lhs.dimensions()[1];
      if (rhs.dimensions().size() != 3) return CheckShape("rhs", rhs, {g.E, -1, g.N});
      g.K = rhs.dimensions()[1];
      JAXMLP_RETURN_IF_ERROR(CheckShape("rhs", rhs, {g.E, g.K, g.N}));
      JAXMLP_RETURN_IF_ERROR(CheckShape("out", out, {g.M, g.K}));
      break;
    case GemmOp::kTN:
      g.K = lhs.dimensions()[1];
      if (rhs.dimensions().size() != 2) return CheckShape("rhs", rhs, {g.M, -1});
      g.N = rhs.dimensions()[1];
      JAXMLP_RETURN_IF_ERROR(CheckShape("rhs", rhs, {g.M, g.N}));
      JAXMLP_RETURN_IF_ERROR(CheckShape("out", out, {g.E, g.K, g.N}));
      break;
    default:
      return ffi::Error::InvalidArgument("jaxmlp: unknown grouped GEMM op " + std::to_string(int(op)));
  }
  JAXMLP_RETURN_IF_ERROR(CheckExtents({g.M, g.K, g.N, g.E}));
  *dims = g;
  return ffi::Error::Success();
}

}  // namespace jaxmlp
