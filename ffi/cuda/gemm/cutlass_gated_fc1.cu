// The engine's FC1 kernels for gated activations (cutlass_grouped.h, CutlassActivation): kNN with B's tiles
// in gate and up halves and the activation in the epilogue (cutlass_activation_epilogue.cuh).
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassGatedFc1(const CutlassLaunch& l) {
  return LaunchLayouts<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass_detail::Fusion::kGatedFc1>(
      l, /*nt=*/false);
}

}  // namespace jaxmlp
