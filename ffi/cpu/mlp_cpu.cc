// CPU handlers: the grouped MLP forward and backward and the grouped GEMM, in float32 arithmetic.
//
// They round intermediates to the input dtype where the CUDA handlers store them in that dtype (the FC1
// output h, the activation output a, the FC2 input gradient and dh), so both backends compute the same
// function. The GEMMs are OpenBLAS's sgemm, one per group (the library jaxmlp/_ffi.py loads and sets to one
// thread): the CPU backend is what users without a GPU, and CI, run.
#include <cstdint>
#include <cstring>
#include <vector>

#include "../activations.h"
#include "cblas.h"  // OpenBLAS from the scipy-openblas32 wheel: its symbols carry the scipy_ prefix
#include "../common.h"
#include "buffers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Error;
using ffi::Result;

std::vector<int64_t> Offsets(const AnyBuffer& group_sizes, int64_t M) {
  int64_t E = group_sizes.element_count();
  std::vector<int64_t> off(E + 1);
  GroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()), E, M, off.data());
  return off;
}

// ---- grouped GEMM in float: one OpenBLAS sgemm per group ---------------------------------------------
// See GemmOp in common.h for the three products. `out` is overwritten (rows outside every group and the
// weight gradients of empty groups become 0).
void GroupedGemm(GemmOp op, const float* lhs, const float* rhs, const std::vector<int64_t>& off, int64_t M,
                 int64_t K, int64_t N, float* out) {
  const int64_t E = int64_t(off.size()) - 1;
  const CBLAS_ORDER kRow = CblasRowMajor;
  const CBLAS_TRANSPOSE kN = CblasNoTrans, kT = CblasTrans;
  for (int64_t g = 0; g < E; ++g) {
    const int64_t o = off[g], c = off[g + 1] - off[g];
    if (op == GemmOp::kTN) {  // lhs[rows of g]^T [K, c] @ rhs[rows of g] [c, N] -> out[g] [K, N]
      if (c == 0) std::fill(out + g * K * N, out + (g + 1) * K * N, 0.0f);
      else scipy_cblas_sgemm(kRow, kT, kN, K, N, c, 1.0f, lhs + o * K, K, rhs + o * N, N, 0.0f, out + g * K * N, N);
    } else if (c > 0 && op == GemmOp::kNN) {  // lhs [c, K] @ rhs[g] [K, N] -> [c, N]
      scipy_cblas_sgemm(kRow, kN, kN, c, N, K, 1.0f, lhs + o * K, K, rhs + g * K * N, N, 0.0f, out + o * N, N);
    } else if (c > 0) {  // kNT: lhs [c, N] @ rhs[g]^T [N, K] -> [c, K]
      scipy_cblas_sgemm(kRow, kN, kT, c, K, N, 1.0f, lhs + o * N, N, rhs + g * K * N, N, 0.0f, out + o * K, K);
    }
  }
  if (op != GemmOp::kTN) {  // rows past the last group
    const int64_t width = op == GemmOp::kNN ? N : K;
    std::fill(out + off.back() * width, out + M * width, 0.0f);
  }
}

// Adds bias[g] to each row of group g ([M, n] += [E, n]).
void AddGroupBias(std::vector<float>& v, const std::vector<float>& bias, const std::vector<int64_t>& off,
                  int64_t n) {
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r)
      for (int64_t j = 0; j < n; ++j) v[r * n + j] += bias[g * n + j];
}

// Adds scales[r] * bias[g] to each row r of group g, the product rounded to `t`: the CUDA handlers store
// it in y's dtype before FC2 accumulates onto it.
void AddScaledGroupBias(DataType t, std::vector<float>& v, const std::vector<float>& bias,
                        const std::vector<float>& scales, const std::vector<int64_t>& off, int64_t n) {
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r)
      for (int64_t j = 0; j < n; ++j) v[r * n + j] += RoundTo(t, scales[r] * bias[g * n + j]);
}

