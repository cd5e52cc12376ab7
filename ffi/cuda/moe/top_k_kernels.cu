#include "cuda/moe/top_k_kernels.h"

#include <algorithm>
#include <climits>

#include "cuda/launch.cuh"
#include "top_k.h"

namespace jaxmlp {
namespace {

constexpr int kTopKThreads = 256;  // 8 rows at a time per block

// Pass j takes the largest key below the one pass j - 1 took: keys are unique, so no element is marked. A
// row of up to 32 * kPerLane scores is held in registers, kPerLane keys a lane, read once; kPerLane = 0
// reads longer rows again in each pass (from L1).
template <int kPerLane>
__global__ void TopKKernel(const float* scores, int64_t T, int64_t E, int64_t k, float* values, int32_t* indices) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < T; t += warps) {
    const float* row = scores + t * E;
    int64_t keys[kPerLane > 0 ? kPerLane : 1];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t e = lane + 32 * i;
      keys[i] = e < E ? TopKKey(row[e], e) : LLONG_MIN;  // LLONG_MIN: below every key, never taken
    }
    int64_t taken = LLONG_MAX;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = LLONG_MIN;  // k <= E leaves a key to find
      if constexpr (kPerLane > 0) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i)
          if (keys[i] < taken && keys[i] > best) best = keys[i];
      } else {
        for (int64_t e = lane; e < E; e += 32) {
          const int64_t key = TopKKey(row[e], e);
          if (key < taken && key > best) best = key;
        }
      }
      for (int offset = 16; offset; offset /= 2) best = max(best, __shfl_xor_sync(0xffffffffu, best, offset));
      taken = best;
      if (lane == 0) {
        indices[t * k + j] = int32_t(TopKIndexOf(best));
        values[t * k + j] = TopKScoreOf(best);
      }
    }
  }
}

}  // namespace

ffi::Error TopKRows(cudaStream_t stream, const float* scores, int64_t T, int64_t E, int64_t k, float* values,
                    int32_t* indices) {
  const int64_t rows_per_block = kTopKThreads / 32;
  const unsigned blocks = unsigned(std::min<int64_t>((T + rows_per_block - 1) / rows_per_block, 1 << 20));
  auto* kernel = E <= 32 ? TopKKernel<1> : E <= 64 ? TopKKernel<2> : E <= 128 ? TopKKernel<4>
                 : E <= 256 ? TopKKernel<8> : TopKKernel<0>;
  kernel<<<blocks, kTopKThreads, 0, stream>>>(scores, T, E, k, values, indices);
  return CheckCuda(cudaGetLastError(), "launching the top-k kernel");
}

}  // namespace jaxmlp
