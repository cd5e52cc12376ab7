// Python module jaxmlp._cpu: the CPU handlers as capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* MlpForwardCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* MlpBackwardCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* GemmCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* DispatchCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* CombineCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* CombineBackwardCpu(XLA_FFI_CallFrame*);

namespace {
template <typename F>
nb::capsule Capsule(F* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxmlp_mlp_fwd"] = Capsule(MlpForwardCpu);
    d["jaxmlp_mlp_bwd"] = Capsule(MlpBackwardCpu);
    d["jaxmlp_gemm"] = Capsule(GemmCpu);
    d["jaxmlp_dispatch"] = Capsule(DispatchCpu);
    d["jaxmlp_combine"] = Capsule(CombineCpu);
    d["jaxmlp_combine_bwd"] = Capsule(CombineBackwardCpu);
    return d;
  });
}
