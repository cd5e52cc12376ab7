// CUDA handler: the router's top-k selection per row (the kernel: top_k_kernels.h). No sync, no
// allocation: command-buffer compatible.
#include <cuda_runtime.h>

#include "cuda/handler.h"
#include "cuda/moe/top_k_kernels.h"
#include "top_k.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {
namespace {

using ffi::AnyBuffer;
using ffi::Error;
using ffi::Result;

Error TopK(cudaStream_t stream, AnyBuffer scores, Result<AnyBuffer> values, Result<AnyBuffer> indices) {
  ++handler_host_calls;
  TopKDims m;
  JAXMLP_RETURN_IF_ERROR(CheckTopK(scores, *values, *indices, &m));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*values, &*indices}));
  return TopKRows(stream, static_cast<const float*>(scores.untyped_data()), m.T, m.E, m.k,
                  static_cast<float*>(values->untyped_data()), static_cast<int32_t*>(indices->untyped_data()));
}

}  // namespace
}  // namespace jaxmlp

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopKCuda, jaxmlp::TopK,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // scores
                                  .Ret<xla::ffi::AnyBuffer>()   // values
                                  .Ret<xla::ffi::AnyBuffer>(),  // indices
                              jaxmlp::kGraphSafe);
