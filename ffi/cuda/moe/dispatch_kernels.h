// The MoE dispatch and combine kernels (semantics: jaxmlp/reference_moe.py). All sync-free: no host copy,
// no allocation (scratch comes from the caller's workspace), so the handlers are command-buffer compatible.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "checks.h"

namespace jaxmlp {

// Largest E the counting sort takes: its rank kernel keeps one counter per (warp, expert) in shared memory.
constexpr int64_t kDispatchMaxExperts = 1536;

// Workspace bytes of DispatchPlan for `choices` = T * k routing choices over E experts.
size_t DispatchWorkspaceBytes(int64_t choices, int64_t E);

// The stable counting sort of the T*k choices of experts [T, k] (priority: choice-major, then token order):
// group_sizes, counts [E]; row_of_slot [T, k]; slot_of_row [R] (-1 on padding rows). capacity < 0: none.
ffi::Error DispatchPlan(cudaStream_t stream, int device, const int32_t* experts, int64_t T, int64_t k, int64_t E,
                        int64_t capacity, int64_t pad_to, int64_t R, int32_t* group_sizes, int32_t* counts,
                        int32_t* row_of_slot, int32_t* slot_of_row, void* workspace);

// rows[r] = x[slot_of_row[r] / k], or 0 where slot_of_row[r] is not in [0, T*k) and zero_padding (else
// such a row is left alone). x [T, d], rows [R, d].
// Each token's row is read once and written to the rows its choices hold (row_of_slot); rows that no choice
// holds back are gathered by slot_of_row.
ffi::Error GatherRows(cudaStream_t stream, int device, ffi::DataType t, const void* x, int64_t T, int64_t k,
                      int64_t d, const int32_t* row_of_slot, const int32_t* slot_of_row, int64_t R, void* rows,
                      bool zero_padding);

// y[t] = sum_j w[t, j] * rows[row_of_slot[t, j]] in float32, j ascending, over row indices in [0, R);
// weights null: w = 1.
ffi::Error CombineRows(cudaStream_t stream, int device, ffi::DataType t, const void* rows, int64_t R, int64_t d,
                       const int32_t* row_of_slot, const float* weights, int64_t T, int64_t k, void* y);

// drows[r] = w[s] * dy[s / k] for s = slot_of_row[r] (padding rows: 0 where zero_padding, else left alone); with weights, also
// dweights[s] = <dy[s / k], rows[row_of_slot[s]]> in float32, 0 for a dropped choice. Like GatherRows, each
// row of dy is read once.
ffi::Error CombineBackwardRows(cudaStream_t stream, int device, ffi::DataType t, const void* dy, const void* rows,
                               const int32_t* row_of_slot, const int32_t* slot_of_row, const float* weights,
                               int64_t T, int64_t k, int64_t R, int64_t d, void* drows, float* dweights,
                               bool zero_padding);

}  // namespace jaxmlp
