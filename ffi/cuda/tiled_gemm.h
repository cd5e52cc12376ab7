// jaxmlp's own grouped GEMM, for problems too small for cuBLAS (the "tiled" GEMM path).
//
// A cuBLAS grouped GEMM costs ~7 us however small it is, and needs a setup kernel before it and, for
// weight gradients, a zeroing kernel after it. At decode and small-model sizes those fixed costs are the
// whole layer. This kernel needs neither: each thread block finds its group by scanning group_sizes
// itself, every output element of a product is written (groups without rows get zero weight gradients,
// rows past the groups zeros), and one launch runs several independent products. bfloat16 and float16
// inputs, float accumulation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../common.h"
#include "grouped_gemm.h"

namespace jaxmlp {

// The group_sizes of a call, and where block 0 of each launch writes the counts and offsets that the
// MLP kernels after it read (the policy of GroupOffsets, as the setup kernel of the cuBLAS paths does).
struct TiledGroups {
  const int32_t* sizes;
  int64_t E, M;
  int32_t* counts;   // [E]
  int64_t* offsets;  // [E + 1]
};

// Whether the tiled kernel can run on the current device, and if not, why.
bool TiledPathAvailable(std::string* reason);

// Whether `s` can run here: 16-bit inputs, any float output, K and N multiples of 8.
bool TiledGemmSupports(const GemmSpec& s);

// Runs products specs[0..n) (no one reading another's output) in one launch. The rows of a kNN/kNT
// product's output past the groups (padding) get zeros.
ffi::Error RunTiledGemms(cudaStream_t stream, const TiledGroups& groups, const GemmSpec* const* specs, int n);

}  // namespace jaxmlp
