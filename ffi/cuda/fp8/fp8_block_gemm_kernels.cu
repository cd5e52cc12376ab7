#include "cuda/fp8/fp8_block_gemm_kernels.h"

#include <algorithm>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/group_scan.cuh"
#include "cuda/launch.cuh"

namespace jaxmlp {
namespace {

// dst[Vec128Base(start, g, blocks) + b * round_up(rows, 4) + r - start] = src[r * blocks + b] for the rows r
// of each group g (rows [offsets[g], offsets[g + 1])): kNT's lhs scales as cuBLASLt reads them.
__global__ void Vec128ScalesKernel(const float* src, const int64_t* offsets, int64_t E, int64_t blocks,
                                   float* dst) {
  const int64_t total = offsets[E] * blocks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / blocks, b = i % blocks;
    const int64_t g = GroupOf(offsets, E, r), start = offsets[g], rows = offsets[g + 1] - start;
    dst[Vec128Base(start, g, blocks) + b * ((rows + 3) / 4 * 4) + r - start] = src[i];
  }
}

}  // namespace

ffi::Error LayOutVec128Scales(cudaStream_t stream, const float* src, const int64_t* offsets, int64_t E, int64_t M,
                              int64_t blocks, float* dst) {
  const int64_t elems = M * blocks;
  const unsigned grid = unsigned(std::min<int64_t>((elems + 255) / 256, 4096));
  Vec128ScalesKernel<<<grid, 256, 0, stream>>>(src, offsets, E, blocks, dst);
  return CheckCuda(cudaGetLastError(), "launching the block-scale layout kernel");
}

}  // namespace jaxmlp
