// The router's top-k kernel (ffi/top_k.h has the order it selects in). XLA sorts each whole row for this
// (its own top-k kernel takes rows of 1024 or more); for the router's few experts per row a warp per row
// finds the k largest keys in k passes over the row. No sync, no allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "checks.h"

namespace jaxmlp {

// values [t, j] and indices [t, j] = the score and column of the j-th largest key (TopKKey) of row t of
// scores [T, E], for j < k, 1 <= k <= E.
ffi::Error TopKRows(cudaStream_t stream, const float* scores, int64_t T, int64_t E, int64_t k, float* values,
                    int32_t* indices);

}  // namespace jaxmlp
