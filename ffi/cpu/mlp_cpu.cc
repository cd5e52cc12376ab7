// CPU handlers: the grouped MLP forward and backward and the grouped GEMM, in float32 arithmetic.
//
// They round intermediates to the input dtype where the CUDA handlers store them in that dtype (the FC1
// output h, the activation output a, the FC2 input gradient and dh), so both backends compute the same
// function. The GEMMs are OpenBLAS's sgemm (the library jaxmlp/_ffi.py loads and sets to one thread), one
// per block of a group's rows or of a weight gradient's columns, the blocks spread over XLA's intra-op
// thread pool (parallel.h). Each row block runs its whole chain (FC1, activation, FC2; or the backward's
// dgrad chain) while its rows are in cache, and float32 operands and results are used in place: at the
// CPU's small shapes, copies, zero-fills and extra passes cost as much as the GEMMs.
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/simd_math.h"  // first: declares expf SIMD before activations.h uses it
#include "activations.h"
#include "cblas.h"  // OpenBLAS from the scipy-openblas32 wheel: its symbols carry the scipy_ prefix
#include "gemm_checks.h"
#include "group_offsets.h"
#include "mlp_checks.h"
#include "cpu/buffers.h"
#include "cpu/parallel.h"
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

// Row-major out [m, n] = op(a) @ op(b), op transposing when ta / tb; every operand with its row stride.
void Sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float* out, int64_t ldo) {
  scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, 1.0f,
                    a, lda, b, ldb, 0.0f, out, ldo);
}

void Zero(float* begin, float* end) {
  if (end > begin) std::memset(begin, 0, (end - begin) * sizeof(float));
}

void RoundRows(DataType t, float* v, int64_t n) {
  if (t != DataType::F32)
    for (int64_t i = 0; i < n; ++i) v[i] = RoundTo(t, v[i]);
}

// A weight-gradient-shaped product, out[g] [K, N] = lhs[rows of g]^T [K, c] @ rhs[rows of g] [c, N] for every
// group g (lhs [M, K], rhs [M, N]); an empty group's out[g] is 0.
struct GroupedTN {
  const float* lhs;
  const float* rhs;
  int64_t K, N;
  float* out;
};

// Runs the products in one pass over the pool (one wait for all), each group's columns in blocks.
void RunGroupedTN(ffi::ThreadPool& pool, const std::vector<int64_t>& off, std::initializer_list<GroupedTN> products) {
  const int64_t E = int64_t(off.size()) - 1, threads = pool.num_threads();
  struct Block {
    const GroupedTN* p;
    int64_t g, c0, c1;
  };
  std::vector<Block> blocks;
  for (const GroupedTN& p : products)
    for (int64_t g = 0; g < E; ++g) {
      const int64_t c = off[g + 1] - off[g], size = p.K * p.N;
      if (c == 0) Zero(p.out + g * size, p.out + (g + 1) * size);
      const int64_t parts = ColumnSplits(c, off.back(), p.N, threads);
      for (int64_t i = 0; c > 0 && i < parts; ++i) {
        Block b{&p, g, 0, 0};
        ColumnRange(i, parts, p.N, &b.c0, &b.c1);
        if (b.c1 > b.c0) blocks.push_back(b);
      }
    }
  ParallelFor(pool, int64_t(blocks.size()), [&](int64_t i) {
    const Block& b = blocks[i];
    const GroupedTN& p = *b.p;
    const int64_t o = off[b.g], c = off[b.g + 1] - o;
    Sgemm(true, false, p.K, b.c1 - b.c0, c, p.lhs + o * p.K, p.K, p.rhs + o * p.N + b.c0, p.N,
          p.out + b.g * p.K * p.N + b.c0, p.N);
  });
}

// Per-group column sums of v [M, n] -> [E, n], each row weighted by scales[r] when scales is given.
std::vector<float> GroupColumnSums(const float* v, const std::vector<int64_t>& off, int64_t n,
                                   const float* scales = nullptr) {
  std::vector<float> out((off.size() - 1) * n, 0.0f);
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      const float s = scales ? scales[r] : 1.0f;
      for (int64_t j = 0; j < n; ++j) out[g * n + j] += s * v[r * n + j];
    }
  return out;
}

