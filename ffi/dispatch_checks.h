// Shape validation of the dispatch and combine calls, shared by the CPU and CUDA handlers (jaxmlp/dispatch.py
// validates the same at trace time with clearer messages). Semantics: jaxmlp/reference_moe.py.
//
// Device data (expert ids, the plan's row and slot indices) is never trusted: the handlers drop an expert id
// outside [0, E), and treat a row index outside [0, R) or a slot index outside [0, T*k) as "none".
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "checks.h"

namespace jaxmlp {

struct DispatchDims {
  int64_t T, d, k, E, R;
  int64_t capacity;  // < 0: unlimited
  int64_t pad_to;
};

// The rows the choices need at most: every kept choice, plus each group's padding (reference_moe.num_rows).
// The capacity (an attribute: any int64 a direct caller passes) is clamped to T * k before the product,
// which would overflow for a huge one and let too few rows pass; with the extents checked (each below 2^31,
// pad_to at most 4096), no term overflows.
inline int64_t DispatchRowBound(const DispatchDims& m) {
  const int64_t choices = m.T * m.k;
  const int64_t kept = m.capacity < 0 ? choices : std::min(choices, m.E * std::min(m.capacity, choices));
  return kept + m.E * (m.pad_to - 1);
}

// x [T, d], experts [T, k] int32 -> rows [R, d] (x's dtype), group_sizes [E], counts [E], row_of_slot [T, k],
// slot_of_row [R] (all int32). R must hold every kept choice and its group's padding.
inline ffi::Error CheckDispatch(const ffi::AnyBuffer& x, const ffi::AnyBuffer& experts, int64_t num_experts,
                                int64_t capacity, int64_t pad_to, const ffi::AnyBuffer& rows,
                                const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& counts,
                                const ffi::AnyBuffer& row_of_slot, const ffi::AnyBuffer& slot_of_row,
                                DispatchDims* out) {
  if (x.dimensions().size() != 2 || experts.dimensions().size() != 2 || rows.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxmlp: dispatch expects x [T, d], experts [T, k] and rows [R, d], got " +
                                       Dims(x.dimensions()) + ", " + Dims(experts.dimensions()) + ", " +
                                       Dims(rows.dimensions()));
  if (!IsFloat(x.element_type()) || rows.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("jaxmlp: dispatch's x and rows must share one float dtype");
  for (const ffi::AnyBuffer* b : {&experts, &group_sizes, &counts, &row_of_slot, &slot_of_row})
    if (b->element_type() != ffi::DataType::S32)
      return ffi::Error::InvalidArgument("jaxmlp: dispatch's experts, group_sizes, counts, row_of_slot and "
                                         "slot_of_row must be int32");
  DispatchDims m{x.dimensions()[0], x.dimensions()[1], experts.dimensions()[1], num_experts,
                 rows.dimensions()[0], capacity, pad_to};
  JAXMLP_RETURN_IF_ERROR(CheckShape("experts", experts, {m.T, m.k}));
  JAXMLP_RETURN_IF_ERROR(CheckExtents({m.T, m.d, m.k, m.E, m.R, m.pad_to, m.T * m.k}));
  if (m.pad_to > 4096) return ffi::Error::InvalidArgument("jaxmlp: pad_to must be at most 4096");
  if (m.R < DispatchRowBound(m))
    return ffi::Error::InvalidArgument("jaxmlp: dispatch's rows has " + std::to_string(m.R) + " rows, need " +
                                       std::to_string(DispatchRowBound(m)));
  JAXMLP_RETURN_IF_ERROR(CheckShape("rows", rows, {m.R, m.d}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("group_sizes", group_sizes, {m.E}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("counts", counts, {m.E}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("row_of_slot", row_of_slot, {m.T, m.k}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("slot_of_row", slot_of_row, {m.R}));
  *out = m;
  return ffi::Error::Success();
}

struct CombineDims {
  int64_t T, k, R, d;
  bool weighted;
};

// rows [R, d], row_of_slot [T, k] int32, weights [T, k] float32 or absent (unweighted) -> y [T, d] in
// `out_type`.
inline ffi::Error CheckCombine(const ffi::AnyBuffer& rows, const ffi::AnyBuffer& row_of_slot,
                               const ffi::AnyBuffer& weights, const ffi::AnyBuffer& y, CombineDims* out) {
  if (rows.dimensions().size() != 2 || row_of_slot.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxmlp: combine expects rows [R, d] and row_of_slot [T, k], got " +
                                       Dims(rows.dimensions()) + ", " + Dims(row_of_slot.dimensions()));
  if (!IsFloat(rows.element_type()) || row_of_slot.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jaxmlp: combine's rows must be float and row_of_slot int32");
  CombineDims m{row_of_slot.dimensions()[0], row_of_slot.dimensions()[1], rows.dimensions()[0],
                rows.dimensions()[1], Present(weights)};
  JAXMLP_RETURN_IF_ERROR(CheckExtents({m.T, m.k, m.R, m.d, m.T * m.k}));
  if (m.weighted) {
    JAXMLP_RETURN_IF_ERROR(CheckShape("weights", weights, {m.T, m.k}));
    if (weights.element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("jaxmlp: combine's weights must be float32");
  }
  JAXMLP_RETURN_IF_ERROR(CheckResult("y", y, {m.T, m.d}, rows.element_type()));
  *out = m;
  return ffi::Error::Success();
}

// The combine's backward: dy [T, d] and rows [R, d] (its forward's operand; absent when unweighted),
// row_of_slot [T, k], slot_of_row [R], weights -> drows [R, d] in dy's dtype, dweights [T, k] float32
// (absent when unweighted).
inline ffi::Error CheckCombineBackward(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& rows,
                                       const ffi::AnyBuffer& row_of_slot, const ffi::AnyBuffer& slot_of_row,
                                       const ffi::AnyBuffer& weights, const ffi::AnyBuffer& drows,
                                       const ffi::AnyBuffer& dweights, CombineDims* out) {
  if (dy.dimensions().size() != 2 || drows.dimensions().size() != 2 || row_of_slot.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxmlp: combine's backward expects dy [T, d], drows [R, d] and "
                                       "row_of_slot [T, k], got " + Dims(dy.dimensions()) + ", " +
                                       Dims(drows.dimensions()) + ", " + Dims(row_of_slot.dimensions()));
  if (!IsFloat(dy.element_type()) || row_of_slot.element_type() != ffi::DataType::S32 ||
      slot_of_row.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jaxmlp: combine's dy must be float, row_of_slot and slot_of_row int32");
  CombineDims m{dy.dimensions()[0], row_of_slot.dimensions()[1], drows.dimensions()[0], dy.dimensions()[1],
                Present(weights)};
  JAXMLP_RETURN_IF_ERROR(CheckExtents({m.T, m.k, m.R, m.d, m.T * m.k}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("row_of_slot", row_of_slot, {m.T, m.k}));
  JAXMLP_RETURN_IF_ERROR(CheckShape("slot_of_row", slot_of_row, {m.R}));
  JAXMLP_RETURN_IF_ERROR(CheckResult("drows", drows, {m.R, m.d}, dy.element_type()));
  if (m.weighted) {
    JAXMLP_RETURN_IF_ERROR(CheckShape("weights", weights, {m.T, m.k}));
    JAXMLP_RETURN_IF_ERROR(CheckShape("rows", rows, {m.R, m.d}));
    if (weights.element_type() != ffi::DataType::F32 || dweights.element_type() != ffi::DataType::F32 ||
        rows.element_type() != dy.element_type())
      return ffi::Error::InvalidArgument("jaxmlp: combine's weights and dweights must be float32, rows dy's dtype");
    JAXMLP_RETURN_IF_ERROR(CheckShape("dweights", dweights, {m.T, m.k}));
  }
  *out = m;
  return ffi::Error::Success();
}

}  // namespace jaxmlp
