// CUDA handlers of the blockwise recipe's quantizers (jaxmlp/fp8/blockwise.py defines them, and its JAX code
// is the CPU's; the kernels and the layouts they write: fp8_block_quantize_kernels.h):
//   rows_and_columns  v [M, C], first [B], count [B] -> q, e, qt, ec (RowsAndColumns; qt and ec absent:
//            the rows only)
//   activation  h [M, F1], da [M, f] (optional), scales [M] (optional), first, count -> the same of
//            a = act(h) * scales [M, f] (da absent: the forward) or of dh = da * scales * act'(h) [M, F1],
//            and values (optional): a or dh in h's dtype
//   weights  w [E, K, N] (float32 master weights too), rounded to the attribute dtype -> q [E, K, N],
//            qt [E, N, K], e [E, ceil(K / 128), ceil(N / 128)]  128 x 128 blocks
#include <cuda_runtime.h>

#include "codes.h"
#include "cuda/fp8/fp8_block_quantize_kernels.h"
#include "cuda/fp8/weight_checks.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/handler.h"
#include "mlp_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Error;
using ffi::Result;

// The column blocks' (first, count) of Fp8BlockRowsAndColumns: int32 [B] each.
Error CheckColumnBlocks(const AnyBuffer& first, const AnyBuffer& count, int64_t* B) {
  if (first.dimensions().size() != 1 || first.element_type() != DataType::S32)
    return Error::InvalidArgument("jaxmlp: first must be a 1-D int32 array");
  *B = first.dimensions()[0];
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("count", count, {*B}, DataType::S32, "dtype int32"));
  if (*B * kScaleBlock > INT32_MAX) return Error::InvalidArgument("jaxmlp: 128 x 1 blocks of more than 2^31 rows");
  return Error::Success();
}

// The outputs of a rows-and-columns quantization of [M, C] in B column blocks, checked and poisoned: qt and
// ec both present or both absent (the rows only); values (16-bit, [M, C]) null or absent where not asked.
struct RowsAndColumnsBuffers {
  int64_t M, C, B;
  const AnyBuffer *first, *count;
  AnyBuffer *q, *e, *qt, *ec, *values = nullptr;
  bool columns() const { return Present(*qt); }
  bool has_values() const { return values && Present(*values); }
};

// Their data, for the kernels.
RowsAndColumns Pointers(const RowsAndColumnsBuffers& o) {
  return {o.M, o.C, o.B, static_cast<const int32_t*>(o.first->untyped_data()),
          static_cast<const int32_t*>(o.count->untyped_data()),
          static_cast<uint8_t*>(o.q->untyped_data()), static_cast<int32_t*>(o.e->untyped_data()),
          static_cast<uint8_t*>(DataIfPresent(*o.qt)), static_cast<int32_t*>(DataIfPresent(*o.ec)),
          o.has_values() ? o.values->untyped_data() : nullptr};
}

Error CheckRowsAndColumns(cudaStream_t stream, const RowsAndColumnsBuffers& o, DataType values_type) {
  JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("q", *o.q, {o.M, o.C}));
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("e", *o.e, {o.M, ScaleBlocks(o.C)}, DataType::S32, "dtype int32"));
  if (o.columns() != Present(*o.ec)) return Error::InvalidArgument("jaxmlp: qt and ec must both be present or absent");
  if (o.columns()) {
    JAXMLP_RETURN_IF_ERROR(CheckFp8Buffer("qt", *o.qt, {o.C, o.B * kScaleBlock}));
    JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("ec", *o.ec, {o.B, o.C}, DataType::S32, "dtype int32"));
  }
  if (o.has_values()) JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("values", *o.values, {o.M, o.C}, values_type, "h's dtype"));
  if (o.B * ScaleBlocks(o.C) > INT32_MAX)
    return Error::InvalidArgument("jaxmlp: too many 128 x 128 blocks for one grid");
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {o.q, o.e, o.qt, o.ec}));  // an absent one: a scalar, harmless
  return o.has_values() ? Poison(stream, {o.values}) : Error::Success();
}

Error Fp8BlockRowsAndColumns(cudaStream_t stream, int32_t device, AnyBuffer v, AnyBuffer first, AnyBuffer count,
                             Result<AnyBuffer> q, Result<AnyBuffer> e, Result<AnyBuffer> qt, Result<AnyBuffer> ec) {
  ++handler_host_calls;
  JAXMLP_RETURN_IF_ERROR(CheckQuantizerInput("v", v, 2));
  RowsAndColumnsBuffers o{v.dimensions()[0], v.dimensions()[1], 0, &first, &count, &*q, &*e, &*qt, &*ec};
  JAXMLP_RETURN_IF_ERROR(CheckColumnBlocks(first, count, &o.B));
  JAXMLP_RETURN_IF_ERROR(CheckRowsAndColumns(stream, o, v.element_type()));
  return QuantizeRowsAndColumns(stream, device, v.element_type(), v.untyped_data(), Pointers(o));
}

