// CUDA handlers of the tensorwise FP8 grouped MLP (the recipe: jaxmlp/fp8/tensorwise.py), one custom call per
// direction, on the cuBLASLt grouped GEMM with FP8 e4m3 operands (with the "engine" attribute the row products
// on jaxmlp's CUTLASS engine), and its weight quantizer. FP8 tensor cores take FP8 only in the "TN" layout
// (both operands contiguous along the reduction), so the weights are quantized in one pass into both layouts
// (Fp8TensorWeights: its own call, so that a caller can quantize them once for several calls): transposed for
// the forward, as they lie for the backward's data gradients. FP8 weight gradients read transposed copies of
// the activations and gradients, each group's rows a 16-aligned column segment (GemmOp::kTNPadded); x's is
// written by the forward's pass that quantizes x, beside its rows. 16-bit weight gradients read x, dy and a,
// dh in x.dtype instead. Group sizes stay on the device: no host sync, command-buffer compatible.
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "mlp_checks.h"
#include "cuda/fp8/fp8_mlp_kernels.h"
#include "cuda/fp8/fp8_quantize_kernels.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/handler.h"
#include "cuda/launch.cuh"
#include "cuda/mlp/mlp_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Error;
using ffi::Result;

// Scratch of the forward. scale: the dequantization scales of x, w1, w2, a (cuBLAS reads them); xq and aq:
// FC1's and FC2's e4m3 operands. xq [M, d] lives in y's buffer (M d elements of 2 bytes): it is dead
// once FC1's product has read it, and y is written after that (the activation's pass: b2's share and the
// rows past the groups; FC2's product).
struct ForwardScratch {
  float* scale;  // [4]
  uint8_t* xq;   // [M, d], in y
  uint8_t* aq;   // [M, f]
};
ForwardScratch CarveForward(Carver& c, const MlpDims& m, void* y) {
  ForwardScratch s;
  s.scale = c.Take<float>(4);
  s.xq = static_cast<uint8_t*>(y);
  s.aq = c.Take<uint8_t>(m.M * m.f);
  return s;
}

// Scratch of the backward: the amaxes of dy and dh, the scales of x, w1, w2, a, dy, dh, the quantized
// operands in row layout (dyq, dhq) and da; with FP8 weight gradients the transposed copies (dyt, at, dht:
// [width, L]; x's came from the forward) and with row scales their gradients' partial sums (ds_parts), else
// a16, a in x.dtype; dh in x.dtype with b1 or 16-bit weight gradients, and BiasGradients' partial sums with
// biases.
//
// Most of it lives in results that are written only after it is dead, where it fits (InResult), so that
// the backward holds little more than bf16's does (docs/fp8.md, "Memory"):
//   dx's buffer:  dyq, dead once da's product has read it (then the activation's pass writes dx's rows past
//                 the groups, and dx's product the rest);
//   dw1's buffer: da, dead after the activation's passes; then dhq, and at and dyt (FP8 weight gradients)
//                 or a16: the inputs of dx's and dw2's products, which run before dw1's (MlpFp8Backward).
// dht, ds_parts and the 16-bit dh stay in the workspace: dw1's product reads dht and dh (and BiasGradients,
// dh).
struct BackwardScratch {
  float *amax, *scale;  // [2], [6]
  uint8_t *dyq, *dhq;
  uint8_t *dyt = nullptr, *at = nullptr, *dht = nullptr;
  float* ds_parts = nullptr;  // [M, Fp8ActTileParts(f)]
  char* da;  // [M, f] in x.dtype
  char* a16 = nullptr;  // [M, f] in x.dtype
  char* dh = nullptr;  // [M, F1] in x.dtype
  float* bias_partials = nullptr;
};

// A result's buffer of `size` bytes as scratch: Take places count Ts after what it placed before (a Carver
// over the buffer), or says that they do not fit. By sizes alone: the size query (base null) places what
// the call does.
struct InResult {
  Carver carver;
  size_t size;
  template <typename T>
  bool Take(size_t count, T*& p) {
    Carver trial = carver;
    T* placed = trial.Take<T>(count);
    if (trial.used() > size) return false;
    carver = trial, p = placed;
    return true;
  }
};

