// The engine's FC1 kernels for gated activations with x's rows gathered in their loads (cutlass_grouped.h,
// GemmSpec::gather): as cutlass_gated_fc1.cu, A's tiles loaded by cp.async from the tokens the dispatch plan
// names (cutlass_varlen_mainloop.cuh, kGatherA).
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassGatedFc1Gathered(const CutlassLaunch& l) {
  return LaunchLayouts<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass_detail::Fusion::kGatedFc1,
                       /*kGather=*/true>(l, /*nt=*/false);
}

}  // namespace jaxmlp