// ---- handlers --------------------------------------------------------------------------------------
Error MlpForward(ffi::ThreadPool pool, AnyBuffer x, AnyBuffer w1, AnyBuffer w2, AnyBuffer group_sizes,
                 AnyBuffer b1, AnyBuffer b2, AnyBuffer scales, int32_t act, float alpha, float limit,
                 Result<AnyBuffer> y, Result<AnyBuffer> h_out) {
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlp(x, w1, w2, group_sizes, b1, b2, scales, act, &m));
  JAXMLP_RETURN_IF_ERROR(CheckMlpForward(m, x, *y, *h_out));
  Poison({&*y, &*h_out});
  const DataType t = x.element_type();
  const ActParams p{static_cast<Act>(act), alpha, limit};
  const auto off = Offsets(group_sizes, m.M);
  const int64_t total = off.back(), d = m.d, f = m.f, F1 = m.F1;

  const FloatIn X(x), W1(w1), W2(w2), S(scales), B1(b1), B2(b2);
  FloatOut H(*h_out), Y(*y);
  const auto blocks = RowBlocks(off, pool.num_threads());
  ParallelFor(pool, int64_t(blocks.size()), [&](int64_t i) {
    const RowBlock& b = blocks[i];
    const int64_t c = b.r1 - b.r0;
    float* h = H.data() + b.r0 * F1;
    Sgemm(false, false, c, F1, d, X.data() + b.r0 * d, d, W1.data() + b.g * d * F1, F1, h, F1);
    // h, the saved pre-activation, is stored in x.dtype: rounded once after FC1 and again after b1 is
    // added, as the CUDA paths do (the GEMM writes h, the activation kernel adds b1 to it).
    RoundRows(t, h, c * F1);
    if (m.has_b1) {
      for (int64_t r = 0; r < c; ++r)
        for (int64_t j = 0; j < F1; ++j) h[r * F1 + j] += B1[b.g * F1 + j];
      RoundRows(t, h, c * F1);
    }
    std::unique_ptr<float[]> a(new float[c * f]);
    ByAct(p.act, [&](auto kind) {  // the activation a compile-time constant: no dispatch per element
      constexpr Act kAct = decltype(kind)::value;
      for (int64_t r = 0; r < c; ++r) {
        const float s = m.has_scales ? S[b.r0 + r] : 1.0f;
        const float* hr = h + r * F1;
        float* ar = a.get() + r * f;
#pragma omp simd
        for (int64_t j = 0; j < f; ++j)
          ar[j] = ActivationGradOf<kAct>(p, hr[j], IsGated(kAct) ? hr[f + j] : 0.0f).val * s;
      }
    });
    RoundRows(t, a.get(), c * f);
    float* yb = Y.data() + b.r0 * d;
    Sgemm(false, false, c, d, f, a.get(), f, W2.data() + b.g * f * d, d, yb, d);
    // scales weigh the whole expert output, b2 included (an MoE's combine weights); the product is
    // rounded to y's dtype, as the CUDA handlers store it before FC2 accumulates onto it.
    if (m.has_b2)
      for (int64_t r = 0; r < c; ++r)
        for (int64_t j = 0; j < d; ++j)
          yb[r * d + j] += m.has_scales ? RoundTo(t, S[b.r0 + r] * B2[b.g * d + j]) : B2[b.g * d + j];
  });
  Zero(H.data() + total * F1, H.data() + m.M * F1);  // rows past the last group
  Zero(Y.data() + total * d, Y.data() + m.M * d);
  Y.Finish();
  H.Finish();
  return Error::Success();
}