// h [M, F1] and the optional da [M, f] and scales [M] (absent: a scalar) in one 16-bit dtype; the result
// is a [M, f] without da, dh [M, F1] with it.
Error Fp8BlockActivation(cudaStream_t stream, int32_t device, AnyBuffer h, AnyBuffer da, AnyBuffer scales,
                         AnyBuffer first, AnyBuffer count, int32_t act, float alpha, float limit,
                         Result<AnyBuffer> q, Result<AnyBuffer> e, Result<AnyBuffer> qt, Result<AnyBuffer> ec,
                         Result<AnyBuffer> values) {
  ++handler_host_calls;
  JAXMLP_RETURN_IF_ERROR(CheckQuantizerInput("h", h, 2));
  const DataType t = h.element_type();
  if (t == DataType::F32) return Error::InvalidArgument("jaxmlp: h must be bfloat16 or float16");
  if (act < 0 || act >= int32_t(Act::kCount)) return Error::InvalidArgument("jaxmlp: unknown activation");
  const ActParams p{Act(act), alpha, limit};
  const int64_t M = h.dimensions()[0], F1 = h.dimensions()[1], f = IsGated(p.act) ? F1 / 2 : F1;
  if (f % 16 || (IsGated(p.act) && F1 != 2 * f))
    return Error::InvalidArgument("jaxmlp: h must be [M, F1] with F1 = 2 f (gated) or f, f a multiple of 16");
  if (Present(da)) JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("da", da, {M, f}, t, "h's dtype"));
  if (Present(scales)) JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("scales", scales, {M}, t, "h's dtype"));
  RowsAndColumnsBuffers o{M, Present(da) ? F1 : f, 0, &first, &count, &*q, &*e, &*qt, &*ec, &*values};
  JAXMLP_RETURN_IF_ERROR(CheckColumnBlocks(first, count, &o.B));
  JAXMLP_RETURN_IF_ERROR(CheckRowsAndColumns(stream, o, t));
  return QuantizeActivationRowsAndColumns(stream, device, t, p, h.untyped_data(), DataIfPresent(da),
                                          DataIfPresent(scales), f, Pointers(o));
}

Error Fp8BlockWeights(cudaStream_t stream, AnyBuffer w, Result<AnyBuffer> q, Result<AnyBuffer> qt,
                      Result<AnyBuffer> e, int32_t dtype) {
  ++handler_host_calls;
  JAXMLP_RETURN_IF_ERROR(CheckQuantizerInput("w", w, 3));
  DataType rounded;
  JAXMLP_RETURN_IF_ERROR(RoundedType(dtype, &rounded));
  const int64_t E = w.dimensions()[0], K = w.dimensions()[1], N = w.dimensions()[2];
  JAXMLP_RETURN_IF_ERROR(CheckWeightOutputs(E, K, N, *q, *qt, *e));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*q, &*qt, &*e}));
  return QuantizeWeightBlocks(stream, w.element_type(), rounded, w.untyped_data(), E, K, N,
                              static_cast<uint8_t*>(q->untyped_data()), static_cast<uint8_t*>(qt->untyped_data()),
                              static_cast<int32_t*>(e->untyped_data()));
}

}  // namespace
}  // namespace jaxmlp

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8BlockRowsAndColumns, jaxmlp::Fp8BlockRowsAndColumns,
                              jaxmlp::BindStreamAndDevice()
                                  .Arg<xla::ffi::AnyBuffer>()   // v
                                  .Arg<xla::ffi::AnyBuffer>()   // first
                                  .Arg<xla::ffi::AnyBuffer>()   // count
                                  .Ret<xla::ffi::AnyBuffer>()   // q
                                  .Ret<xla::ffi::AnyBuffer>()   // e
                                  .Ret<xla::ffi::AnyBuffer>()   // qt (optional)
                                  .Ret<xla::ffi::AnyBuffer>(),  // ec (optional)
                              jaxmlp::kGraphSafe);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8BlockActivation, jaxmlp::Fp8BlockActivation,
                              jaxmlp::BindActivationAttrs(jaxmlp::BindStreamAndDevice()
                                                              .Arg<xla::ffi::AnyBuffer>()   // h
                                                              .Arg<xla::ffi::AnyBuffer>()   // da (optional)
                                                              .Arg<xla::ffi::AnyBuffer>()   // scales (optional)
                                                              .Arg<xla::ffi::AnyBuffer>()   // first
                                                              .Arg<xla::ffi::AnyBuffer>())  // count
                                  .Ret<xla::ffi::AnyBuffer>()   // q
                                  .Ret<xla::ffi::AnyBuffer>()   // e
                                  .Ret<xla::ffi::AnyBuffer>()   // qt (optional)
                                  .Ret<xla::ffi::AnyBuffer>()   // ec (optional)
                                  .Ret<xla::ffi::AnyBuffer>(),  // values (optional)
                              jaxmlp::kGraphSafe);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8BlockWeights, jaxmlp::Fp8BlockWeights,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // w
                                  .Ret<xla::ffi::AnyBuffer>()   // q
                                  .Ret<xla::ffi::AnyBuffer>()   // qt
                                  .Ret<xla::ffi::AnyBuffer>()   // e
                                  .Attr<int32_t>("dtype"),
                              jaxmlp::kGraphSafe);