// Per-group column sums of v [M, n] -> [E, n], each row weighted by scales[r] when scales is not empty.
std::vector<float> GroupColumnSums(const std::vector<float>& v, const std::vector<int64_t>& off, int64_t n,
                                   const std::vector<float>& scales = {}) {
  std::vector<float> out((off.size() - 1) * n, 0.0f);
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      const float s = scales.empty() ? 1.0f : scales[r];
      for (int64_t j = 0; j < n; ++j) out[g * n + j] += s * v[r * n + j];
    }
  return out;
}

// ---- handlers --------------------------------------------------------------------------------------
Error MlpForward(AnyBuffer x, AnyBuffer w1, AnyBuffer w2, AnyBuffer group_sizes, AnyBuffer b1, AnyBuffer b2,
                 AnyBuffer scales, int32_t act, float alpha, float limit, Result<AnyBuffer> y,
                 Result<AnyBuffer> h_out) {
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlp(x, w1, w2, group_sizes, b1, b2, scales, act, &m));
  JAXMLP_RETURN_IF_ERROR(CheckMlpForward(m, x, *y, *h_out));
  Poison({&*y, &*h_out});
  const DataType t = x.element_type();
  const ActParams p{static_cast<Act>(act), alpha, limit};
  auto off = Offsets(group_sizes, m.M);
  const int64_t total = off.back();

  std::vector<float> X = ToFloat(x), W1 = ToFloat(w1), W2 = ToFloat(w2), S = ToFloat(scales);
  std::vector<float> H(m.M * m.F1);
  GroupedGemm(GemmOp::kNN, X.data(), W1.data(), off, m.M, m.d, m.F1, H.data());
  // h, the saved pre-activation, is stored in x.dtype: rounded once after FC1 and again after b1 is added,
  // as the CUDA paths do (the GEMM writes h, the activation kernel adds b1 to it).
  RoundAll(t, H);
  if (m.has_b1) {
    AddGroupBias(H, ToFloat(b1), off, m.F1);
    RoundAll(t, H);
  }

  std::vector<float> A(m.M * m.f, 0.0f);
  const bool gated = IsGated(p.act);
  for (int64_t r = 0; r < total; ++r)
    for (int64_t j = 0; j < m.f; ++j) {
      float gate = H[r * m.F1 + j], up = gated ? H[r * m.F1 + m.f + j] : 0.0f;
      float a = ActivationGrad(p, gate, up).val * (m.has_scales ? S[r] : 1.0f);
      A[r * m.f + j] = RoundTo(t, a);
    }
  std::vector<float> Y(m.M * m.d);
  GroupedGemm(GemmOp::kNN, A.data(), W2.data(), off, m.M, m.f, m.d, Y.data());
  // scales weigh the whole expert output, b2 included (an MoE's combine weights).
  if (m.has_b2 && m.has_scales) AddScaledGroupBias(t, Y, ToFloat(b2), S, off, m.d);
  else if (m.has_b2) AddGroupBias(Y, ToFloat(b2), off, m.d);
  Store(Y, *y);
  Store(H, *h_out);
  return Error::Success();
}

