// Python module jaxmlp._cuda: the CUDA handlers as capsules, the workspace sizes Python must request,
// and what backend_info() reports (cuBLAS version, device, whether the grouped and tiled paths can run).
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "../common.h"
#include "cublas_api.h"
#include "dispatch_kernels.h"
#include "grouped_gemm.h"
#include "tiled_gemm.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* MlpForwardGrouped(XLA_FFI_CallFrame*);
XLA_FFI_Error* MlpForwardFallback(XLA_FFI_CallFrame*);
XLA_FFI_Error* MlpBackwardGrouped(XLA_FFI_CallFrame*);
XLA_FFI_Error* MlpBackwardFallback(XLA_FFI_CallFrame*);
XLA_FFI_Error* GemmGrouped(XLA_FFI_CallFrame*);
XLA_FFI_Error* GemmFallback(XLA_FFI_CallFrame*);
XLA_FFI_Error* MlpForwardTiled(XLA_FFI_CallFrame*);
XLA_FFI_Error* MlpBackwardTiled(XLA_FFI_CallFrame*);
XLA_FFI_Error* GemmTiled(XLA_FFI_CallFrame*);
XLA_FFI_Error* DispatchCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* CombineCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* CombineBackwardCuda(XLA_FFI_CallFrame*);
}

namespace jaxmlp {
size_t MlpWorkspaceBytes(GemmPath path, bool forward, const MlpDims& m, int esize);
extern std::atomic<int64_t> handler_host_calls;
}

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) { return nb::capsule(reinterpret_cast<void*>(fn)); }

jaxmlp::GemmPath PathOf(const std::string& path) {
  if (path == "grouped") return jaxmlp::GemmPath::kGrouped;
  if (path == "tiled") return jaxmlp::GemmPath::kTiled;
  if (path == "fallback") return jaxmlp::GemmPath::kFallback;
  throw std::invalid_argument("jaxmlp: unknown GEMM path '" + path + "': expected grouped, tiled or fallback");
}

nb::dict Status(const std::vector<std::string>& lib_dirs) {
  const jaxmlp::CublasApi& api = jaxmlp::LoadCublas(lib_dirs);
  nb::dict d;
  int device = 0, major = 0, minor = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) == cudaSuccess && cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    major = prop.major, minor = prop.minor;
    d["device_name"] = std::string(prop.name);
  }
  d["compute_capability"] = std::to_string(major) + "." + std::to_string(minor);
  d["cuda_architectures"] = JAXMLP_CUDA_ARCHITECTURES;  // those this module was compiled for
  d["cublaslt_version"] = api.lt_version;
  d["cublaslt_library"] = api.lt_path;
  if (!api.error.empty()) d["cublas_error"] = api.error;
  std::string reason;
  bool ok = api.error.empty() && jaxmlp::GroupedPathAvailable(&reason);
  d["grouped_available"] = ok;
  d["grouped_reason"] = api.error.empty() ? reason : api.error;
  d["tiled_available"] = jaxmlp::TiledPathAvailable(&reason);
  d["tiled_reason"] = reason;
  return d;
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxmlp_mlp_fwd_grouped"] = Capsule(MlpForwardGrouped);
    d["jaxmlp_mlp_fwd_fallback"] = Capsule(MlpForwardFallback);
    d["jaxmlp_mlp_bwd_grouped"] = Capsule(MlpBackwardGrouped);
    d["jaxmlp_mlp_bwd_fallback"] = Capsule(MlpBackwardFallback);
    d["jaxmlp_gemm_grouped"] = Capsule(GemmGrouped);
    d["jaxmlp_gemm_fallback"] = Capsule(GemmFallback);
    d["jaxmlp_mlp_fwd_tiled"] = Capsule(MlpForwardTiled);
    d["jaxmlp_mlp_bwd_tiled"] = Capsule(MlpBackwardTiled);
    d["jaxmlp_gemm_tiled"] = Capsule(GemmTiled);
    d["jaxmlp_dispatch"] = Capsule(DispatchCuda);
    d["jaxmlp_combine"] = Capsule(CombineCuda);
    d["jaxmlp_combine_bwd"] = Capsule(CombineBackwardCuda);
    return d;
  });
  m.def("handler_host_calls", []() { return jaxmlp::handler_host_calls.load(); },
        "How often the CUDA handlers' host code ran (a command-buffer replay does not run it).");
  m.def("status", &Status, nb::arg("lib_dirs"),
        "Loads cuBLAS (a copy already in the process first, then lib_dirs) and reports versions and paths.");
  m.def(
      "mlp_workspace_bytes",
      [](const std::string& path, bool forward, int64_t M, int64_t d, int64_t f, int64_t F1, int64_t E,
         int dtype_code, bool biases) {
        jaxmlp::MlpDims dims{M, d, f, F1, E, biases, biases, false};
        return jaxmlp::MlpWorkspaceBytes(PathOf(path), forward, dims, dtype_code == 0 ? 4 : 2);
      },
      "Scratch bytes of one grouped-MLP call on a GEMM path (dtype_code: 0 float32, 1 bfloat16, 2 float16; "
      "biases: b1 or b2 given).");
  m.def(
      "gemm_workspace_bytes",
      [](const std::string& path, int64_t E) {
        return jaxmlp::GroupedGemmsWorkspaceBytes(PathOf(path), E, /*split_k=*/false);  // one launch per call
      },
      nb::arg("path"), nb::arg("E"), "Scratch bytes of one grouped GEMM call over E groups on a GEMM path.");
  m.def("dispatch_workspace_bytes", &jaxmlp::DispatchWorkspaceBytes, nb::arg("choices"), nb::arg("E"),
        "Scratch bytes of one dispatch call over `choices` = T * k routing choices and E experts.");
}
