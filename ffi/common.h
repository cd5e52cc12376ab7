// Shared by the CPU and CUDA handlers: the activation enum, the shape validation of every FFI call,
// and the group_sizes policy. Python validates the same things at trace time with clearer messages;
// the handlers check again because nothing stops a user from calling the FFI targets directly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

namespace ffi = xla::ffi;

// Same order as jaxmlp/activations.py NAMES.
enum class Act : int32_t {
  kSwiglu = 0,
  kGeglu,
  kReglu,
  kGelu,
  kRelu,
  kSilu,
  kSquaredRelu,
  kClampedSwiglu,
  kCount
};

constexpr bool IsGated(Act a) {
  return a == Act::kSwiglu || a == Act::kGeglu || a == Act::kReglu || a == Act::kClampedSwiglu;
}

struct ActParams {
  Act act;
  float alpha;  // clamped_swiglu only
  float limit;  // clamped_swiglu only
};

// The three grouped products. Row-major, for group g owning rows [o_g, o_g + c_g) of the ragged operand:
//   kNN: out[o_g + i, :] = lhs[o_g + i, :] @ rhs[g]           lhs [M, K], rhs [E, K, N], out [M, N]
//   kNT: out[o_g + i, :] = lhs[o_g + i, :] @ rhs[g]^T         lhs [M, N], rhs [E, K, N], out [M, K]
//   kTN: out[g]          = lhs[o_g : o_g+c_g]^T @ rhs[o_g : ] lhs [M, K], rhs [M, N],    out [E, K, N]
// The CUDA FP8 path's weight gradients (cuBLAS takes FP8 only with both operands contiguous along the
// reduction) read transposed copies instead, each group's rows a 16-aligned column segment:
//   kTNPadded: out[g] = lhsT[:, p_g : p_g+c_g] @ rhsT[:, p_g : p_g+c_g]^T   lhsT [K, ld], rhsT [N, ld]
// where p_g is the running sum of the group sizes each rounded up to 16 (zeros in between).
enum class GemmOp : int32_t { kNN = 0, kNT = 1, kTN = 2, kTNPadded = 3 };

// group_sizes policy (documented in README "Semantics"): negative sizes count as 0 and the running total
// is capped at M. offsets[g] = min(sum_{i<g} max(size_i, 0), M); offsets has E + 1 entries, so group g owns
// rows [offsets[g], offsets[g+1]) and every row index derived from group_sizes lies in [0, M].
inline void GroupOffsets(const int32_t* sizes, int64_t E, int64_t M, int64_t* offsets) {
  int64_t total = 0;  // int64: E * INT32_MAX cannot overflow it
  offsets[0] = 0;
  for (int64_t g = 0; g < E; ++g) {
    total += std::max<int32_t>(sizes[g], 0);
    offsets[g + 1] = std::min(total, M);
  }
}

// JAXMLP_POISON_OUTPUTS=1 (the tests set it): handlers fill every output and intermediate with 0xFF bytes
// (NaN for floats) before computing, so an element the kernels forget to write fails the comparison.
inline bool PoisonOutputs() {
  static const bool poison = [] {
    const char* v = std::getenv("JAXMLP_POISON_OUTPUTS");
    return v && *v && std::string(v) != "0";
  }();
  return poison;
}

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

// Shapes of one grouped MLP call, read off the buffers.
struct MlpDims {
  int64_t M, d, f, F1, E;  // F1 = 2f for gated activations, f otherwise
  bool has_b1, has_b2, has_scales;
};

// The shapes of CheckMlp alone (the FP8 backward checks the dtypes of its e4m3 x, w1 and w2 itself).
inline ffi::Error CheckMlpShapes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w1, const ffi::AnyBuffer& w2,
                                 const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& b1,
                                 const ffi::AnyBuffer& b2, const ffi::AnyBuffer& scales, int32_t act,
                                 MlpDims* out) {
  if (act < 0 || act >= static_cast<int32_t>(Act::kCount))
    return ffi::Error::InvalidArgument("jaxmlp: unknown activation id " + std::to_string(act));
  if (x.dimensions().size() != 2 || w1.dimensions().size() != 3 || w2.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("jaxmlp: expected x [M, d], w1 [E, d, F1], w2 [E, f, d], got " +
                                       Dims(x.dimensions()) + ", " + Dims(w1.dimensions()) + ", " +
                                       Dims(w2.dimensions()));
  MlpDims m;
  m.M = x.dimensions()[0];
  m.d = x.dimensions()[1];
  m.E = w1.dimensions()[0];
  m.F1 = w1.dimensions()[2];
  m.f = IsGated(static_cast<Act>(act)) ? m.F1 / 2 : m.F1;
  if (IsGated(static_cast<Act>(act)) && m.F1 % 2 != 0)
    return ffi::Error::InvalidArgument("jaxmlp: a gated activation needs an even w1.shape[2], got " +
                                       std::to_string(m.F1));
  JAXMLP_RETURN_IF_ERROR(CheckShape("w1", w1, {m.E, m.d, m.F1}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("w2", w2, {m.E, m.f, m.d}));
  JAXMLP_RETURN_IF_ERROR(CheckExtents({m.M, m.d, m.F1, m.E}));
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
                           MlpDims* out) {
  JAXMLP_RETURN_IF_ERROR(CheckMlpShapes(x, w1, w2, group_sizes, b1, b2, scales, act, out));
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
