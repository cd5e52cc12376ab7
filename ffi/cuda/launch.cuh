// Programmatic dependent launch (compute capability 9.0 and newer): a kernel launched with
// LaunchOverlapped may be scheduled while the kernel before it on the stream is still finishing, so its
// launch and block start-up hide behind that kernel's tail instead of following it. Such a kernel must
// call WaitForPrevious before its first access to global memory: it returns once the previous kernel
// has completed and its writes are visible. Under stream capture (XLA command buffers) CUDA records the
// relation as a programmatic graph edge; tests/test_cuda.py replays these kernels from command buffers.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace jaxmlp {

__device__ __forceinline__ void WaitForPrevious() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // This kernel's own dependents may now be scheduled; they wait in turn for its completion.
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Whether the current device takes programmatic launches (asked at each launch).
inline bool OverlapLaunches() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

template <typename... Params, typename... Args>
cudaError_t LaunchOverlapped(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = OverlapLaunches() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace jaxmlp