// dx, dw1, dw2: the results' buffers (null in the size query).
BackwardScratch CarveBackward(Carver& c, const MlpDims& m, int esize, bool fp8_wgrad, void* dx, void* dw1,
                              void* dw2) {
  const int64_t L = PaddedRows(m.M, m.E);
  InResult in_dx{Carver(dx), size_t(m.M * m.d * esize)}, in_dw1{Carver(dw1), size_t(m.E * m.d * m.F1 * esize)},
      in_dw2{Carver(dw2), size_t(m.E * m.f * m.d * esize)};
  const auto place = [&c](InResult& r, size_t count, auto*& p) {
    if (!r.Take(count, p)) p = c.Take<std::remove_reference_t<decltype(*p)>>(count);
  };
  BackwardScratch s;
  s.amax = c.Take<float>(2);
  s.scale = c.Take<float>(6);
  place(in_dx, m.M * m.d, s.dyq);
  place(in_dw1, m.M * m.f * esize, s.da);
  place(in_dw1, m.M * m.F1, s.dhq);
  if (fp8_wgrad) {
    if (m.has_scales) s.ds_parts = c.Take<float>(m.M * Fp8ActTileParts(m.f));
    place(in_dw1, m.f * L, s.at);
    place(in_dw1, m.d * L, s.dyt);
    s.dht = c.Take<uint8_t>(m.F1 * L);
  } else {
    place(in_dw1, m.M * m.f * esize, s.a16);
  }
  if (m.has_b1 || !fp8_wgrad) s.dh = c.Take<char>(m.M * m.F1 * esize);
  if (m.has_b1 || m.has_b2) s.bias_partials = c.Take<float>(BiasGradientsScratch(m));
  return s;
}

// The e4m3 weights and x's copy that the backward takes from the forward: w1q, w2q as they lie, and xt, x
// transposed into the FP8 weight gradients' layout [d, L] (each group's rows from a multiple of 16), or with
// 16-bit weight gradients x itself [M, d] in the operands' dtype t.
Error CheckFp8Copies(const MlpDims& m, const AnyBuffer& xt, const AnyBuffer& w1q, const AnyBuffer& w2q,
                     bool fp8_wgrad = true, DataType t = DataType::BF16) {
  if (fp8_wgrad) JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("xt", xt, {m.d, PaddedRows(m.M, m.E)}));
  else JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("x", xt, {m.M, m.d}, t, "h's dtype"));
  JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("w1q", w1q, {m.E, m.d, m.F1}));
  return CheckFp8Buffer("w2q", w2q, {m.E, m.f, m.d});
}

Error CheckFp8(const MlpDims& m, DataType t) {
  if (t != DataType::BF16 && t != DataType::F16)
    return Error::InvalidArgument("jaxmlp: the FP8 grouped MLP takes bfloat16 or float16 operands");
  if (m.d % 16 || m.f % 16) return Error::InvalidArgument("jaxmlp: the FP8 grouped MLP needs d and f multiples of 16");
  return Error::Success();
}

Error Zero(cudaStream_t stream, void* p, size_t bytes) {
  return CheckCuda(cudaMemsetAsync(p, 0, bytes, stream), "zeroing FP8 scratch");
}

Error CopyAmax(cudaStream_t stream, float* to, const void* from, int n) {
  return CheckCuda(cudaMemcpyAsync(to, from, n * sizeof(float), cudaMemcpyDeviceToDevice, stream), "copying amaxes");
}

// Delayed scaling: `delayed` (the amaxes to scale by) and `seen` (those observed) are both float32 [2], or
// both absent (current scaling).
Error CheckDelayed(const AnyBuffer& delayed, const AnyBuffer& seen) {
  if (Present(delayed) != Present(seen))
    return Error::InvalidArgument("jaxmlp: delayed and seen must be both given or both absent");
  if (!Present(delayed)) return Error::Success();
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("delayed", delayed, {2}, DataType::F32, "dtype float32"));
  return CheckShapeAndType("seen", seen, {2}, DataType::F32, "dtype float32");
}

// The calls' GEMM path: cuBLASLt's grouped GEMM, or with `engine` (the "engine" attribute) jaxmlp's CUTLASS
// engine for the row products (FC1, FC2, the data gradients: kNT), cuBLASLt's for the weight gradients.
GemmPath Fp8Path(bool engine) { return engine ? GemmPath::kCutlass : GemmPath::kGrouped; }

