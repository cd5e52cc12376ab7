// The engine's tensorwise FP8 kNT kernels (cutlass_grouped.h):
// fast accumulation (wgmma's accumulator throughout).
// One translation unit per op, so that a parallel build compiles them side by side.
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassFp8NTFast(const CutlassLaunch& l) { return LaunchFp8</*kFastAccumulation=*/true>(l); }

}  // namespace jaxmlp
