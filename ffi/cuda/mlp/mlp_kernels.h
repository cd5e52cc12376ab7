// The MLP's own CUDA kernels, around the grouped GEMMs: activation forward and backward (bias, gating
// and row scales fused), and per-group bias gradients.
//
// All take `offsets` [E + 1] from GroupedGemms::offsets() (written by the setup kernel, or on the tiled
// path by its first launch): rows at or past offsets[E] are padding, and the group of a row is found by
// binary search in it.
#pragma once

#include <cuda_runtime.h>

#include "checks.h"
#include "mlp_checks.h"
#include "cuda/gemm/cutlass_grouped.h"

namespace jaxmlp {

// Per row r < M: with `activation`, h[r] += b1[g] (written back, when b1 is given), a[r] = act(h[r]) *
// scales[r] (without it, h and a are left alone: FC1's epilogue computed a); y[r] = scales[r] * b2[g] for
// valid rows when b2 is given (FC2 then accumulates onto it; the scale weighs the whole expert output);
// padding rows: y = 0 where zero_padding, h and a left alone (no product reads them there).
ffi::Error ActivationForward(cudaStream_t stream, int device, ffi::DataType t, const ActParams& p,
                             const int64_t* offsets, int64_t E, int64_t M, int64_t f, int64_t d, void* h,
                             const void* b1, const void* scales, void* a, void* y, const void* b2,
                             bool zero_padding, bool activation = true);

// Per valid row, from h (with b1 added) and da = dy @ w2^T:
//   a_s = act(h) * s (the FC2 weight-gradient input), dh = da * s * act'(h),
//   dscales = sum_j da * act(h) + sum_j dy * b2[g] (the second term when b2 is given).
// Padding rows: dscales = 0, dx = 0 where zero_padding (the FC1 dgrad writes valid rows only), dh left
// alone (no product reads it there).
// In place is allowed: a_s may be da and dh may be h (each element is read before it is written, by the
// thread that writes it).
// With ds_parts (FC2's data gradient computed a_s and dh in its epilogue, CutlassActivation), h, da, a_s and
// dh are left alone and the first sum of dscales is ds_parts[row, :] (ScaleGradientParts(f) of them), added
// in order.
ffi::Error ActivationBackward(cudaStream_t stream, int device, ffi::DataType t, const ActParams& p,
                              const int64_t* offsets, int64_t E, int64_t M, int64_t f, int64_t d, const void* h,
                              const void* da, const void* scales, void* a_s, void* dh, void* dscales, void* dx,
                              const void* dy, const void* b2, bool zero_padding, const float* ds_parts = nullptr);

// The biases' gradients, each where the MLP has that bias (m.has_b1, m.has_b2): db1 [E, F1] the sums of dh
// [M, F1] over each group's rows, db2 [E, d] those of dy [M, d] weighted by the rows' scales (null: 1), as
// y = s * (a @ w2 + b2). Groups with no rows get 0. The sums are added in an order fixed by the shapes and
// offsets, so the result is the same bits on every run. `partials` is float scratch of
// BiasGradientsScratch(m) elements (0 without biases).
ffi::Error BiasGradients(cudaStream_t stream, ffi::DataType t, const int64_t* offsets, const MlpDims& m,
                         const void* dh, const void* dy, const void* scales, float* partials, void* db1, void* db2);
int64_t BiasGradientsScratch(const MlpDims& m);

}  // namespace jaxmlp
