// Python module jaxmlp._cpu: the CPU handlers of ffi/targets.inc as capsules for
// jax.ffi.register_ffi_target, and the codes of the Python-C++ contract (codes.h) as Python enums.
#include <nanobind/nanobind.h>

#include "codes_binding.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

#define JAXMLP_GEMM_TARGET(name, cpu, cuda) extern "C" XLA_FFI_Error* cpu(XLA_FFI_CallFrame*);
#define JAXMLP_TARGET(name, cpu, cuda) extern "C" XLA_FFI_Error* cpu(XLA_FFI_CallFrame*);
#define JAXMLP_CUDA_TARGET(name, cuda)  // none on the CPU
#include "targets.inc"
#undef JAXMLP_GEMM_TARGET
#undef JAXMLP_TARGET
#undef JAXMLP_CUDA_TARGET

namespace {
nb::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) { return nb::capsule(reinterpret_cast<void*>(fn)); }
}  // namespace

NB_MODULE(_cpu, m) {
  jaxmlp::BindCodes(m);
  m.def("registrations", []() {
    nb::dict d;
#define JAXMLP_GEMM_TARGET(name, cpu, cuda) d[name] = Capsule(cpu);
#define JAXMLP_TARGET(name, cpu, cuda) d[name] = Capsule(cpu);
#define JAXMLP_CUDA_TARGET(name, cuda)
#include "targets.inc"
#undef JAXMLP_GEMM_TARGET
#undef JAXMLP_TARGET
#undef JAXMLP_CUDA_TARGET
    return d;
  });
}
