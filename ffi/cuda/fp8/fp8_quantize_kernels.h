// The tensorwise FP8 path's quantizers (the recipe is jaxmlp/fp8/tensorwise.py's docstring): absolute
// maxima, quantization to e4m3 in the row layout and in the transposed layouts the weight gradients need,
// and the dequantization scales of amaxes.
//
// Scales: `amax` points at a float absolute maximum (written by AbsMax); a kernel that quantizes with it
// multiplies by 448 / amax (1 where amax is 0; FLT_MAX where 448 / amax overflows) and, where `scale_out` is
// given, stores the dequantization scale amax / 448 (1 where amax is 0; 2^-128 where the inverse was clamped)
// there for cuBLAS. Rows past offsets[E] are padding: they count for no amax and are quantized nowhere.
#pragma once

#include <cuda_runtime.h>

#include "checks.h"

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

// scale[i] = dequantization scale of amax[i], for i < n (the backward's scales of the forward's amaxes).
ffi::Error ScalesOf(cudaStream_t stream, const float* amax, int n, float* scale);

}  // namespace jaxmlp
