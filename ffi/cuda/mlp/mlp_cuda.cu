// CUDA handlers: the grouped MLP forward and backward, one custom call each. Each is registered once per
// GEMM path (grouped_gemm.h): the cuBLASLt grouped, CUTLASS, fused and tiled paths never sync, so their
// handlers are declared command-buffer compatible; the cublasGemmGroupedBatchedEx fallback syncs once per call.
#include <cuda_runtime.h>


#include "mlp_checks.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/handler.h"
#include "cuda/mlp/mlp_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

namespace {

using ffi::AnyBuffer;
using ffi::Error;
using ffi::Result;

// Workspace of each call: the GroupedGemms arrays and cuBLAS workspace, then the intermediates that
// never leave the call. Used both to size the request (module.cc) and to carve the buffer.
struct ForwardScratch {
  void* a;  // [M, f] activation output, FC2 input
};
ForwardScratch CarveForward(Carver& c, const MlpDims& m, int esize) {
  return {c.Take<char>(m.M * m.f * esize)};
}

// The backward needs less: the activation kernel writes a_s over da (each element is read, then
// written, by one thread) and dh over h, whose buffer XLA donates to the dh result (see _ffi.py). On the
// cuBLAS paths da itself lives in the dw1 result when that is large enough (E d F1 >= M f, true at MoE
// shapes): dw1 is written by the last GEMM, after a_s has been consumed by the dw2 GEMM. The tiled path
// computes dw2 and dw1 in one launch, so there da needs its own buffer (small, as the problem is); on the
// cuBLAS paths the dw1 product is enqueued after dw2's (MlpBackward), not in one RunIndependent list.
// On the engine FC2's data gradient can take the activation's backward in its epilogue, which leaves the
// scales' gradients as partial sums per row and 128 columns (ds_parts), added up by ActivationBackward.
struct BackwardScratch {
  void* da;              // [M, f] gradient of the FC2 input, then a_s; null: use the dw1 result
  float* bias_partials;  // BiasGradients' scratch
  float* ds_parts;       // the engine: [M, ceil(f / 128)] (used with scales; the size query does not know them)
};
BackwardScratch CarveBackward(Carver& c, GemmPath path, const MlpDims& m, int esize) {
  BackwardScratch s;
  const bool in_dw1 = path != GemmPath::kTiled && m.E * m.d * m.F1 >= m.M * m.f;
  s.da = in_dw1 ? nullptr : c.Take<char>(m.M * m.f * esize);
  s.bias_partials = (m.has_b1 || m.has_b2) ? c.Take<float>(BiasGradientsScratch(m)) : nullptr;
  s.ds_parts = path == GemmPath::kCutlass ? c.Take<float>(m.M * ScaleGradientParts(m.f)) : nullptr;
  return s;
}

// What FC1 reads from x: the rows themselves, or (the gathered forward) row r = token gather[r] / div of x's
// tokens, zeros where gather[r] < 0 (GemmSpec::gather).
struct Fc1Rows {
  const int32_t* gather = nullptr;
  int32_t div = 1;
};

template <GemmPath kPath>
Error RunForward(cudaStream_t stream, int32_t device, AnyBuffer x, Fc1Rows rows, AnyBuffer w1, AnyBuffer w2,
                 AnyBuffer group_sizes, AnyBuffer b1, AnyBuffer b2, AnyBuffer scales, int32_t act, float alpha,
                 float limit, int32_t zero_padding, const MlpDims& m, Result<AnyBuffer> y, Result<AnyBuffer> h,
                 Result<AnyBuffer> workspace) {
  JAXMLP_RETURN_IF_ERROR(CheckMlpForward(m, x, *y, *h));
  const ffi::DataType t = x.element_type();
  Carver ws(workspace->untyped_data());
  GroupedGemms gemms(kPath, stream, device, static_cast<const int32_t*>(group_sizes.untyped_data()), m.E, m.M,
                     /*split_k=*/true, ws);
  ForwardScratch s = CarveForward(ws, m, int(ffi::ByteWidth(t)));
  JAXMLP_RETURN_IF_ERROR(CheckWorkspace(ws, *workspace));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*y, &*h, &*workspace}));

  GemmSpec fc1{GemmOp::kNN, int32_t(m.d), int32_t(m.F1), x.untyped_data(), w1.untyped_data(), h->untyped_data(), t, t,
               0.0f, true, true};
  fc1.gather = rows.gather, fc1.gather_div = rows.div, fc1.sources = x.dimensions()[0];
  JAXMLP_RETURN_IF_ERROR(gemms.Prepare({
      fc1,
      {GemmOp::kNN, int32_t(m.f), int32_t(m.d), s.a, w2.untyped_data(), y->untyped_data(), t, t,
       m.has_b2 ? 1.0f : 0.0f, false, true},
  }));
  const ActParams ap{Act(act), alpha, limit};
  // On the engine FC1's epilogue adds b1 to h and computes a; what is left of the activation pass is y's
  // prefill with b2 (and its padding rows), or y's padding rows alone.
  const bool fused = gemms.FusesActivation(0, ap.act);
  if (rows.gather && !fused)
    return Error::InvalidArgument("jaxmlp: the gathered forward runs on the engine's FC1 with a gated activation "
                                  "and f a multiple of 64");
  if (fused)  // h (+ b1), a
    JAXMLP_RETURN_IF_ERROR(gemms.RunWithActivation(0, {ap, DataIfPresent(scales), s.a, DataIfPresent(b1)}));
  else JAXMLP_RETURN_IF_ERROR(gemms.Run(0));  // h = x @ w1
  if (!fused || m.has_b2)
    JAXMLP_RETURN_IF_ERROR(ActivationForward(stream, device, t, ap, gemms.offsets(), m.E, m.M, m.f, m.d,
                                             h->untyped_data(), fused ? nullptr : DataIfPresent(b1),
                                             DataIfPresent(scales), s.a,
                                             y->untyped_data(), DataIfPresent(b2), zero_padding != 0,
                                             /*activation=*/!fused));
  else if (zero_padding)
    JAXMLP_RETURN_IF_ERROR(gemms.ZeroPaddingRows(1));
  return gemms.Run(1);  // y (+)= a @ w2
}

