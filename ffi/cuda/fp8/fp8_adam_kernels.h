// The optimizer steps that also write the new weights' FP8 layouts (jaxmlp/fp8/adam.py defines them):
// optax.adam's step (adamw's with a weight decay) of float32 weights [E, K, N] and their moments, then the
// new weights rounded to the computation dtype r and quantized, in one pass: w, mu and nu are read once and
// written to w_out, mu_out and nu_out (which may be the same buffers), the gradient g (of type g: float32
// or r, the 16-bit gradient an FP8 call gives, which then takes no conversion pass) read once, the new
// weights held in registers. The calls: fp8_adam_cuda.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

namespace ffi = xla::ffi;

// hyper [3] float32 on the device: -learning rate, 1 - b1^t and 1 - b2^t (t the step's count), computed by
// the step's JAX code as optax computes them; one_minus_b1 and one_minus_b2 are 1 - b1 and 1 - b2 rounded
// once, as optax's (1 - b1) * g takes them.
struct AdamStep {
  const float *w, *mu, *nu;
  const void* g;
  float *w_out, *mu_out, *nu_out;
  const float* hyper;
  float b1, b2, one_minus_b1, one_minus_b2, eps, eps_root, weight_decay;
};

// Blockwise: the new weights in 128 x 128 blocks, as QuantizeWeightBlocks quantizes them: q [E, K, N],
// qt [E, N, K], e [E, ceil(K / 128), ceil(N / 128)].
ffi::Error AdamWeightBlocks(cudaStream_t stream, ffi::DataType r, ffi::DataType g, const AdamStep& s, int64_t E,
                            int64_t K, int64_t N, uint8_t* q, uint8_t* qt, int32_t* e);

// Tensorwise with a delayed scale: the new weights quantized by the absolute maximum *delayed (the last
// weights', on the device): q [E, K, N], qt [E, N, K]; *amax (zeroed by the caller) becomes the new weights'
// maximum (fmaxf passes a NaN over, where the JAX code's maximum is NaN).
ffi::Error AdamWeightTensor(cudaStream_t stream, ffi::DataType r, ffi::DataType g, const AdamStep& s, int64_t E,
                            int64_t K, int64_t N, const float* delayed, uint8_t* q, uint8_t* qt, float* amax);

}  // namespace jaxmlp
