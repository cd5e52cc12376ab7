// The block-scaled FP8 product's own kernel (the product: fp8_block_gemm_cuda.cu): kNT's lhs scales laid
// out per group as cuBLASLt reads them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "checks.h"

namespace jaxmlp {

// dst[Vec128Base(start, g, blocks) + b * round_up(rows, 4) + r - start] = src[r * blocks + b] for the rows r
// of each group g (rows [offsets[g], offsets[g + 1]), offsets [E + 1] on the device) of src [M, blocks].
ffi::Error LayOutVec128Scales(cudaStream_t stream, const float* src, const int64_t* offsets, int64_t E, int64_t M,
                              int64_t blocks, float* dst);

}  // namespace jaxmlp
