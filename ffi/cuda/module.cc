// Python module jaxmlp._cuda: the CUDA handlers of ffi/targets.inc as capsules, the workspace sizes
// Python must request, and what backend_info() reports (cuBLAS version, device, whether the grouped and
// tiled paths can run).
#include <cuda_runtime.h>

#include <stdexcept>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "codes.h"
#include "mlp_checks.h"
#include "cuda/gemm/cublas_api.h"
#include "cuda/handler.h"
#include "cuda/moe/dispatch_kernels.h"
#include "cuda/gemm/cutlass_grouped.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/tiled_gemm.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

#define JAXMLP_GEMM_TARGET(name, cpu, cuda)                \
  extern "C" XLA_FFI_Error* cuda##Grouped(XLA_FFI_CallFrame*);  \
  extern "C" XLA_FFI_Error* cuda##Tiled(XLA_FFI_CallFrame*);    \
  extern "C" XLA_FFI_Error* cuda##Fallback(XLA_FFI_CallFrame*); \
  extern "C" XLA_FFI_Error* cuda##Cutlass(XLA_FFI_CallFrame*);  \
  extern "C" XLA_FFI_Error* cuda##Fused(XLA_FFI_CallFrame*);
#define JAXMLP_TARGET(name, cpu, cuda) extern "C" XLA_FFI_Error* cuda(XLA_FFI_CallFrame*);
#define JAXMLP_CUDA_TARGET(name, cuda) JAXMLP_TARGET(name, , cuda)
#include "targets.inc"
#undef JAXMLP_GEMM_TARGET
#undef JAXMLP_TARGET
#undef JAXMLP_CUDA_TARGET

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) { return nb::capsule(reinterpret_cast<void*>(fn)); }

jaxmlp::GemmPath PathOf(const std::string& path) {
  if (path == "grouped") return jaxmlp::GemmPath::kGrouped;
  if (path == "tiled") return jaxmlp::GemmPath::kTiled;
  if (path == "fallback") return jaxmlp::GemmPath::kFallback;
  if (path == "cutlass") return jaxmlp::GemmPath::kCutlass;
  if (path == "fused") return jaxmlp::GemmPath::kFused;
  throw std::invalid_argument("jaxmlp: unknown GEMM path '" + path +
                              "': expected grouped, tiled, fallback, cutlass or fused");
}

