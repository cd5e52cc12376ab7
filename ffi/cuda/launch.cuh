// Programmatic dependent launch (compute capability 9.0 and newer): a kernel launched with
// LaunchOverlapped may be scheduled while the kernel before it on the stream is still finishing, so its
// launch and block start-up hide behind that kernel's tail instead of following it. Such a kernel must
// call WaitForPrevious before its first access to global memory: it returns once the previous kernel
// has completed and its writes are visible. Under stream capture (XLA command buffers) CUDA records the
// relation as a programmatic graph edge; tests/test_cuda.py replays these kernels from command buffers.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "checks.h"

namespace jaxmlp {

// `e` (a CUDA call's result, or cudaGetLastError() after kernel launches) as the FFI error of `what`. The
// thread's last error is cleared: a failure must not fail the next call too.
inline ffi::Error CheckCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  cudaGetLastError();
  return ffi::Error::Internal(std::string("jaxmlp: ") + what + ": " + cudaGetErrorString(e));
}

__device__ __forceinline__ void WaitForPrevious() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // This kernel's own dependents may now be scheduled; they wait in turn for its completion.
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Makes `device` the calling thread's current device for the guard's lifetime, then restores the previous
// one: the per-kernel queries and settings (cudaFuncGetAttributes, cudaFuncSetAttribute, occupancy) act on
// the current device, and on a host with mixed GPUs they must act on the call's (ffi::DeviceOrdinal) or
// the one asked about, whichever the thread has current. Inside a handler XLA has already made the call's
// device current, so the guard changes nothing there.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    ok_ = previous_ == device || cudaSetDevice(device) == cudaSuccess;
    if (!ok_) cudaGetLastError();
  }
  ~ScopedDevice() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_ && cudaSetDevice(previous_) != cudaSuccess)
      cudaGetLastError();
  }
  bool ok() const { return ok_; }  // whether `device` is current
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
  bool ok_ = false;
};

// Facts about a kernel on a device (the architecture its running code was compiled for, how many of its
// blocks fit at once) do not change while the process runs, and asking the runtime for them costs host
// time on every call where XLA launches the handlers itself (no command buffers). So `query(device)` runs
// once per (device, kernel) and its result is kept; a query that failed (std::nullopt) gives Result{}
// and is asked again by the next call, so that one failure cannot stick for the process. `device` is the
// call's (ffi::DeviceOrdinal), not cudaGetDevice's: the cache must not depend on which device the calling
// thread has current.
template <typename Query>
auto OncePerDeviceAndKernel(int device, const void* kernel, Query query) ->
    typename decltype(query(0))::value_type {
  using Result = typename decltype(query(0))::value_type;
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, Result> known;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find({device, kernel});
  if (it != known.end()) return it->second;
  const std::optional<Result> result = query(device);
  if (!result) return Result{};
  known.emplace(std::make_pair(device, kernel), *result);
  return *result;
}

// Allows `kernel` `bytes` of dynamic shared memory on `device` (above 48 KB it is opt-in per kernel and
// device), once per (device, kernel): cudaSuccess, or the error, with none left pending for the launch's
// check (a failed setting is tried again by the next call).
template <typename Kernel>
cudaError_t AllowDynamicSharedMemory(int device, Kernel kernel, int bytes) {
  cudaError_t status = cudaSuccess;
  const bool allowed = OncePerDeviceAndKernel(device, reinterpret_cast<const void*>(kernel),
                                              [&](int device) -> std::optional<bool> {
    ScopedDevice on(device);  // the attribute is set for the current device
    status = on.ok() ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)
                     : cudaErrorInvalidDevice;
    if (status == cudaSuccess) return true;
    cudaGetLastError();
    return std::nullopt;
  });
  return allowed ? cudaSuccess : status;
}

// The number of SMs of `device`, queried once; 0 where the query fails (then asked again next time).
inline int MultiProcessorCount(int device) {
  static const char key = 0;  // this query's own entry in OncePerDeviceAndKernel's cache
  return int(OncePerDeviceAndKernel(device, &key, [](int device) -> std::optional<int64_t> {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) return count;
    cudaGetLastError();  // a query: leave no error behind for the next launch to report
    return std::nullopt;
  }));
}

// Whether `kernel` may be launched programmatically on `device`: the device takes such launches (compute
// capability 9.0 and newer) and the kernel's code that runs there was compiled for 9.0 or newer, so that
// it calls griddepcontrol.wait (a build for 8.0 alone runs as JIT-compiled PTX without it on Hopper, and
// must wait for the kernel ahead as a plain launch does). cudaFuncGetAttributes asks about the current
// device: `device` is made current for the query (ScopedDevice; XLA has already made the call's device
// current before it runs a handler, so this changes nothing there).
inline bool OverlapLaunches(int device, const void* kernel) {
  return OncePerDeviceAndKernel(device, kernel, [kernel](int device) -> std::optional<bool> {
    int major = 0;
    cudaFuncAttributes attrs{};
    ScopedDevice on(device);
    if (!on.ok() || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaFuncGetAttributes(&attrs, kernel) != cudaSuccess) {
      cudaGetLastError();  // a query: leave no error behind for the launch to report
      return std::nullopt;  // a plain launch, this time
    }
    return major >= 9 && attrs.ptxVersion >= 90;
  });
}

// Launches `kernel` on `stream` of the call's `device`, overlapped where OverlapLaunches allows.
template <typename... Params, typename... Args>
cudaError_t LaunchOverlapped(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             int device, Args&&... args) {
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = OverlapLaunches(device, reinterpret_cast<const void*>(kernel)) ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace jaxmlp