// An FP8 product: lhs and rhs e4m3 with their scales, out in `t`.
GemmSpec Fp8Product(GemmOp op, int64_t K, int64_t N, const void* lhs, const float* lhs_scale, const void* rhs,
                    const float* rhs_scale, void* out, DataType t, bool fast_accumulation, float beta = 0.0f) {
  GemmSpec s{op, int32_t(K), int32_t(N), lhs, rhs, out, kFp8, t, beta};
  s.lhs_scale = lhs_scale, s.rhs_scale = rhs_scale, s.fast_accumulation = fast_accumulation;
  return s;
}

// Quantization of weights w [E, rows, cols] of one expert after another, in one pass: as they lie
// (`lying`) and transposed ([E, cols, rows]: `transposed`).
Fp8Outputs Weights(void* lying, void* transposed, int64_t E, int64_t rows, int64_t cols) {
  Fp8Outputs o;
  o.rows_out = lying, o.cols_out = transposed, o.E = E, o.group_rows = rows, o.group_stride = rows * cols;
  o.ld = rows;
  return o;
}

// Quantization of activations [M, width]: rows (into rows_out, may be null) and/or the padded
// transposed layout [width, L] of the weight gradients (cols_out, may be null).
Fp8Outputs Activations(void* rows_out, void* cols_out, const GroupedGemms& gemms, const MlpDims& m) {
  Fp8Outputs o;
  o.rows_out = rows_out, o.cols_out = cols_out, o.row_offsets = gemms.offsets(), o.E = m.E;
  o.col_offsets = gemms.padded_starts(), o.ld = PaddedRows(m.M, m.E);
  return o;
}

// The tensorwise recipe's weights w [E, K, N] (bfloat16 or float16): q [E, K, N] and qt [E, N, K] in e4m3
// with the scale of amax [1] = max |w|.
Error Fp8TensorWeights(cudaStream_t stream, AnyBuffer w, Result<AnyBuffer> q, Result<AnyBuffer> amax,
                       Result<AnyBuffer> qt) {
  ++handler_host_calls;
  const DataType t = w.element_type();
  if (w.dimensions().size() != 3)
    return Error::InvalidArgument("jaxmlp: w must be [E, K, N], got " + Dims(w.dimensions()));
  if (t != DataType::BF16 && t != DataType::F16)
    return Error::InvalidArgument("jaxmlp: FP8 weights are quantized from bfloat16 or float16");
  const int64_t E = w.dimensions()[0], K = w.dimensions()[1], N = w.dimensions()[2];
  JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("q", *q, {E, K, N}));
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("amax", *amax, {1}, DataType::F32, "dtype float32"));
  JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("qt", *qt, {E, N, K}));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*q, &*amax, &*qt}));
  float* am = static_cast<float*>(amax->untyped_data());
  JAXMLP_RETURN_IF_ERROR(Zero(stream, am, sizeof(float)));
  if (w.element_count() == 0) return Error::Success();
  JAXMLP_RETURN_IF_ERROR(AbsMax(stream, t, w.untyped_data(), nullptr, 1, E * K, N, am));
  return QuantizeRows(stream, t, w.untyped_data(), E * K, N, am, nullptr,
                      Weights(q->untyped_data(), qt->untyped_data(), E, K, N));
}

