// The engine's tensorwise FP8 kNT kernels (cutlass_grouped.h):
// the FP8 main loop's float32 accumulation (wgmma's accumulator added into it after every k-tile).
// One translation unit per op, so that a parallel build compiles them side by side.
#include "cuda/gemm/cutlass_grouped_kernel.cuh"

namespace jaxmlp {

ffi::Error RunCutlassFp8NT(const CutlassLaunch& l) { return LaunchFp8</*kFastAccumulation=*/false>(l); }

}  // namespace jaxmlp