template <GemmPath kPath>
Error MlpForward(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer w1, AnyBuffer w2, AnyBuffer group_sizes,
                 AnyBuffer b1, AnyBuffer b2, AnyBuffer scales, int32_t act, float alpha, float limit,
                 int32_t zero_padding, Result<AnyBuffer> y, Result<AnyBuffer> h, Result<AnyBuffer> workspace) {
  ++handler_host_calls;
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlp(x, w1, w2, group_sizes, b1, b2, scales, act, &m));
  return RunForward<kPath>(stream, device, x, {}, w1, w2, group_sizes, b1, b2, scales, act, alpha, limit,
                           zero_padding, m, y, h, workspace);
}

// The forward over rows gathered from x's T tokens by the dispatch plan: row r is token slot_of_row[r] /
// top_k (jaxmlp.Plan), zeros where slot_of_row[r] < 0 or the token is past T; FC1 reads them in its loads
// (the engine's, on the CUTLASS or the fused path: fc2_on_engine picks), so no gathered copy is written.
Error GatheredMlpForward(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer slot_of_row, AnyBuffer w1,
                         AnyBuffer w2, AnyBuffer group_sizes, AnyBuffer b1, AnyBuffer b2, AnyBuffer scales, int32_t act,
                         float alpha, float limit, int32_t zero_padding, int32_t top_k, int32_t fc2_on_engine,
                         Result<AnyBuffer> y, Result<AnyBuffer> h, Result<AnyBuffer> workspace) {
  ++handler_host_calls;
  if (slot_of_row.dimensions().size() != 1 || slot_of_row.element_type() != ffi::DataType::S32)
    return Error::InvalidArgument("jaxmlp: slot_of_row must be int32 [M], got " + Dims(slot_of_row.dimensions()));
  if (top_k < 1) return Error::InvalidArgument("jaxmlp: top_k must be at least 1");
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlp(x, w1, w2, group_sizes, b1, b2, scales, act, &m, slot_of_row.dimensions()[0]));
  const Fc1Rows rows{static_cast<const int32_t*>(slot_of_row.untyped_data()), top_k};
  if (fc2_on_engine)
    return RunForward<GemmPath::kCutlass>(stream, device, x, rows, w1, w2, group_sizes, b1, b2, scales, act, alpha,
                                          limit, zero_padding, m, y, h, workspace);
  return RunForward<GemmPath::kFused>(stream, device, x, rows, w1, w2, group_sizes, b1, b2, scales, act, alpha, limit,
                                      zero_padding, m, y, h, workspace);
}

