// The blockwise recipe's quantizers (jaxmlp/fp8/blockwise.py defines them): one pass over each tensor,
// writing e4m3 data and the int32 exponent e of each block's scale 2^e bit for bit as the JAX code
// computes them, in the layouts jaxmlp_gemm_fp8_blocks reads (the calls: fp8_block_quantize_cuda.cu).
// One difference: a block holding a NaN takes its exponent from its other values here (fmaxf passes NaN
// over), from 0 in the JAX code (its maximum is NaN); the NaN itself stays NaN in both.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "checks.h"
#include "codes.h"
#include "cuda/gemm/grouped_gemm.h"

namespace jaxmlp {

// A rows-and-columns quantization of v [M, C] (C a multiple of 16), from one read of it, into
//   rows     q [M, C], e [M, ceil(C / 128)]: 1 x 128 blocks along the rows, and
//   columns  qt [C, 128 B], ec [B, C]: 128 x 1 blocks, block b holding rows first[b] .. first[b] +
//            count[b] - 1 of v (zeros after), transposed into columns 128 b ..
// first, count [B] are int32 on the device. Only what the products read is written: the rows the blocks
// hold (the groups' rows) and the blocks that hold rows; the rest of q, e, qt and ec keeps what it held
// (the expert-parallel layer's buffers hold up to P times the groups' rows).
// qt and ec null: the rows only (the weight gradients run in the 16-bit dtype). values, where not null:
// also v itself [M, C] rounded to the call's 16-bit dtype, in the groups' rows (the activations' a or dh,
// for those 16-bit weight gradients; null for a tensor quantized as it lies).
struct RowsAndColumns {
  int64_t M, C, B;
  const int32_t *first, *count;
  uint8_t* q;
  int32_t* e;
  uint8_t* qt;
  int32_t* ec;
  void* values = nullptr;
};

// Of v [M, C] as it lies (t: bfloat16, float16 or float32).
ffi::Error QuantizeRowsAndColumns(cudaStream_t stream, int device, ffi::DataType t, const void* v,
                                  const RowsAndColumns& o);

// Of v = a = act(h) * scales [M, f] (da null: the forward) or v = dh = da * scales * act'(h) [M, F1] (the
// backward), computed in float32 on the way into the quantizer: no float32 tensor
// goes through memory. h [M, F1], da [M, f] and scales [M] (null: 1) in t, bfloat16 or float16; f a
// multiple of 16.
ffi::Error QuantizeActivationRowsAndColumns(cudaStream_t stream, int device, ffi::DataType t, const ActParams& p,
                                            const void* h, const void* da, const void* scales, int64_t f,
                                            const RowsAndColumns& o);

// w [E, K, N] (t: bfloat16, float16 or float32; K and N multiples of 16), rounded to the computation dtype r
// (bfloat16 or float16; no copy is written), in 128 x 128 blocks: q [E, K, N], qt [E, N, K],
// e [E, ceil(K / 128), ceil(N / 128)].
ffi::Error QuantizeWeightBlocks(cudaStream_t stream, ffi::DataType t, ffi::DataType r, const void* w, int64_t E,
                                int64_t K, int64_t N, uint8_t* q, uint8_t* qt, int32_t* e);

}  // namespace jaxmlp
