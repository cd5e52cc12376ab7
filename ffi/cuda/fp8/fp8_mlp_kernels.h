// The FP8 path's own kernels (the recipe is jaxmlp/fp8.py's docstring): absolute maxima, quantization to
// e4m3 in the row layout and in the transposed layouts the weight gradients need, and the activation
// forward and backward emitting FP8.
//
// Scales: `amax` points at a float absolute maximum (written by AbsMax); a kernel that quantizes with it
// multiplies by 448 / amax (1 where amax is 0; FLT_MAX where 448 / amax overflows) and, where `scale_out` is
// given, stores the dequantization scale amax / 448 (1 where amax is 0; 2^-128 where the inverse was clamped)
// there for cuBLAS. Rows past offsets[E] are padding: they count for
// no amax and are quantized nowhere.
#pragma once

#include <cuda_runtime.h>

#include "checks.h"
#include "codes.h"

namespace jaxmlp {

// Where a quantizer's input row r lies: row r of v, or (gather given: the rows a dispatch plan takes from
// v's `tokens` tokens) token gather[r] / top_k of v, a row of zeros where gather[r] < 0 or that token is past
// `tokens` (jaxmlp.plan.take_rows): the FP8 forward reads the MoE layer's rows from its tokens, no 16-bit
// copy of them written.
struct Fp8Rows {
  const int32_t* gather = nullptr;
  int32_t top_k = 1;
  int64_t tokens = 0;
};

// *amax = max(*amax, max |v| over rows [0, rows) of v [.., n]) with rows = offsets[E] where offsets is given,
// else `rows`; the rows as `from` places them. *amax must hold a non-negative value (0 to start) before the
// first call. skip (delayed scaling): nothing where *skip is positive (a history's amax to scale by).
ffi::Error AbsMax(cudaStream_t stream, ffi::DataType t, const void* v, const int64_t* offsets, int64_t E,
                  int64_t rows, int64_t n, float* amax, const Fp8Rows& from = {}, const float* skip = nullptr);

// Where QuantizeRows writes element (r, c) of its [R, C] input, for rows r in group g:
//   rows_out[r * C + c]                                           (the input's layout), and/or
//   cols_out[g * group_stride + c * ld + col_offsets[g] + r - row_offsets[g]]     (transposed per group)
// Groups are given by row_offsets [E + 1] (rows past row_offsets[E] are skipped), or, where it is null, are
// E blocks of group_rows rows each (the weights' experts: col_offsets null means 0). With col_offsets (each
// a multiple of 16: the weight gradients' padded layout) cols_out also gets zeros after each group's rows
// up to the next multiple of 16.
struct Fp8Outputs {
  void* rows_out = nullptr;
  void* cols_out = nullptr;
  const int64_t* row_offsets = nullptr;
  const int64_t* col_offsets = nullptr;
  int64_t E = 1, group_rows = 0, group_stride = 0, ld = 0;
};

// Quantizes v [R, C] (t: bf16, f16 or FP8 e4m3, the last one with amax null: a transposition) with the scale
// of *amax into `out`; R rows as `from` places them (16-bit v only where gathered). seen (16-bit v; delayed
// scaling, where *amax is the history's): *seen = max(*seen, max |v| over the rows quantized), as AbsMax.
ffi::Error QuantizeRows(cudaStream_t stream, ffi::DataType t, const void* v, int64_t R, int64_t C, const float* amax,
                        float* scale_out, const Fp8Outputs& out, const Fp8Rows& from = {}, float* seen = nullptr);

// Zeroes the columns of the padded layout cols [R, ld] from *padded_end (the last group's padded end, on the
// device: GroupedGemms::padded_starts() + E) on: ld is sized for the worst case (PaddedRows), the products
// read only the groups' columns, and an output keeps no element unwritten.
ffi::Error ZeroPaddedTail(cudaStream_t stream, void* cols, int64_t R, int64_t ld, const int64_t* padded_end);

// The forward's activation in two passes over the valid rows of h [M, F1]: *amax_a = max |act(h) * s|
// (zeroing the padding rows of h and y on the way; with b1 [E, F1] adding the row's group's bias to h in
// place first, with b2 [E, d] setting y's row to s * b2[g] for FC2 to add onto), then aq [M, f] =
// e4m3(act(h) * s) with that scale. b1, b2, scales: may be null. Delayed scaling runs one pass: with aq given,
// ActivationAbsMax also writes aq with the scale of *given_a (and *scale_a), *amax_a then a's maximum as
// observed; where *given_a is 0 (an empty history) it writes no aq, and ActivationQuantize with skip = given_a
// quantizes a by that observed maximum (amax_out: where it then writes it; nothing where *skip is positive).
ffi::Error ActivationAbsMax(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                            int64_t E, int64_t M, int64_t f, int64_t d, void* h, const void* b1, const void* scales,
                            void* y, const void* b2, float* amax_a, const float* given_a = nullptr,
                            float* scale_a = nullptr, void* aq = nullptr);
ffi::Error ActivationQuantize(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                              int64_t E, int64_t M, int64_t f, const void* h, const void* scales, const float* amax_a,
                              float* scale_a, void* aq, const float* skip = nullptr, float* amax_out = nullptr);

// The backward's activation, from h and da = dy w2^T (x.dtype), in two passes over the valid rows:
//   1. aq = e4m3(act(h) * s) with the forward's *amax_a (or, where a16 is given, a16 = act(h) * s in t
//      instead: the 16-bit weight gradient's operand), dscales = sum_j da * act(h) (+ sum_j dy * b2[g]
//      with b2), *amax_dh = max |dh| where dh = da * s * act'(h); padding rows get dscales 0 and dx 0;
//   2. dhq = e4m3(dh) with that scale, and dh itself in t where dh is not null (for db1 and 16-bit dw1).
// Delayed scaling runs one pass: with dhq given, ActivationBackwardAbsMax also does pass 2 with the scale of
// *given_dh (and *scale_dh), *amax_dh then dh's maximum as observed; where *given_dh is 0 (an empty history)
// ActivationBackwardQuantize with skip = given_dh does pass 2 by that observed maximum (nothing where *skip is
// positive).
ffi::Error ActivationBackwardAbsMax(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                                    int64_t E, int64_t M, int64_t f, int64_t d, const void* h, const void* da,
                                    const void* scales, const float* amax_a, const void* dy, const void* b2,
                                    void* aq, void* a16, void* dscales, void* dx, float* amax_dh,
                                    const float* given_dh = nullptr, float* scale_dh = nullptr, void* dhq = nullptr,
                                    void* dh = nullptr);
ffi::Error ActivationBackwardQuantize(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                                      int64_t E, int64_t M, int64_t f, const void* h, const void* da,
                                      const void* scales, const float* amax_dh, float* scale_dh, void* dhq,
                                      void* dh, const float* skip = nullptr);

// scale[i] = dequantization scale of amax[i], for i < n (the backward's scales of the forward's amaxes).
ffi::Error ScalesOf(cudaStream_t stream, const float* amax, int n, float* scale);

}  // namespace jaxmlp