template <GemmPath kPath>
Error MlpBackward(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer w1, AnyBuffer w2, AnyBuffer group_sizes,
                  AnyBuffer b1, AnyBuffer b2, AnyBuffer scales, AnyBuffer h, AnyBuffer dy, int32_t act, float alpha,
                  float limit, int32_t zero_padding, Result<AnyBuffer> dx, Result<AnyBuffer> dw1, Result<AnyBuffer> dw2,
                  Result<AnyBuffer> db1, Result<AnyBuffer> db2, Result<AnyBuffer> dscales, Result<AnyBuffer> dh,
                  Result<AnyBuffer> workspace) {
  ++handler_host_calls;
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlp(x, w1, w2, group_sizes, b1, b2, scales, act, &m));
  JAXMLP_RETURN_IF_ERROR(CheckMlpBackward(m, x, h, dy, *dx, *dw1, *dw2, *db1, *db2, *dscales));
  JAXMLP_RETURN_IF_ERROR(CheckResult("dh", *dh, {m.M, m.F1}, x.element_type()));
  const ffi::DataType t = x.element_type();
  Carver ws(workspace->untyped_data());
  GroupedGemms gemms(kPath, stream, device, static_cast<const int32_t*>(group_sizes.untyped_data()), m.E, m.M,
                     /*split_k=*/true, ws);
  BackwardScratch s = CarveBackward(ws, kPath, m, int(ffi::ByteWidth(t)));
  JAXMLP_RETURN_IF_ERROR(CheckWorkspace(ws, *workspace));
  const bool da_in_dw1 = !s.da;
  if (da_in_dw1) s.da = dw1->untyped_data();
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*dx, &*dw1, &*dw2, &*db1, &*db2, &*dscales, &*workspace}));

  const int32_t d = int32_t(m.d), f = int32_t(m.f), F1 = int32_t(m.F1);
  JAXMLP_RETURN_IF_ERROR(gemms.Prepare({
      {GemmOp::kNT, f, d, dy.untyped_data(), w2.untyped_data(), s.da, t, t, 0.0f, true, true},    // da = dy w2^T
      {GemmOp::kTN, f, d, s.da, dy.untyped_data(), dw2->untyped_data(), t, t, 0.0f, false, true},  // dw2 = a_s^T dy
      {GemmOp::kNT, d, F1, dh->untyped_data(), w1.untyped_data(), dx->untyped_data(), t, t, 0.0f, false, true},
      {GemmOp::kTN, d, F1, x.untyped_data(), dh->untyped_data(), dw1->untyped_data(), t, t, 0.0f, true, false},
  }));
  const ActParams ap{Act(act), alpha, limit};
  // On the engine the activation's backward runs in the da product's epilogue (a_s over da, dh over h); what
  // is left of the activation pass is the scales' gradients (from the epilogue's partial sums) and dx's
  // padding rows, or dx's padding rows alone.
  const bool fused = gemms.FusesActivation(0, ap.act);
  void* ds = m.has_scales ? dscales->untyped_data() : nullptr;
  if (fused)
    JAXMLP_RETURN_IF_ERROR(gemms.RunWithActivation(0, {ap, DataIfPresent(scales), nullptr, nullptr, h.untyped_data(),
                                                       dh->untyped_data(), ds ? s.ds_parts : nullptr}));
  else JAXMLP_RETURN_IF_ERROR(gemms.Run(0));  // da = dy w2^T
  if (!fused || ds)
    JAXMLP_RETURN_IF_ERROR(ActivationBackward(stream, device, t, ap, gemms.offsets(), m.E, m.M, m.f, m.d,
                                              h.untyped_data(), s.da, DataIfPresent(scales), s.da,
                                              dh->untyped_data(), ds, dx->untyped_data(), dy.untyped_data(),
                                              DataIfPresent(b2), zero_padding != 0, fused ? s.ds_parts : nullptr));
  else if (zero_padding)
    JAXMLP_RETURN_IF_ERROR(gemms.ZeroPaddingRows(2));
  // RunIndependent's promise: none of its products reads another's output (the tiled path runs them in one
  // launch, in no order). dx (2), dw2 (1) and dw1 (3) read dh, w1, a_s (in da), dy and x, and write dx, dw2
  // and dw1, except where da lives in dw1's buffer (the cuBLAS paths at MoE shapes, CarveBackward): then dw1's
  // product overwrites the a_s that dw2's reads, so it is enqueued after it, on its own. That split costs
  // nothing: the cuBLAS paths enqueue a list's products one by one, in order, anyway; the tiled path, the one
  // that fuses them, gives da its own buffer and keeps the single launch.
  // dx first: on the tiled path its blocks, the launch's longest (the reduction runs over F1), then start
  // in the first wave.
  if (da_in_dw1) {
    JAXMLP_RETURN_IF_ERROR(gemms.RunIndependent({2, 1}));
    JAXMLP_RETURN_IF_ERROR(gemms.Run(3));  // dw1 = x^T dh, over da: after dw2's product has read a_s
  } else {
    JAXMLP_RETURN_IF_ERROR(gemms.RunIndependent({2, 1, 3}));
  }
  JAXMLP_RETURN_IF_ERROR(gemms.ZeroEmptyGroups({1, 3}));
  return BiasGradients(stream, t, gemms.offsets(), m, dh->untyped_data(), dy.untyped_data(), DataIfPresent(scales),
                       s.bias_partials, db1->untyped_data(), db2->untyped_data());
}

