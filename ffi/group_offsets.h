// The group_sizes policy, shared by the CPU handlers and the CUDA fallback path (the CUDA kernels apply
// the same policy on the device: group_scan.cuh).
#pragma once

#include <algorithm>
#include <cstdint>

namespace jaxmlp {

// group_sizes policy (documented in README "Semantics"): negative sizes count as 0 and the running total
// is capped at M. offsets[g] = min(sum_{i<g} max(size_i, 0), M); offsets has E + 1 entries, so group g owns
// rows [offsets[g], offsets[g+1]) and every row index derived from group_sizes lies in [0, M].
inline void GroupOffsets(const int32_t* sizes, int64_t E, int64_t M, int64_t* offsets) {
  int64_t total = 0;  // int64: E * INT32_MAX cannot overflow it
  offsets[0] = 0;
  for (int64_t g = 0; g < E; ++g) {
    total += std::max<int32_t>(sizes[g], 0);
    offsets[g + 1] = std::min(total, M);
  }
}

}  // namespace jaxmlp
