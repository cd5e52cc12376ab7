// The engine's kernels for FC2's data gradient of an ungated activation (cutlass_grouped.h, CutlassActivation):
// kNT with the activation's backward in the epilogue (cutlass_activation_epilogue.cuh).
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassUngatedDgrad(const CutlassLaunch& l) {
  return LaunchLayouts<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass_detail::Fusion::kDgrad>(
      l, /*nt=*/true);
}

}  // namespace jaxmlp