// What backend_info() and the trace-time path choice read, about CUDA device `device` (an ordinal, as JAX's
// device.id on a one-process host; 0 by default): not the thread's current device, which on a host with
// mixed GPUs need not be the one a call runs on.
nb::dict Status(const std::vector<std::string>& lib_dirs, int device) {
  const jaxmlp::CublasApi& api = jaxmlp::LoadCublas(lib_dirs);
  nb::dict d;
  int major = 0, minor = 0;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    major = prop.major, minor = prop.minor;
    d["device_name"] = std::string(prop.name);
  } else {
    cudaGetLastError();  // a query: leave no error behind
  }
  d["device"] = device;
  d["compute_capability"] = std::to_string(major) + "." + std::to_string(minor);
  d["cuda_architectures"] = JAXMLP_CUDA_ARCHITECTURES;  // those this module was compiled for
  d["cublaslt_version"] = api.lt_version;
  d["cublaslt_library"] = api.lt_path;
  if (!api.error.empty()) d["cublas_error"] = api.error;
  std::string reason;
  bool ok = api.error.empty() && jaxmlp::GroupedPathAvailable(device, &reason);
  d["grouped_available"] = ok;
  d["grouped_reason"] = api.error.empty() ? reason : api.error;
  d["tiled_available"] = jaxmlp::TiledPathAvailable(device, &reason);
  d["tiled_reason"] = reason;
  d["cutlass_available"] = jaxmlp::CutlassPathAvailable(device, &reason);
  d["cutlass_reason"] = reason;
  return d;
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
#define JAXMLP_GEMM_TARGET(name, cpu, cuda)    \
  d[name "_grouped"] = Capsule(cuda##Grouped);   \
  d[name "_tiled"] = Capsule(cuda##Tiled);       \
  d[name "_fallback"] = Capsule(cuda##Fallback); \
  d[name "_cutlass"] = Capsule(cuda##Cutlass);   \
  d[name "_fused"] = Capsule(cuda##Fused);
#define JAXMLP_TARGET(name, cpu, cuda) d[name] = Capsule(cuda);
#define JAXMLP_CUDA_TARGET(name, cuda) JAXMLP_TARGET(name, , cuda)
#include "targets.inc"
#undef JAXMLP_GEMM_TARGET
#undef JAXMLP_TARGET
#undef JAXMLP_CUDA_TARGET
    return d;
  });
  m.def("handler_host_calls", []() { return jaxmlp::handler_host_calls.load(); },
        "How often the CUDA handlers' host code ran (a command-buffer replay does not run it).");
  m.def("cutlass_launches", []() {
          nb::dict d;
          for (int k = 0; k < int(jaxmlp::CutlassKernel::kCount); ++k)
            d[jaxmlp::kCutlassKernelNames[k]] = jaxmlp::cutlass_launches[k].load();
          return d;
        },
        "How often the CUTLASS engine's handlers enqueued each of its kernels, by name (host code, as "
        "handler_host_calls).");
  m.def("status", &Status, nb::arg("lib_dirs"), nb::arg("device") = 0,
        "Loads cuBLAS (a copy already in the process first, then lib_dirs) and reports versions and paths, and "
        "the facts and GEMM paths of CUDA device `device` (an ordinal; default 0).");
  m.def(
      "mlp_workspace_bytes",
      [](const std::string& path, bool forward, int64_t M, int64_t d, int64_t f, int64_t F1, int64_t E,
         int dtype_code, bool biases) {
        jaxmlp::MlpDims dims{M, d, f, F1, E, biases, biases, false};
        return jaxmlp::MlpWorkspaceBytes(PathOf(path), forward, dims,
                                         jaxmlp::ElementBytes(jaxmlp::DType(dtype_code)));
      },
      "Scratch bytes of one grouped-MLP call on a GEMM path (dtype_code: a jaxmlp._cpu.DType; biases: b1 or b2 "
      "given).");
  m.def(
      "mlp_fp8_workspace_bytes",
      [](bool forward, bool engine, bool fp8_wgrad, int64_t M, int64_t d, int64_t f, int64_t F1, int64_t E,
         int dtype_code, bool has_b1, bool has_b2, bool has_scales) {
        jaxmlp::MlpDims dims{M, d, f, F1, E, has_b1, has_b2, has_scales};
        return jaxmlp::MlpFp8WorkspaceBytes(forward, engine, fp8_wgrad, dims,
                                            jaxmlp::ElementBytes(jaxmlp::DType(dtype_code)));
      },
      "Scratch bytes of one FP8 grouped-MLP call (engine: its row products on the CUTLASS engine; fp8_wgrad: FP8 "
      "weight gradients; dtype_code: jaxmlp._cpu.DType bfloat16 or float16; has_b1, has_b2, has_scales: the biases "
      "and row scales given).");
  m.def("gemm_fp8_blocks_workspace_bytes", &jaxmlp::GemmFp8BlocksWorkspaceBytes, nb::arg("op"), nb::arg("M"),
        nb::arg("E"), nb::arg("N"),
        "Scratch bytes of one block-scaled FP8 product (op: jaxmlp._cpu.GemmOp nt, or tn_padded: tn over padded "
        "columns) of M rows in E groups and reduction N (nt).");
  m.def(
      "gemm_workspace_bytes",
      [](const std::string& path, int64_t E) {
        return jaxmlp::GroupedGemmsWorkspaceBytes(PathOf(path), E, /*split_k=*/false);  // one launch per call
      },
      nb::arg("path"), nb::arg("E"), "Scratch bytes of one grouped GEMM call over E groups on a GEMM path.");
  m.def("dispatch_workspace_bytes", &jaxmlp::DispatchWorkspaceBytes, nb::arg("choices"), nb::arg("E"),
        "Scratch bytes of one dispatch call over `choices` = T * k routing choices and E experts.");
}
