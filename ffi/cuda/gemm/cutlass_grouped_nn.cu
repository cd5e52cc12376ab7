// The engine's kNN kernels (cutlass_grouped.h): A = lhs rows (K-major), B = rhs[g] [K, N] (N-major).
// One translation unit per op, so that a parallel build compiles them side by side.
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassNN(const CutlassLaunch& l) {
  return LaunchLayouts<cutlass::layout::RowMajor, cutlass::layout::RowMajor>(l, /*nt=*/false);
}

}  // namespace jaxmlp
