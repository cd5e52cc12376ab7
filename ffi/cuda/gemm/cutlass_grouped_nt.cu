// The engine's kNT kernels (cutlass_grouped.h): A = lhs rows (N-major, the reduction), B = rhs[g] [K, N]
// read as [N, K] (reduction-major).
// One translation unit per op, so that a parallel build compiles them side by side.
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassNT(const CutlassLaunch& l) {
  return LaunchLayouts<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>(l, /*nt=*/true);
}

}  // namespace jaxmlp
