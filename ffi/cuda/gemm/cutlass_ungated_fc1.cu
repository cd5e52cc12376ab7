// The engine's FC1 kernels for ungated activations (cutlass_grouped.h, CutlassActivation): kNN with the
// activation in the epilogue (cutlass_activation_epilogue.cuh).
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassUngatedFc1(const CutlassLaunch& l) {
  return LaunchLayouts<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass_detail::Fusion::kFc1>(
      l, /*nt=*/false);
}

}  // namespace jaxmlp