// zero_padding (0 or 1): whether y (forward) and dx (backward) get zeros in the rows past the groups, which
// the MoE layer, whose dispatch and combine never read them, leaves unwritten (jaxmlp/mlp.py).
auto BindForward() {
  return BindActivationAttrs(BindMlpOperands(BindStreamAndDevice()))
      .Attr<int32_t>("zero_padding")
      .Ret<AnyBuffer>()   // y
      .Ret<AnyBuffer>()   // h
      .Ret<AnyBuffer>();  // workspace
}

auto BindForwardGathered() {
  return BindActivationAttrs(BindStreamAndDevice()
                                 .Arg<AnyBuffer>()    // x: the tokens
                                 .Arg<AnyBuffer>()    // slot_of_row
                                 .Arg<AnyBuffer>()    // w1
                                 .Arg<AnyBuffer>()    // w2
                                 .Arg<AnyBuffer>()    // group_sizes
                                 .Arg<AnyBuffer>()    // b1
                                 .Arg<AnyBuffer>()    // b2
                                 .Arg<AnyBuffer>())   // scales
      .Attr<int32_t>("zero_padding")
      .Attr<int32_t>("top_k")
      .Attr<int32_t>("fc2_on_engine")
      .Ret<AnyBuffer>()   // y
      .Ret<AnyBuffer>()   // h
      .Ret<AnyBuffer>();  // workspace
}

auto BindBackward() {
  return BindMlpGradients(BindActivationAttrs(BindMlpOperands(BindStreamAndDevice())
                                                  .Arg<AnyBuffer>()    // h
                                                  .Arg<AnyBuffer>())   // dy
                              .Attr<int32_t>("zero_padding"))
      .Ret<AnyBuffer>()                                                // dh, aliased to h
      .Ret<AnyBuffer>();                                               // workspace
}

}  // namespace

size_t MlpWorkspaceBytes(GemmPath path, bool forward, const MlpDims& m, int esize) {
  Carver c(nullptr);
  GroupedGemms counted(path, nullptr, 0, nullptr, m.E, m.M, /*split_k=*/true, c);
  if (forward) CarveForward(c, m, esize);
  else CarveBackward(c, path, m, esize);
  return c.used();
}

}  // namespace jaxmlp

using jaxmlp::GemmPath;
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpForwardGrouped, jaxmlp::MlpForward<GemmPath::kGrouped>, jaxmlp::BindForward(),
                              jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpForwardFallback, jaxmlp::MlpForward<GemmPath::kFallback>, jaxmlp::BindForward());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpBackwardGrouped, jaxmlp::MlpBackward<GemmPath::kGrouped>, jaxmlp::BindBackward(),
                              jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpBackwardFallback, jaxmlp::MlpBackward<GemmPath::kFallback>, jaxmlp::BindBackward());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpForwardTiled, jaxmlp::MlpForward<GemmPath::kTiled>, jaxmlp::BindForward(),
                              jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpBackwardTiled, jaxmlp::MlpBackward<GemmPath::kTiled>, jaxmlp::BindBackward(),
                              jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpForwardCutlass, jaxmlp::MlpForward<GemmPath::kCutlass>, jaxmlp::BindForward(),
                              jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpBackwardCutlass, jaxmlp::MlpBackward<GemmPath::kCutlass>, jaxmlp::BindBackward(),
                              jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpForwardFused, jaxmlp::MlpForward<GemmPath::kFused>, jaxmlp::BindForward(),
                              jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpBackwardFused, jaxmlp::MlpBackward<GemmPath::kFused>, jaxmlp::BindBackward(),
                              jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpForwardGathered, jaxmlp::GatheredMlpForward, jaxmlp::BindForwardGathered(),
                              jaxmlp::kGraphSafe);
