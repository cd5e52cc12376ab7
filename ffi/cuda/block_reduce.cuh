// The block-wide float sum of the kernels whose sums must be the same bits on every run (no atomics), and
// the warp- and block-wide maxima of the FP8 kernels' absolute maxima.
#pragma once

namespace jaxmlp {

// The maximum of v over the 32 lanes of a full warp, on every lane (fmaxf: a NaN lane is passed over).
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
  return v;
}

// The maximum of v over the threads of a block of kWarps full warps, on every thread. Once per block: it
// ends without a barrier after its reads of shared memory.
template <int kWarps>
__device__ __forceinline__ float BlockMax(float v) {
  __shared__ float warp_max[kWarps];
  v = WarpMax(v);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v = fmaxf(v, warp_max[w]);
  return v;
}

// The sum of v over the threads of a block of full warps, kMaxWarps at most, in a fixed order: a tree in
// each warp, then the warps' sums in warp order. Every thread of the block calls it and gets the sum. It
// ends with a barrier, so a block may call it again at once: the next call rewrites warp_sums.
template <int kMaxWarps>
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float warp_sums[kMaxWarps];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(~0u, v, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float sum = 0.0f;
  // Unrolled over kMaxWarps (known here, unlike blockDim.x); a block of fewer warps leaves the rest unwritten.
#pragma unroll
  for (int w = 0; w < kMaxWarps; ++w)
    if (w < int(blockDim.x / 32)) sum += warp_sums[w];
  __syncthreads();
  return sum;
}

}  // namespace jaxmlp
