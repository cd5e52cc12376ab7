// CUDA handlers: the MoE dispatch (counting sort and row gather, one custom call) and the combine, forward
// and backward. None syncs or allocates, so all are declared command-buffer compatible.
#include <cuda_runtime.h>


#include "dispatch_checks.h"
#include "cuda/moe/dispatch_kernels.h"
#include "cuda/handler.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

namespace {

using ffi::AnyBuffer;
using ffi::Error;
using ffi::Result;

template <typename P>
P* As(AnyBuffer b) {
  return b.element_count() ? static_cast<P*>(b.untyped_data()) : nullptr;
}

Error Dispatch(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer experts, int64_t num_experts,
               int64_t capacity, int64_t pad_to, int32_t zero_padding, Result<AnyBuffer> rows,
               Result<AnyBuffer> group_sizes, Result<AnyBuffer> counts, Result<AnyBuffer> row_of_slot,
               Result<AnyBuffer> slot_of_row, Result<AnyBuffer> workspace) {
  ++handler_host_calls;
  DispatchDims m;
  JAXMLP_RETURN_IF_ERROR(CheckDispatch(x, experts, num_experts, capacity, pad_to, *rows, *group_sizes, *counts,
                                       *row_of_slot, *slot_of_row, &m));
  if (workspace->size_bytes() < DispatchWorkspaceBytes(m.T * m.k, m.E))
    return Error::InvalidArgument("jaxmlp: dispatch's workspace is too small");
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*rows, &*group_sizes, &*counts, &*row_of_slot, &*slot_of_row, &*workspace}));
  JAXMLP_RETURN_IF_ERROR(DispatchPlan(stream, device, As<int32_t>(experts), m.T, m.k, m.E, m.capacity, m.pad_to, m.R,
                                      As<int32_t>(*group_sizes), As<int32_t>(*counts), As<int32_t>(*row_of_slot),
                                      As<int32_t>(*slot_of_row), workspace->untyped_data()));
  return GatherRows(stream, device, x.element_type(), x.untyped_data(), m.T, m.k, m.d, As<int32_t>(*row_of_slot),
                    As<int32_t>(*slot_of_row), m.R, rows->untyped_data(), zero_padding != 0);
}

Error Combine(cudaStream_t stream, int32_t device, AnyBuffer rows, AnyBuffer row_of_slot, AnyBuffer weights,
              Result<AnyBuffer> y) {
  ++handler_host_calls;
  CombineDims m;
  JAXMLP_RETURN_IF_ERROR(CheckCombine(rows, row_of_slot, weights, *y, &m));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*y}));
  return CombineRows(stream, device, rows.element_type(), rows.untyped_data(), m.R, m.d, As<int32_t>(row_of_slot),
                     m.weighted ? As<float>(weights) : nullptr, m.T, m.k, y->untyped_data());
}

Error CombineBackward(cudaStream_t stream, int32_t device, AnyBuffer dy, AnyBuffer rows, AnyBuffer row_of_slot,
                      AnyBuffer slot_of_row, AnyBuffer weights, int32_t zero_padding, Result<AnyBuffer> drows,
                      Result<AnyBuffer> dweights) {
  ++handler_host_calls;
  CombineDims m;
  JAXMLP_RETURN_IF_ERROR(CheckCombineBackward(dy, rows, row_of_slot, slot_of_row, weights, *drows, *dweights, &m));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*drows, &*dweights}));
  return CombineBackwardRows(stream, device, dy.element_type(), dy.untyped_data(),
                             m.weighted ? rows.untyped_data() : nullptr, As<int32_t>(row_of_slot),
                             As<int32_t>(slot_of_row), m.weighted ? As<float>(weights) : nullptr, m.T, m.k, m.R, m.d,
                             drows->untyped_data(), m.weighted ? As<float>(*dweights) : nullptr, zero_padding != 0);
}

}  // namespace
}  // namespace jaxmlp

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchCuda, jaxmlp::Dispatch,
                              jaxmlp::BindStreamAndDevice()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // experts
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("pad_to")
                                  .Attr<int32_t>("zero_padding")  // 0 or 1 (jaxmlp/dispatch.py)
                                  .Ret<xla::ffi::AnyBuffer>()   // rows
                                  .Ret<xla::ffi::AnyBuffer>()   // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>()   // counts
                                  .Ret<xla::ffi::AnyBuffer>()   // row_of_slot
                                  .Ret<xla::ffi::AnyBuffer>()   // slot_of_row
                                  .Ret<xla::ffi::AnyBuffer>(),  // workspace
                              jaxmlp::kGraphSafe);

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineCuda, jaxmlp::Combine,
                              jaxmlp::BindStreamAndDevice()
                                  .Arg<xla::ffi::AnyBuffer>()   // rows
                                  .Arg<xla::ffi::AnyBuffer>()   // row_of_slot
                                  .Arg<xla::ffi::AnyBuffer>()   // weights
                                  .Ret<xla::ffi::AnyBuffer>(),  // y
                              jaxmlp::kGraphSafe);

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineBackwardCuda, jaxmlp::CombineBackward,
                              jaxmlp::BindStreamAndDevice()
                                  .Arg<xla::ffi::AnyBuffer>()   // dy
                                  .Arg<xla::ffi::AnyBuffer>()   // rows
                                  .Arg<xla::ffi::AnyBuffer>()   // row_of_slot
                                  .Arg<xla::ffi::AnyBuffer>()   // slot_of_row
                                  .Arg<xla::ffi::AnyBuffer>()   // weights
                                  .Attr<int32_t>("zero_padding")  // 0 or 1 (jaxmlp/dispatch.py)
                                  .Ret<xla::ffi::AnyBuffer>()   // drows
                                  .Ret<xla::ffi::AnyBuffer>(),  // dweights
                              jaxmlp::kGraphSafe);
