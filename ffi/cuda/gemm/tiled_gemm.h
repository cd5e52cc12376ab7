// jaxmlp's own grouped GEMM, for problems too small for cuBLAS (the "tiled" GEMM path).
//
// A cuBLAS grouped GEMM has a fixed cost per launch however small it is, and needs a setup kernel before
// it and, for weight gradients, a zeroing kernel after it. At decode and small-model sizes those fixed costs are the
// whole layer. This kernel needs neither: each thread block finds its group by scanning group_sizes
// itself, every output element of a product is written (groups without rows get zero weight gradients,
// rows past the groups zeros), and one launch runs several independent products. bfloat16 and float16
// inputs, float accumulation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "checks.h"
#include "cuda/gemm/grouped_gemm.h"

namespace jaxmlp {

// Split-K scratch of a call: output tiles whose reduction is split over several blocks (at most
// kTiledSplitSlots per launch, counting each split) leave their partial sums here.
constexpr int kTiledSplitSlots = 256;
constexpr int kTiledTileElems = 64 * 64;

// The group_sizes of a call, where block 0 of the call's first launch writes the counts and offsets that
// the MLP kernels after it read (the policy of GroupOffsets, as the setup kernel of the cuBLAS paths
// does), and the split-K scratch.
struct TiledGroups {
  const int32_t* sizes;
  int64_t E, M;
  int32_t* counts;          // [E]
  int64_t* offsets;         // [E + 1]
  int32_t* split_arrivals;  // [kTiledSplitSlots] blocks done per split tile; zeroed by the first launch
  float* split_partials;    // [kTiledSplitSlots][kTiledTileElems]: 4 MiB; both null: no launch splits
};

// Whether the tiled kernel can run on the current device, and if not, why.
bool TiledPathAvailable(int device, std::string* reason);

// Runs products specs[0..n) (no one reading another's output; 16-bit inputs, one input and one output
// dtype for all, K and N multiples of 8, else an InvalidArgument error) in one launch. The rows of a kNN/kNT product's output
// past the groups (padding) get zeros. A call's first launch writes the group arrays.
// The later ones (follows_own_kernel: the kernel ahead on the stream is one of the call's own, launched
// after the first) read group_sizes and the operands that are call inputs before waiting for that kernel,
// and split long reductions over several blocks. `device` is the call's (GroupedGemms).
ffi::Error RunTiledGemms(cudaStream_t stream, int device, const TiledGroups& groups, const GemmSpec* const* specs,
                         int n, bool follows_own_kernel);

}  // namespace jaxmlp
