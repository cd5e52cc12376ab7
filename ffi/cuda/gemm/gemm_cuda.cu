// CUDA handler: the grouped GEMM behind jaxmlp.ragged_dot, one product per call. It is registered once per
// GEMM path (grouped_gemm.h): the cuBLASLt grouped, CUTLASS, fused and tiled paths never sync, so their
// handlers are declared command-buffer compatible; the cublasGemmGroupedBatchedEx fallback syncs once per call.
#include <cuda_runtime.h>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/handler.h"
#include "gemm_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {
namespace {

using ffi::AnyBuffer;
using ffi::Error;
using ffi::Result;

template <GemmPath kPath>
Error Gemm(cudaStream_t stream, int32_t device, AnyBuffer lhs, AnyBuffer rhs, AnyBuffer group_sizes, int32_t op,
           Result<AnyBuffer> out, Result<AnyBuffer> workspace) {
  ++handler_host_calls;
  GemmDims g;
  const GemmOp gop = static_cast<GemmOp>(op);
  JAXMLP_RETURN_IF_ERROR(CheckGemm(gop, lhs, rhs, group_sizes, *out, &g));
  Carver ws(workspace->untyped_data());
  GroupedGemms gemms(kPath, stream, device, static_cast<const int32_t*>(group_sizes.untyped_data()), g.E, g.M,
                     /*split_k=*/false, ws);  // one launch: nothing to split (see RunTiledGemms)
  JAXMLP_RETURN_IF_ERROR(CheckWorkspace(ws, *workspace));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*out, &*workspace}));
  JAXMLP_RETURN_IF_ERROR(gemms.Prepare({{gop, int32_t(g.K), int32_t(g.N), lhs.untyped_data(), rhs.untyped_data(),
                                         out->untyped_data(), lhs.element_type(), out->element_type(), 0.0f,
                                         true, true}}));
  JAXMLP_RETURN_IF_ERROR(gemms.Run(0));
  return gop == GemmOp::kTN ? gemms.ZeroEmptyGroups({0}) : gemms.ZeroPaddingRows(0);
}

auto BindGemm() {
  return BindStreamAndDevice()
      .Arg<AnyBuffer>()  // lhs
      .Arg<AnyBuffer>()  // rhs
      .Arg<AnyBuffer>()  // group_sizes
      .Attr<int32_t>("op")
      .Ret<AnyBuffer>()   // out
      .Ret<AnyBuffer>();  // workspace
}

}  // namespace
}  // namespace jaxmlp

using jaxmlp::GemmPath;
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmGrouped, jaxmlp::Gemm<GemmPath::kGrouped>, jaxmlp::BindGemm(), jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmFallback, jaxmlp::Gemm<GemmPath::kFallback>, jaxmlp::BindGemm());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmTiled, jaxmlp::Gemm<GemmPath::kTiled>, jaxmlp::BindGemm(), jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCutlass, jaxmlp::Gemm<GemmPath::kCutlass>, jaxmlp::BindGemm(), jaxmlp::kGraphSafe);
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmFused, jaxmlp::Gemm<GemmPath::kFused>, jaxmlp::BindGemm(), jaxmlp::kGraphSafe);
