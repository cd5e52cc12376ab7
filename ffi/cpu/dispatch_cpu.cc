// CPU handlers: the MoE dispatch (a stable counting sort of the routing choices by expert, and the row
// gather) and the combine, forward and backward. Semantics: jaxmlp/reference_moe.py.
#include <cstdint>
#include <cstring>
#include <vector>

#include "dispatch_checks.h"
#include "cpu/buffers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {
namespace {

using ffi::Error;
using ffi::Result;

Error Dispatch(AnyBuffer x, AnyBuffer experts, int64_t num_experts, int64_t capacity, int64_t pad_to,
               Result<AnyBuffer> rows, Result<AnyBuffer> group_sizes, Result<AnyBuffer> counts,
               Result<AnyBuffer> row_of_slot, Result<AnyBuffer> slot_of_row) {
  DispatchDims m;
  JAXMLP_RETURN_IF_ERROR(CheckDispatch(x, experts, num_experts, capacity, pad_to, *rows, *group_sizes, *counts,
                                       *row_of_slot, *slot_of_row, &m));
  Poison({&*rows, &*group_sizes, &*counts, &*row_of_slot, &*slot_of_row});
  const int32_t* ids = static_cast<const int32_t*>(experts.untyped_data());
  auto* sizes = static_cast<int32_t*>(group_sizes->untyped_data());
  auto* count = static_cast<int32_t*>(counts->untyped_data());
  auto* row_of = static_cast<int32_t*>(row_of_slot->untyped_data());
  auto* slot_of = static_cast<int32_t*>(slot_of_row->untyped_data());
  const int64_t cap = m.capacity < 0 ? INT64_MAX : m.capacity;
  auto valid = [&](int32_t e) { return e >= 0 && e < m.E; };

  // Counting sort, in priority order: choice-major, then token order.
  std::vector<int64_t> offset(m.E + 1, 0);
  std::fill(count, count + m.E, 0);
  for (int64_t s = 0; s < m.T * m.k; ++s)
    if (valid(ids[s])) ++count[ids[s]];
  for (int64_t e = 0; e < m.E; ++e) {
    const int64_t kept = std::min<int64_t>(count[e], cap);
    sizes[e] = int32_t((kept + m.pad_to - 1) / m.pad_to * m.pad_to);
    offset[e + 1] = offset[e] + sizes[e];
  }
  std::fill(slot_of, slot_of + m.R, -1);
  std::vector<int64_t> rank(m.E, 0);
  for (int64_t j = 0; j < m.k; ++j)
    for (int64_t t = 0; t < m.T; ++t) {
      const int64_t s = t * m.k + j;
      const int32_t e = ids[s];
      row_of[s] = -1;
      if (!valid(e) || rank[e] >= cap) continue;
      const int64_t r = offset[e] + rank[e]++;
      if (r >= m.R) continue;  // never with R checked (CheckDispatch), but no data may make this write out of bounds
      row_of[s] = int32_t(r);
      slot_of[r] = int32_t(s);
    }

  const size_t row_bytes = m.d * ffi::ByteWidth(x.element_type());
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(rows->untyped_data());
  for (int64_t r = 0; r < m.R; ++r) {
    if (slot_of[r] >= 0)
      std::memcpy(dst + r * row_bytes, src + (slot_of[r] / m.k) * row_bytes, row_bytes);
    else
      std::memset(dst + r * row_bytes, 0, row_bytes);  // 0 is +0.0 in every float dtype
  }
  return Error::Success();
}

// A row index from the plan, or -1 where it holds none in [0, R).
int64_t RowOrNone(int32_t r, int64_t R) { return r >= 0 && r < R ? r : -1; }

Error Combine(AnyBuffer rows, AnyBuffer row_of_slot, AnyBuffer weights, Result<AnyBuffer> y) {
  CombineDims m;
  JAXMLP_RETURN_IF_ERROR(CheckCombine(rows, row_of_slot, weights, *y, &m));
  Poison({&*y});
  const std::vector<float> V = ToFloat(rows), W = ToFloat(weights);
  const int32_t* row_of = static_cast<const int32_t*>(row_of_slot.untyped_data());
  std::vector<float> Y(m.T * m.d, 0.0f);
  for (int64_t t = 0; t < m.T; ++t)
    for (int64_t j = 0; j < m.k; ++j) {  // in choice order: the CUDA kernel's order
      const int64_t r = RowOrNone(row_of[t * m.k + j], m.R);
      if (r < 0) continue;
      const float w = m.weighted ? W[t * m.k + j] : 1.0f;
      for (int64_t c = 0; c < m.d; ++c) Y[t * m.d + c] += w * V[r * m.d + c];
    }
  Store(Y, *y);
  return Error::Success();
}

Error CombineBackward(AnyBuffer dy, AnyBuffer rows, AnyBuffer row_of_slot, AnyBuffer slot_of_row, AnyBuffer weights,
                      Result<AnyBuffer> drows, Result<AnyBuffer> dweights) {
  CombineDims m;
  JAXMLP_RETURN_IF_ERROR(CheckCombineBackward(dy, rows, row_of_slot, slot_of_row, weights, *drows, *dweights, &m));
  Poison({&*drows, &*dweights});
  const std::vector<float> dY = ToFloat(dy), V = ToFloat(rows), W = ToFloat(weights);
  const int32_t* row_of = static_cast<const int32_t*>(row_of_slot.untyped_data());
  const int32_t* slot_of = static_cast<const int32_t*>(slot_of_row.untyped_data());
  std::vector<float> dR(m.R * m.d, 0.0f);
  for (int64_t r = 0; r < m.R; ++r) {
    const int64_t s = slot_of[r];
    if (s < 0 || s >= m.T * m.k) continue;  // a padding row
    const float w = m.weighted ? W[s] : 1.0f;
    for (int64_t c = 0; c < m.d; ++c) dR[r * m.d + c] = w * dY[(s / m.k) * m.d + c];
  }
  Store(dR, *drows);
  if (m.weighted) {
    std::vector<float> dW(m.T * m.k, 0.0f);
    for (int64_t s = 0; s < m.T * m.k; ++s) {
      const int64_t r = RowOrNone(row_of[s], m.R);
      if (r < 0) continue;
      float acc = 0.0f;
      for (int64_t c = 0; c < m.d; ++c) acc += dY[(s / m.k) * m.d + c] * V[r * m.d + c];
      dW[s] = acc;
    }
    Store(dW, *dweights);
  }
  return Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchCpu, Dispatch,
                              ffi::Ffi::Bind()
                                  .Arg<AnyBuffer>()  // x
                                  .Arg<AnyBuffer>()  // experts
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("pad_to")
                                  .Ret<AnyBuffer>()    // rows
                                  .Ret<AnyBuffer>()    // group_sizes
                                  .Ret<AnyBuffer>()    // counts
                                  .Ret<AnyBuffer>()    // row_of_slot
                                  .Ret<AnyBuffer>());  // slot_of_row

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineCpu, Combine,
                              ffi::Ffi::Bind()
                                  .Arg<AnyBuffer>()    // rows
                                  .Arg<AnyBuffer>()    // row_of_slot
                                  .Arg<AnyBuffer>()    // weights
                                  .Ret<AnyBuffer>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineBackwardCpu, CombineBackward,
                              ffi::Ffi::Bind()
                                  .Arg<AnyBuffer>()    // dy
                                  .Arg<AnyBuffer>()    // rows
                                  .Arg<AnyBuffer>()    // row_of_slot
                                  .Arg<AnyBuffer>()    // slot_of_row
                                  .Arg<AnyBuffer>()    // weights
                                  .Ret<AnyBuffer>()    // drows
                                  .Ret<AnyBuffer>());  // dweights

}  // namespace jaxmlp
