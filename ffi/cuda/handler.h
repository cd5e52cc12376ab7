// What the CUDA handler files (<topic>_cuda.cu in each room) share: the count of their host-side runs,
// the poisoning of their outputs, the context they all bind, the traits of those XLA may capture in a
// command buffer, and what they give module.cc besides their handler symbols (ffi/targets.inc): the
// workspace sizes that Python must request.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "checks.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/launch.cuh"
#include "mlp_checks.h"
#include "poison.h"

namespace jaxmlp {

// Host-side executions of the handlers. A handler captured in an XLA command buffer runs its host code
// once and is then replayed by the GPU alone, which this counter makes observable (tests/test_cuda.py).
inline std::atomic<int64_t> handler_host_calls{0};

// JAXMLP_POISON_OUTPUTS (poison.h): fills the handler's outputs and scratch with 0xFF bytes (NaN) on the
// stream before its kernels run, so that an element no kernel writes fails the tests.
inline ffi::Error Poison(cudaStream_t stream, std::initializer_list<ffi::AnyBuffer*> outs) {
  if (!PoisonOutputs()) return ffi::Error::Success();
  for (ffi::AnyBuffer* b : outs)
    if (b->size_bytes())
      JAXMLP_RETURN_IF_ERROR(CheckCuda(cudaMemsetAsync(b->untyped_data(), 0xFF, b->size_bytes(), stream),
                                       "poisoning outputs"));
  return ffi::Error::Success();
}

// The context every handler that launches through GroupedGemms or LaunchOverlapped binds: its stream, and
// the device XLA runs the call on (the stream's), which keys the per-device caches.
inline auto BindStreamAndDevice() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

// The traits of a handler that never syncs or allocates: XLA may capture it in a command buffer.
constexpr auto kGraphSafe = {ffi::Traits::kCmdBufferCompatible};

// Scratch bytes of one call, from the same carving the handler does (Carver), so that Python requests
// exactly what the handler takes: the bf16 MLP (mlp/mlp_cuda.cu) on a GEMM path, the FP8 MLP
// (fp8/fp8_mlp_cuda.cu), and the block-scaled FP8 product (fp8/fp8_block_gemm_cuda.cu; op: a GemmOp).
// esize: the bytes of one element of x (ElementBytes).
size_t MlpWorkspaceBytes(GemmPath path, bool forward, const MlpDims& m, int esize);
size_t MlpFp8WorkspaceBytes(bool forward, bool engine, bool fp8_wgrad, const MlpDims& m, int esize);
size_t GemmFp8BlocksWorkspaceBytes(int32_t op, int64_t M, int64_t E, int64_t N);

}  // namespace jaxmlp