// w1 and w2 are the e4m3 weights of Fp8TensorWeights as they lie (for the shapes; the backward reads
// them), w1t and w2t the same transposed, weight_amax [2] their absolute maxima. xt: x's e4m3 copy in the
// weight gradients' layout, written by the pass that quantizes x for FC1 (its transposed tile besides its
// rows), the backward's residual; absent (ABSENT, a scalar) where the call is not differentiated or the
// backward's weight gradients are 16-bit (it then takes x itself). slot_of_row: absent, or int32 [M]: x then
// holds T tokens, and the rows are those a dispatch plan takes from them (Fp8Rows: token slot_of_row[r] /
// top_k, zeros where it names none), read by the passes that quantize x, so no 16-bit copy of the rows is
// written; the backward takes xt alone (16-bit weight gradients would need the rows themselves).
// delayed: absent (current scaling), or float32 [2], the amaxes of x and a to scale by (delayed scaling: an
// amax history's; where one is 0, an empty history, that tensor's own), which `amax` then holds in their
// places; `seen` [2] gets x's and a's amaxes as observed, from the passes that quantize them (no amax passes:
// theirs are launched, and return at once, but for an empty history).
Error MlpFp8Forward(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer w1, AnyBuffer w2, AnyBuffer group_sizes,
                    AnyBuffer b1, AnyBuffer b2, AnyBuffer scales, AnyBuffer w1t, AnyBuffer w2t, AnyBuffer weight_amax,
                    AnyBuffer slot_of_row, AnyBuffer delayed, int32_t act, float alpha, float limit,
                    bool fast_accumulation, bool engine, int32_t top_k, Result<AnyBuffer> y, Result<AnyBuffer> h,
                    Result<AnyBuffer> amax, Result<AnyBuffer> xt, Result<AnyBuffer> seen,
                    Result<AnyBuffer> workspace) {
  ++handler_host_calls;
  const bool late = Present(delayed);
  JAXMLP_RETURN_IF_ERROR(CheckDelayed(delayed, *seen));
  const bool gathered = Present(slot_of_row);
  if (gathered && (slot_of_row.dimensions().size() != 1 || slot_of_row.element_type() != DataType::S32))
    return Error::InvalidArgument("jaxmlp: slot_of_row must be int32 [M], got " + Dims(slot_of_row.dimensions()));
  if (gathered && top_k < 1) return Error::InvalidArgument("jaxmlp: top_k must be at least 1");
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlpShapes(x, w1, w2, group_sizes, b1, b2, scales, act, &m,
                                        gathered ? slot_of_row.dimensions()[0] : -1));
  const DataType t = x.element_type();
  JAXMLP_RETURN_IF_ERROR(CheckFp8(m, t));
  for (const AnyBuffer* b : {&b1, &b2, &scales})
    if (b->element_type() != t) return Error::InvalidArgument("jaxmlp: b1, b2 and scales must have x's dtype");
  const bool residual = Present(*xt);
  if (residual) JAXMLP_RETURN_IF_ERROR(CheckFp8Copies(m, *xt, w1, w2));
  JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("w1t", w1t, {m.E, m.F1, m.d}));
  JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("w2t", w2t, {m.E, m.d, m.f}));
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("weight_amax", weight_amax, {2}, DataType::F32, "dtype float32"));
  JAXMLP_RETURN_IF_ERROR(CheckMlpForward(m, x, *y, *h));
  JAXMLP_RETURN_IF_ERROR(CheckResult("amax", *amax, {4}, DataType::F32));
  Carver ws(workspace->untyped_data());
  GroupedGemms gemms(Fp8Path(engine), stream, device, static_cast<const int32_t*>(group_sizes.untyped_data()), m.E,
                     m.M, /*split_k=*/false, ws);
  const ForwardScratch s = CarveForward(ws, m, y->untyped_data());
  JAXMLP_RETURN_IF_ERROR(CheckWorkspace(ws, *workspace));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*y, &*h, &*amax, &*xt, &*seen, &*workspace}));
  float* am = static_cast<float*>(amax->untyped_data());  // x, w1, w2, a
  float* observed = late ? static_cast<float*>(seen->untyped_data()) : nullptr;  // x, a
  const float* given = late ? static_cast<const float*>(delayed.untyped_data()) : nullptr;  // x, a
  JAXMLP_RETURN_IF_ERROR(Zero(stream, am, 4 * sizeof(float)));
  JAXMLP_RETURN_IF_ERROR(CopyAmax(stream, am + 1, weight_amax.untyped_data(), 2));  // the weights' amax
  if (late) {
    JAXMLP_RETURN_IF_ERROR(CopyAmax(stream, am + 0, given + 0, 1));
    JAXMLP_RETURN_IF_ERROR(CopyAmax(stream, am + 3, given + 1, 1));
    JAXMLP_RETURN_IF_ERROR(Zero(stream, observed, 2 * sizeof(float)));
  }
  JAXMLP_RETURN_IF_ERROR(ScalesOf(stream, am + 1, 2, s.scale + 1));

  JAXMLP_RETURN_IF_ERROR(gemms.Prepare({
      Fp8Product(GemmOp::kNT, m.F1, m.d, s.xq, s.scale + 0, w1t.untyped_data(), s.scale + 1,
                 h->untyped_data(), t, fast_accumulation),
      Fp8Product(GemmOp::kNT, m.d, m.f, s.aq, s.scale + 3, w2t.untyped_data(), s.scale + 2, y->untyped_data(), t,
                 fast_accumulation, m.has_b2 ? 1.0f : 0.0f),  // onto y = s * b2[g] where b2 is given
  }, /*padded_layout=*/residual));
  Fp8Rows rows;
  if (gathered) rows = {static_cast<const int32_t*>(slot_of_row.untyped_data()), top_k, x.dimensions()[0]};
  JAXMLP_RETURN_IF_ERROR(
      AbsMax(stream, t, x.untyped_data(), gemms.offsets(), m.E, m.M, m.d, am + 0, rows, late ? given + 0 : nullptr));
  JAXMLP_RETURN_IF_ERROR(QuantizeRows(stream, t, x.untyped_data(), m.M, m.d, am + 0, s.scale + 0,
                                      Activations(s.xq, residual ? xt->untyped_data() : nullptr, gemms, m), rows,
                                      late ? observed + 0 : nullptr));
  if (residual)
    JAXMLP_RETURN_IF_ERROR(
        ZeroPaddedTail(stream, xt->untyped_data(), m.d, PaddedRows(m.M, m.E), gemms.padded_starts() + m.E));
  JAXMLP_RETURN_IF_ERROR(gemms.Run(0));  // h = x w1
  const ActParams p{Act(act), alpha, limit};
  if (late) {  // one pass: a quantized by the given amax, its own observed (two for an empty history)
    JAXMLP_RETURN_IF_ERROR(ActivationAbsMax(stream, t, p, gemms.offsets(), m.E, m.M, m.f, m.d, h->untyped_data(),
                                            DataIfPresent(b1), DataIfPresent(scales), y->untyped_data(),
                                            DataIfPresent(b2), observed + 1, given + 1, s.scale + 3, s.aq));
    JAXMLP_RETURN_IF_ERROR(ActivationQuantize(stream, t, p, gemms.offsets(), m.E, m.M, m.f, h->untyped_data(),
                                              DataIfPresent(scales), observed + 1, s.scale + 3, s.aq, given + 1,
                                              am + 3));
  } else {
    JAXMLP_RETURN_IF_ERROR(ActivationAbsMax(stream, t, p, gemms.offsets(), m.E, m.M, m.f, m.d, h->untyped_data(),
                                            DataIfPresent(b1), DataIfPresent(scales), y->untyped_data(),
                                            DataIfPresent(b2), am + 3));
    JAXMLP_RETURN_IF_ERROR(ActivationQuantize(stream, t, p, gemms.offsets(), m.E, m.M, m.f, h->untyped_data(),
                                              DataIfPresent(scales), am + 3, s.scale + 3, s.aq));
  }
  return gemms.Run(1);  // y = a w2
}

