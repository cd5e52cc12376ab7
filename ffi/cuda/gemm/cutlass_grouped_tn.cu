// The engine's kTN kernels (cutlass_grouped.h): A = lhs rows transposed (M-major), B = rhs rows (N-major).
// One translation unit per op, so that a parallel build compiles them side by side.
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassTN(const CutlassLaunch& l) {
  return LaunchLayouts<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>(l);
}

}  // namespace jaxmlp