Error MlpBackward(ffi::ThreadPool pool, AnyBuffer x, AnyBuffer w1, AnyBuffer w2, AnyBuffer group_sizes,
                  AnyBuffer b1, AnyBuffer b2, AnyBuffer scales, AnyBuffer h, AnyBuffer dy, int32_t act,
                  float alpha, float limit, Result<AnyBuffer> dx, Result<AnyBuffer> dw1, Result<AnyBuffer> dw2,
                  Result<AnyBuffer> db1, Result<AnyBuffer> db2, Result<AnyBuffer> dscales) {
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlp(x, w1, w2, group_sizes, b1, b2, scales, act, &m));
  JAXMLP_RETURN_IF_ERROR(CheckMlpBackward(m, x, h, dy, *dx, *dw1, *dw2, *db1, *db2, *dscales));
  Poison({&*dx, &*dw1, &*dw2, &*db1, &*db2, &*dscales});
  const DataType t = x.element_type();
  const ActParams p{static_cast<Act>(act), alpha, limit};
  const auto off = Offsets(group_sizes, m.M);
  const int64_t total = off.back(), d = m.d, f = m.f, F1 = m.F1;

  const FloatIn X(x), W1(w1), W2(w2), S(scales), H(h), dY(dy), B2(b2);
  FloatOut dX(*dx), dW1(*dw1), dW2(*dw2);
  // The scaled activation output and dh, rows of every group: the weight gradients read them.
  std::unique_ptr<float[]> As(new float[total * f]), dH(new float[total * F1]);
  std::vector<float> dS(m.M, 0.0f);

  // Each row block: da = dy @ w2^T, the activation's backward, dx = dh @ w1^T.
  const auto blocks = RowBlocks(off, pool.num_threads());
  ParallelFor(pool, int64_t(blocks.size()), [&](int64_t i) {
    const RowBlock& b = blocks[i];
    const int64_t c = b.r1 - b.r0;
    std::unique_ptr<float[]> da(new float[c * f]);  // gradient w.r.t. the scaled activation output
    Sgemm(false, true, c, f, d, dY.data() + b.r0 * d, d, W2.data() + b.g * f * d, d, da.get(), f);
    RoundRows(t, da.get(), c * f);
    ByAct(p.act, [&](auto kind) {
      constexpr Act kAct = decltype(kind)::value;
      for (int64_t r = b.r0; r < b.r1; ++r) {
        const float s = m.has_scales ? S[r] : 1.0f;
        const float* hr = H.data() + r * F1;
        const float* dar = da.get() + (r - b.r0) * f;
        float* dhr = dH.get() + r * F1;
        float* ar = As.get() + r * f;
        float ds = 0.0f;
#pragma omp simd reduction(+ : ds)
        for (int64_t j = 0; j < f; ++j) {
          const ActGrad g = ActivationGradOf<kAct>(p, hr[j], IsGated(kAct) ? hr[f + j] : 0.0f);
          ds += dar[j] * g.val;
          ar[j] = g.val * s;
          dhr[j] = dar[j] * s * g.dgate;
          if (IsGated(kAct)) dhr[f + j] = dar[j] * s * g.dup;
        }
        // y = s * (a @ w2 + b2): the scale's gradient also takes <dy, b2[g]>.
        if (m.has_b2 && m.has_scales)
          for (int64_t j = 0; j < d; ++j) ds += dY[r * d + j] * B2[b.g * d + j];
        dS[r] = ds;
      }
    });
    RoundRows(t, As.get() + b.r0 * f, c * f);
    RoundRows(t, dH.get() + b.r0 * F1, c * F1);
    Sgemm(false, true, c, d, F1, dH.get() + b.r0 * F1, F1, W1.data() + b.g * d * F1, F1, dX.data() + b.r0 * d, d);
  });
  Zero(dX.data() + total * d, dX.data() + m.M * d);  // rows past the last group
  RunGroupedTN(pool, off, {{X.data(), dH.get(), d, F1, dW1.data()}, {As.get(), dY.data(), f, d, dW2.data()}});
  dX.Finish();
  dW1.Finish();
  dW2.Finish();
  if (m.has_b1) Store(GroupColumnSums(dH.get(), off, F1), *db1);
  if (m.has_b2) Store(GroupColumnSums(dY.data(), off, d, m.has_scales ? S.data() : nullptr), *db2);
  if (m.has_scales) Store(dS, *dscales);
  return Error::Success();
}

// out = the grouped product `op` (GemmOp, codes.h): rows outside every group, and the weight gradients of
// empty groups, are 0.
Error Gemm(ffi::ThreadPool pool, AnyBuffer lhs, AnyBuffer rhs, AnyBuffer group_sizes, int32_t op,
           Result<AnyBuffer> out) {
  GemmDims g;
  JAXMLP_RETURN_IF_ERROR(CheckGemm(static_cast<GemmOp>(op), lhs, rhs, group_sizes, *out, &g));
  Poison({&*out});
  const auto off = Offsets(group_sizes, g.M);
  const FloatIn L(lhs), R(rhs);
  FloatOut O(*out);
  const int64_t K = g.K, N = g.N;
  if (static_cast<GemmOp>(op) == GemmOp::kTN) {  // lhs[rows of g]^T [K, c] @ rhs[rows of g] [c, N]
    RunGroupedTN(pool, off, {{L.data(), R.data(), K, N, O.data()}});
  } else {
    const bool nn = static_cast<GemmOp>(op) == GemmOp::kNN;  // lhs [c, K] @ rhs[g] [K, N] -> [c, N]
    const int64_t width = nn ? N : K;                         // else lhs [c, N] @ rhs[g]^T [N, K] -> [c, K]
    const auto blocks = RowBlocks(off, pool.num_threads());
    ParallelFor(pool, int64_t(blocks.size()), [&](int64_t i) {
      const RowBlock& b = blocks[i];
      const int64_t c = b.r1 - b.r0;
      if (nn) Sgemm(false, false, c, N, K, L.data() + b.r0 * K, K, R.data() + b.g * K * N, N, O.data() + b.r0 * N, N);
      else Sgemm(false, true, c, K, N, L.data() + b.r0 * N, N, R.data() + b.g * K * N, N, O.data() + b.r0 * K, K);
    });
    Zero(O.data() + off.back() * width, O.data() + g.M * width);  // rows past the last group
  }
  O.Finish();
  return Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpForwardCpu, MlpForward,
                              BindActivationAttrs(BindMlpOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()))
                                  .Ret<AnyBuffer>()   // y
                                  .Ret<AnyBuffer>());  // h

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpBackwardCpu, MlpBackward,
                              BindMlpGradients(BindActivationAttrs(BindMlpOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                                                                       .Arg<AnyBuffer>()     // h
                                                                       .Arg<AnyBuffer>())));  // dy

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCpu, Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<AnyBuffer>()  // lhs
                                  .Arg<AnyBuffer>()  // rhs
                                  .Arg<AnyBuffer>()  // group_sizes
                                  .Attr<int32_t>("op")
                                  .Ret<AnyBuffer>());  // out

}  // namespace jaxmlp