// x, w1 and w2 are the forward's copies (xt or x, w1q, w2q; see CheckFp8Copies): dy gives M and d. Without
// fp8_weight_gradients dw1 = x^T round(dh) and dw2 = round(a)^T dy are products of x.dtype (the recipe:
// jaxmlp/fp8/tensorwise.py), and a and dh are not transposed. delayed and seen: as the forward's, for dy and dh.
Error MlpFp8Backward(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer w1, AnyBuffer w2,
                     AnyBuffer group_sizes, AnyBuffer b1, AnyBuffer b2, AnyBuffer scales, AnyBuffer h, AnyBuffer dy,
                     AnyBuffer amax, AnyBuffer delayed, int32_t act, float alpha, float limit, bool fast_accumulation,
                     bool engine, bool fp8_wgrad, Result<AnyBuffer> dx, Result<AnyBuffer> dw1, Result<AnyBuffer> dw2,
                     Result<AnyBuffer> db1, Result<AnyBuffer> db2, Result<AnyBuffer> dscales, Result<AnyBuffer> seen,
                     Result<AnyBuffer> workspace) {
  ++handler_host_calls;
  const bool late = Present(delayed);
  JAXMLP_RETURN_IF_ERROR(CheckDelayed(delayed, *seen));
  MlpDims m;
  JAXMLP_RETURN_IF_ERROR(CheckMlpShapes(dy, w1, w2, group_sizes, b1, b2, scales, act, &m));
  const DataType t = h.element_type();
  JAXMLP_RETURN_IF_ERROR(CheckFp8(m, t));
  JAXMLP_RETURN_IF_ERROR(CheckFp8Copies(m, x, w1, w2, fp8_wgrad, t));
  for (const AnyBuffer* b : {&b1, &b2, &scales})
    if (b->element_type() != t) return Error::InvalidArgument("jaxmlp: b1, b2 and scales must have h's dtype");
  // h stands in for x: the gradients take h's dtype, x's in the forward.
  JAXMLP_RETURN_IF_ERROR(CheckMlpBackward(m, h, h, dy, *dx, *dw1, *dw2, *db1, *db2, *dscales));
  JAXMLP_RETURN_IF_ERROR(CheckShape("amax", amax, {4}));
  if (amax.element_type() != DataType::F32) return Error::InvalidArgument("jaxmlp: amax must be float32");
  Carver ws(workspace->untyped_data());
  GroupedGemms gemms(Fp8Path(engine), stream, device, static_cast<const int32_t*>(group_sizes.untyped_data()), m.E,
                     m.M, /*split_k=*/false, ws);
  const BackwardScratch s = CarveBackward(ws, m, int(ffi::ByteWidth(t)), fp8_wgrad, dx->untyped_data(),
                                         dw1->untyped_data(), dw2->untyped_data());
  JAXMLP_RETURN_IF_ERROR(CheckWorkspace(ws, *workspace));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*dx, &*dw1, &*dw2, &*db1, &*db2, &*dscales, &*seen, &*workspace}));
  const float* fwd = static_cast<const float*>(amax.untyped_data());  // x, w1, w2, a
  float* observed = late ? static_cast<float*>(seen->untyped_data()) : nullptr;  // dy, dh
  const float* given = late ? static_cast<const float*>(delayed.untyped_data()) : nullptr;  // dy, dh
  // (The transposed copies' padding columns, summed over, get their zeros from QuantizeRows.)
  if (late) {  // s.amax: the amaxes dy and dh are quantized by (0: their own, AbsMax's and observed's)
    JAXMLP_RETURN_IF_ERROR(CopyAmax(stream, s.amax, given, 2));
    JAXMLP_RETURN_IF_ERROR(Zero(stream, observed, 2 * sizeof(float)));
  } else {
    JAXMLP_RETURN_IF_ERROR(Zero(stream, s.amax, 2 * sizeof(float)));
  }
  JAXMLP_RETURN_IF_ERROR(ScalesOf(stream, fwd, 4, s.scale));

  float *sx = s.scale + 0, *sw1 = s.scale + 1, *sw2 = s.scale + 2, *sa = s.scale + 3, *sdy = s.scale + 4,
        *sdh = s.scale + 5;
  const bool fast = fast_accumulation;
  // The weight gradients: FP8 products of the transposed copies, or 16-bit ones of x, round(a), dy, round(dh).
  const GemmSpec dw2_spec = fp8_wgrad ? Fp8Product(GemmOp::kTNPadded, m.f, m.d, s.at, sa, s.dyt, sdy,
                                                   dw2->untyped_data(), t, fast)
                                      : GemmSpec{GemmOp::kTN, int32_t(m.f), int32_t(m.d), s.a16, dy.untyped_data(),
                                                 dw2->untyped_data(), t, t, 0.0f, false, true};
  const GemmSpec dw1_spec = fp8_wgrad ? Fp8Product(GemmOp::kTNPadded, m.d, m.F1, x.untyped_data(), sx, s.dht, sdh,
                                                   dw1->untyped_data(), t, fast)
                                      : GemmSpec{GemmOp::kTN, int32_t(m.d), int32_t(m.F1), x.untyped_data(), s.dh,
                                                 dw1->untyped_data(), t, t, 0.0f, true, false};
  JAXMLP_RETURN_IF_ERROR(gemms.Prepare({
      Fp8Product(GemmOp::kNT, m.f, m.d, s.dyq, sdy, w2.untyped_data(), sw2, s.da, t, fast),                 // da
      dw2_spec,
      Fp8Product(GemmOp::kNT, m.d, m.F1, s.dhq, sdh, w1.untyped_data(), sw1, dx->untyped_data(), t, fast),  // dx
      dw1_spec,
  }));
  JAXMLP_RETURN_IF_ERROR(AbsMax(stream, t, dy.untyped_data(), gemms.offsets(), m.E, m.M, m.d, s.amax + 0, {},
                                late ? given + 0 : nullptr));
  JAXMLP_RETURN_IF_ERROR(QuantizeRows(stream, t, dy.untyped_data(), m.M, m.d, s.amax + 0, sdy,
                                      Activations(s.dyq, s.dyt, gemms, m), {}, late ? observed + 0 : nullptr));
  JAXMLP_RETURN_IF_ERROR(gemms.Run(0));  // da = dy w2^T
  const ActParams p{Act(act), alpha, limit};
  void* ds = m.has_scales ? dscales->untyped_data() : nullptr;
  if (fp8_wgrad) {
    // a's transposed copy, the scale gradients' parts and dh's amax; with a positive history (delayed
    // scaling) dh's outputs by it, else a second launch quantizes dh by the amax observed. No pass transposes
    // a or dh after.
    Fp8ActTiles first;
    first.layout = Activations(nullptr, nullptr, gemms, m);
    first.at = s.at, first.ds_parts = s.ds_parts, first.observed = late ? observed + 1 : s.amax + 1;
    if (late) first.dh_amax = given + 1, first.dh_if_positive = true;
    first.scale_dh = sdh, first.dhq = s.dhq, first.dht = s.dht, first.dh = s.dh;
    Fp8ActTiles second = first;
    second.at = nullptr, second.ds_parts = nullptr, second.observed = nullptr;
    second.dh_amax = first.observed, second.dh_if_positive = false, second.skip = late ? given + 1 : nullptr;
    for (const Fp8ActTiles* o : {&first, &second})
      JAXMLP_RETURN_IF_ERROR(ActivationBackwardTiles(stream, device, t, p, m.M, m.f, h.untyped_data(), s.da,
                                                     DataIfPresent(scales), fwd + 3, *o));
    JAXMLP_RETURN_IF_ERROR(ActivationBackwardRows(stream, t, gemms.offsets(), m.E, m.M, m.f, m.d, s.ds_parts,
                                                  dy.untyped_data(), DataIfPresent(b2), ds, dx->untyped_data()));
  } else {
    // Delayed scaling: one pass, dh quantized by the given amax, its own observed (and a second pass by that
    // for an empty history: ActivationBackwardQuantize returns at once otherwise).
    JAXMLP_RETURN_IF_ERROR(ActivationBackwardAbsMax(
        stream, t, p, gemms.offsets(), m.E, m.M, m.f, m.d, h.untyped_data(), s.da, DataIfPresent(scales),
        dy.untyped_data(), DataIfPresent(b2), s.a16, ds, dx->untyped_data(), late ? observed + 1 : s.amax + 1,
        late ? given + 1 : nullptr, late ? sdh : nullptr, late ? s.dhq : nullptr, late ? s.dh : nullptr));
    JAXMLP_RETURN_IF_ERROR(ActivationBackwardQuantize(stream, t, p, gemms.offsets(), m.E, m.M, m.f,
                                                      h.untyped_data(), s.da, DataIfPresent(scales),
                                                      late ? observed + 1 : s.amax + 1, sdh, s.dhq, s.dh,
                                                      late ? given + 1 : nullptr));
  }
  // RunIndependent's promise: none of its products reads another's output. dx (2) and dw2 (1) read dhq, w1,
  // at or a16 and dyt or dy, and write dx and dw2 (what lived in dx, dyq, is dead by now). dw1's
  // product (3) comes after them, on its own: it overwrites what they read (CarveBackward). That costs
  // nothing: the FP8 paths enqueue a list's products one by one, in order, anyway.
  JAXMLP_RETURN_IF_ERROR(gemms.RunIndependent({2, 1}));
  JAXMLP_RETURN_IF_ERROR(gemms.Run(3));  // dw1 = x^T dh, reading xt or x and dht or dh
  JAXMLP_RETURN_IF_ERROR(gemms.ZeroEmptyGroups({1, 3}));
  return BiasGradients(stream, t, gemms.offsets(), m, s.dh, dy.untyped_data(), DataIfPresent(scales), s.bias_partials,
                       db1->untyped_data(), db2->untyped_data());
}

}  // namespace

