// The tensorwise FP8 path's activation passes, forward and backward, emitting e4m3 (the recipe is
// jaxmlp/fp8/tensorwise.py's docstring; scales as fp8_quantize_kernels.h states them). Rows past offsets[E]
// are padding: they count for no amax and are quantized nowhere.
#pragma once

#include <cuda_runtime.h>

#include "checks.h"
#include "codes.h"
#include "cuda/fp8/fp8_quantize_kernels.h"

namespace jaxmlp {

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

// The backward's activation with 16-bit weight gradients, from h and da = dy w2^T (x.dtype), in two passes
// over the valid rows:
//   1. a16 = act(h) * s in t (the 16-bit weight gradient's operand), dscales = sum_j da * act(h) (+ sum_j dy *
//      b2[g] with b2), *amax_dh = max |dh| where dh = da * s * act'(h); padding rows get dscales 0 and dx 0;
//   2. dhq = e4m3(dh) with that scale, and dh itself in t where dh is not null (for db1 and dw1).
// Delayed scaling runs one pass: with dhq given, ActivationBackwardAbsMax also does pass 2 with the scale of
// *given_dh (and *scale_dh), *amax_dh then dh's maximum as observed; where *given_dh is 0 (an empty history)
// ActivationBackwardQuantize with skip = given_dh does pass 2 by that observed maximum (nothing where *skip is
// positive).
ffi::Error ActivationBackwardAbsMax(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                                    int64_t E, int64_t M, int64_t f, int64_t d, const void* h, const void* da,
                                    const void* scales, const void* dy, const void* b2, void* a16, void* dscales,
                                    void* dx, float* amax_dh, const float* given_dh = nullptr,
                                    float* scale_dh = nullptr, void* dhq = nullptr, void* dh = nullptr);
ffi::Error ActivationBackwardQuantize(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                                      int64_t E, int64_t M, int64_t f, const void* h, const void* da,
                                      const void* scales, const float* amax_dh, float* scale_dh, void* dhq,
                                      void* dh, const float* skip = nullptr);

// The backward's activation with FP8 weight gradients, over 128 x 128 tiles of a [M, f] and the matching
// columns of dh's gate and up halves, from h and da as above: what one launch writes (Fp8ActTiles), each
// e4m3 tile also transposed into the weight gradients' layout as it is formed (no transposing pass after).
// Two launches make a step: the first with at, ds_parts and observed (and, with a positive history, dh's
// outputs by it), the second with dh's outputs by the amax the first observed (skip: the history, where it
// was positive). ActivationBackwardRows then gives the rows' dscales from ds_parts and dx's padding rows.
inline int64_t Fp8ActTileParts(int64_t f) { return (f + 127) / 128; }  // ds_parts a row: one a tile of columns
struct Fp8ActTiles {
  Fp8Outputs layout;            // row_offsets, E, col_offsets, ld: the transposed layout [.., L] (cols_out unused)
  void* at = nullptr;           // [f, L]: e4m3(act(h) * s) by *amax_a, transposed; null: not written
  float* ds_parts = nullptr;    // [M, Fp8ActTileParts(f)]: sum_j da * act(h) over each 128 columns; or null
  float* observed = nullptr;    // max |dh| over the valid rows reaches it; or null
  const float* dh_amax = nullptr;  // dh's outputs by its scale (null: none): dhq [M, F1] (rows) and dht
  bool dh_if_positive = false;     // [F1, L] in e4m3, dh [M, F1] in t where not null, *scale_dh; with
  float* scale_dh = nullptr;       // dh_if_positive only where *dh_amax > 0
  void *dhq = nullptr, *dht = nullptr, *dh = nullptr;
  const float* skip = nullptr;  // nothing at all where *skip > 0
};
ffi::Error ActivationBackwardTiles(cudaStream_t stream, int device, ffi::DataType t, const ActParams& p, int64_t M,
                                   int64_t f, const void* h, const void* da, const void* scales, const float* amax_a,
                                   const Fp8ActTiles& o);
// dscales [M] (may be null: no row scales) the sums of each row's ds_parts [M, Fp8ActTileParts(f)], in order,
// and with b2 of sum_j dy * b2[g]; the padding rows' dscales 0 and dx [M, d] 0.
ffi::Error ActivationBackwardRows(cudaStream_t stream, ffi::DataType t, const int64_t* offsets, int64_t E, int64_t M,
                                  int64_t f, int64_t d, const float* ds_parts, const void* dy, const void* b2,
                                  void* dscales, void* dx);

}  // namespace jaxmlp