Error MlpBackward(AnyBuffer x, AnyBuffer w1, AnyBuffer w2, AnyBuffer group_sizes, AnyBuffer b1, AnyBuffer b2,
                  AnyBuffer scales, AnyBuffer h, AnyBuffer dy, int32_t act, float alpha, float limit,
                  Result<AnyBuffer> dx, Result<AnyBuffer> dw1, Result<AnyBuffer> dw2, Result<AnyBuffer> db1,
                  Result<AnyBuffer> db2, Result<AnyBuffer> dscales) {
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlp(x, w1, w2, group_sizes, b1, b2, scales, act, &m));
  JAXMLP_RETURN_IF_ERROR(CheckMlpBackward(m, x, h, dy, *dx, *dw1, *dw2, *db1, *db2, *dscales));
  Poison({&*dx, &*dw1, &*dw2, &*db1, &*db2, &*dscales});
  const DataType t = x.element_type();
  const ActParams p{static_cast<Act>(act), alpha, limit};
  auto off = Offsets(group_sizes, m.M);
  const bool gated = IsGated(p.act);

  std::vector<float> X = ToFloat(x), W1 = ToFloat(w1), W2 = ToFloat(w2), S = ToFloat(scales);
  std::vector<float> H = ToFloat(h), dY = ToFloat(dy);

  std::vector<float> dA(m.M * m.f);  // gradient w.r.t. the scaled activation output
  GroupedGemm(GemmOp::kNT, dY.data(), W2.data(), off, m.M, m.f, m.d, dA.data());
  RoundAll(t, dA);

  std::vector<float> dH(m.M * m.F1, 0.0f), As(m.M * m.f, 0.0f), dS(m.M, 0.0f);
  const std::vector<float> B2 = m.has_b2 && m.has_scales ? ToFloat(b2) : std::vector<float>();
  for (size_t grp = 0; grp + 1 < off.size(); ++grp)
    for (int64_t r = off[grp]; r < off[grp + 1]; ++r) {
      float s = m.has_scales ? S[r] : 1.0f, ds = 0.0f;
      for (int64_t j = 0; j < m.f; ++j) {
        float gate = H[r * m.F1 + j], up = gated ? H[r * m.F1 + m.f + j] : 0.0f;
        ActGrad g = ActivationGrad(p, gate, up);
        float da = dA[r * m.f + j];
        ds += da * g.val;
        As[r * m.f + j] = RoundTo(t, g.val * s);
        dH[r * m.F1 + j] = RoundTo(t, da * s * g.dgate);
        if (gated) dH[r * m.F1 + m.f + j] = RoundTo(t, da * s * g.dup);
      }
      // y = s * (a @ w2 + b2): the scale's gradient also takes <dy, b2[g]>.
      if (!B2.empty())
        for (int64_t j = 0; j < m.d; ++j) ds += dY[r * m.d + j] * B2[grp * m.d + j];
      dS[r] = ds;
    }

  std::vector<float> dX(m.M * m.d), dW1(m.E * m.d * m.F1), dW2(m.E * m.f * m.d);
  GroupedGemm(GemmOp::kTN, As.data(), dY.data(), off, m.M, m.f, m.d, dW2.data());
  GroupedGemm(GemmOp::kNT, dH.data(), W1.data(), off, m.M, m.d, m.F1, dX.data());
  GroupedGemm(GemmOp::kTN, X.data(), dH.data(), off, m.M, m.d, m.F1, dW1.data());
  Store(dX, *dx);
  Store(dW1, *dw1);
  Store(dW2, *dw2);
  if (m.has_b1) {
    Store(GroupColumnSums(dH, off, m.F1), *db1);
  }
  if (m.has_b2) {
    Store(GroupColumnSums(dY, off, m.d, S), *db2);  // S is empty without scales
  }
  if (m.has_scales) {
    Store(dS, *dscales);
  }
  return Error::Success();
}

Error Gemm(AnyBuffer lhs, AnyBuffer rhs, AnyBuffer group_sizes, int32_t op, Result<AnyBuffer> out) {
  GemmDims g;
  JAXMLP_RETURN_IF_ERROR(CheckGemm(static_cast<GemmOp>(op), lhs, rhs, group_sizes, *out, &g));
  Poison({&*out});
  auto off = Offsets(group_sizes, g.M);
  std::vector<float> L = ToFloat(lhs), R = ToFloat(rhs), O(out->element_count());
  GroupedGemm(static_cast<GemmOp>(op), L.data(), R.data(), off, g.M, g.K, g.N, O.data());
  Store(O, *out);
  return Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpForwardCpu, MlpForward,
                              BindActivationAttrs(BindMlpOperands(ffi::Ffi::Bind()))
                                  .Ret<AnyBuffer>()   // y
                                  .Ret<AnyBuffer>());  // h

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpBackwardCpu, MlpBackward,
                              BindMlpGradients(BindActivationAttrs(BindMlpOperands(ffi::Ffi::Bind())
                                                                       .Arg<AnyBuffer>()     // h
                                                                       .Arg<AnyBuffer>())));  // dy

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCpu, Gemm,
                              ffi::Ffi::Bind()
                                  .Arg<AnyBuffer>()  // lhs
                                  .Arg<AnyBuffer>()  // rhs
                                  .Arg<AnyBuffer>()  // group_sizes
                                  .Attr<int32_t>("op")
                                  .Ret<AnyBuffer>());  // out

}  // namespace jaxmlp