size_t MlpFp8WorkspaceBytes(bool forward, bool engine, bool fp8_wgrad, const MlpDims& m, int esize) {
  Carver c(nullptr);
  GroupedGemms counted(Fp8Path(engine), nullptr, 0, nullptr, m.E, m.M, /*split_k=*/false, c);
  if (forward) CarveForward(c, m, nullptr);
  else CarveBackward(c, m, esize, fp8_wgrad, nullptr, nullptr, nullptr);
  return c.used();
}

}  // namespace jaxmlp

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8TensorWeights, jaxmlp::Fp8TensorWeights,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // w
                                  .Ret<xla::ffi::AnyBuffer>()   // q
                                  .Ret<xla::ffi::AnyBuffer>()   // amax
                                  .Ret<xla::ffi::AnyBuffer>(),  // qt
                              jaxmlp::kGraphSafe);

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpFp8Forward, jaxmlp::MlpFp8Forward,
                              jaxmlp::BindActivationAttrs(jaxmlp::BindMlpOperands(jaxmlp::BindStreamAndDevice())
                                                              // (w1, w2: the e4m3 weights as they lie)
                                                              .Arg<xla::ffi::AnyBuffer>()   // w1t
                                                              .Arg<xla::ffi::AnyBuffer>()   // w2t
                                                              .Arg<xla::ffi::AnyBuffer>()   // weight_amax
                                                              .Arg<xla::ffi::AnyBuffer>()   // slot_of_row, or absent
                                                              .Arg<xla::ffi::AnyBuffer>())  // delayed, or absent
                                  .Attr<bool>("fast_accumulation")
                                  .Attr<bool>("engine")
                                  .Attr<int32_t>("top_k")
                                  .Ret<xla::ffi::AnyBuffer>()   // y
                                  .Ret<xla::ffi::AnyBuffer>()   // h
                                  .Ret<xla::ffi::AnyBuffer>()   // amax: x, w1, w2, a
                                  .Ret<xla::ffi::AnyBuffer>()   // xt, or absent
                                  .Ret<xla::ffi::AnyBuffer>()   // seen, or absent
                                  .Ret<xla::ffi::AnyBuffer>(),  // workspace
                              jaxmlp::kGraphSafe);

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlpFp8Backward, jaxmlp::MlpFp8Backward,
                              jaxmlp::BindActivationAttrs(jaxmlp::BindMlpOperands(jaxmlp::BindStreamAndDevice())
                                                              // (x, w1, w2: the forward's xt, w1q, w2q)
                                                              .Arg<xla::ffi::AnyBuffer>()   // h
                                                              .Arg<xla::ffi::AnyBuffer>()   // dy
                                                              .Arg<xla::ffi::AnyBuffer>()   // amax of the forward
                                                              .Arg<xla::ffi::AnyBuffer>())  // delayed, or absent
                                  .Attr<bool>("fast_accumulation")
                                  .Attr<bool>("engine")
                                  .Attr<bool>("fp8_weight_gradients")
                                  .Ret<xla::ffi::AnyBuffer>()                               // dx
                                  .Ret<xla::ffi::AnyBuffer>()                               // dw1
                                  .Ret<xla::ffi::AnyBuffer>()                               // dw2
                                  .Ret<xla::ffi::AnyBuffer>()                               // db1
                                  .Ret<xla::ffi::AnyBuffer>()                               // db2
                                  .Ret<xla::ffi::AnyBuffer>()                               // dscales
                                  .Ret<xla::ffi::AnyBuffer>()                               // seen, or absent
                                  .Ret<xla::ffi::AnyBuffer>(),                              // workspace
                              jaxmlp::kGraphSafe);
