// CUDA handlers of the optimizer steps that also write the new weights' FP8 layouts (jaxmlp/fp8/adam.py
// defines them, and its JAX code is the CPU's; the kernels: fp8_adam_kernels.h):
//   block_adam   w, g, mu, nu [E, K, N] float32 (g: or in the attribute dtype), hyper [3] float32 -> w, mu,
//                nu (the new ones, in place where XLA aliases them to the inputs), and the new weights' q,
//                qt, e as Fp8BlockWeights writes them
//   tensor_adam  the same operands and delayed [1] float32 (the last weights' amax) -> w, mu, nu, the new
//                weights' q, qt by that amax, and their own amax [1]
#include <cuda_runtime.h>

#include <utility>

#include "codes.h"
#include "cuda/fp8/fp8_adam_kernels.h"
#include "cuda/fp8/weight_checks.h"
#include "cuda/handler.h"
#include "cuda/launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Error;
using ffi::Result;

// The step's operands and results w, g, mu, nu [E, K, N] float32 (g: or in dtype; results: new w, mu, nu) and
// hyper [3], checked, as the kernels take them; the weights' extents and dtypes. w, mu and nu's results are
// not poisoned: XLA aliases them to the inputs (jaxmlp/fp8/cuda.py), and every element is written.
struct AdamOperands {
  AdamStep step;
  int64_t E, K, N;
  DataType rounded, g;
};

Error CheckAdam(const AnyBuffer& w, const AnyBuffer& g, const AnyBuffer& mu, const AnyBuffer& nu,
                const AnyBuffer& hyper, AnyBuffer& w_out, AnyBuffer& mu_out, AnyBuffer& nu_out, float b1, float b2,
                float one_minus_b1, float one_minus_b2, float eps, float eps_root, float weight_decay, int32_t dtype,
                AdamOperands* o) {
  JAXMLP_RETURN_IF_ERROR(CheckQuantizerInput("w", w, 3));
  const int64_t E = w.dimensions()[0], K = w.dimensions()[1], N = w.dimensions()[2];
  const char* names[] = {"w", "mu", "nu", "new w", "new mu", "new nu"};
  const AnyBuffer* buffers[] = {&w, &mu, &nu, &w_out, &mu_out, &nu_out};
  for (int i = 0; i < 6; ++i)
    JAXMLP_RETURN_IF_ERROR(CheckShapeAndType(names[i], *buffers[i], {E, K, N}, DataType::F32, "float32 [E, K, N]"));
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("hyper", hyper, {3}, DataType::F32, "float32 [3]"));
  DataType rounded;
  JAXMLP_RETURN_IF_ERROR(RoundedType(dtype, &rounded));
  const DataType gt = g.element_type() == DataType::F32 ? DataType::F32 : rounded;
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("g", g, {E, K, N}, gt, "float32 or the dtype, [E, K, N]"));
  const auto in = [](const AnyBuffer& b) { return static_cast<const float*>(b.untyped_data()); };
  const auto out = [](AnyBuffer& b) { return static_cast<float*>(b.untyped_data()); };
  o->step = AdamStep{in(w),      in(mu),       in(nu),       g.untyped_data(), out(w_out), out(mu_out), out(nu_out),
                     in(hyper),  b1,           b2,           one_minus_b1,     one_minus_b2, eps,       eps_root,
                     weight_decay};
  o->E = E, o->K = K, o->N = N, o->rounded = rounded, o->g = gt;
  return Error::Success();
}

Error Fp8BlockAdam(cudaStream_t stream, AnyBuffer w, AnyBuffer g, AnyBuffer mu, AnyBuffer nu, AnyBuffer hyper,
                   Result<AnyBuffer> w_out, Result<AnyBuffer> mu_out, Result<AnyBuffer> nu_out, Result<AnyBuffer> q,
                   Result<AnyBuffer> qt, Result<AnyBuffer> e, float b1, float b2, float one_minus_b1,
                   float one_minus_b2, float eps, float eps_root, float weight_decay, int32_t dtype) {
  ++handler_host_calls;
  AdamOperands o;
  JAXMLP_RETURN_IF_ERROR(CheckAdam(w, g, mu, nu, hyper, *w_out, *mu_out, *nu_out, b1, b2, one_minus_b1, one_minus_b2,
                                   eps, eps_root, weight_decay, dtype, &o));
  JAXMLP_RETURN_IF_ERROR(CheckWeightOutputs(o.E, o.K, o.N, *q, *qt, *e));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*q, &*qt, &*e}));
  return AdamWeightBlocks(stream, o.rounded, o.g, o.step, o.E, o.K, o.N, static_cast<uint8_t*>(q->untyped_data()),
                          static_cast<uint8_t*>(qt->untyped_data()), static_cast<int32_t*>(e->untyped_data()));
}

Error Fp8TensorAdam(cudaStream_t stream, AnyBuffer w, AnyBuffer g, AnyBuffer mu, AnyBuffer nu, AnyBuffer hyper,
                    AnyBuffer delayed, Result<AnyBuffer> w_out, Result<AnyBuffer> mu_out, Result<AnyBuffer> nu_out,
                    Result<AnyBuffer> q, Result<AnyBuffer> qt, Result<AnyBuffer> amax, float b1, float b2,
                    float one_minus_b1, float one_minus_b2, float eps, float eps_root, float weight_decay,
                    int32_t dtype) {
  ++handler_host_calls;
  AdamOperands o;
  JAXMLP_RETURN_IF_ERROR(CheckAdam(w, g, mu, nu, hyper, *w_out, *mu_out, *nu_out, b1, b2, one_minus_b1, one_minus_b2,
                                   eps, eps_root, weight_decay, dtype, &o));
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("delayed", delayed, {1}, DataType::F32, "float32 [1]"));
  JAXMLP_RETURN_IF_ERROR(CheckWeightLayouts(o.E, o.K, o.N, *q, *qt));
  JAXMLP_RETURN_IF_ERROR(CheckShapeAndType("amax", *amax, {1}, DataType::F32, "float32 [1]"));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*q, &*qt}));
  float* am = static_cast<float*>(amax->untyped_data());
  JAXMLP_RETURN_IF_ERROR(CheckCuda(cudaMemsetAsync(am, 0, sizeof(float), stream), "zeroing the amax"));
  return AdamWeightTensor(stream, o.rounded, o.g, o.step, o.E, o.K, o.N,
                          static_cast<const float*>(delayed.untyped_data()), static_cast<uint8_t*>(q->untyped_data()),
                          static_cast<uint8_t*>(qt->untyped_data()), am);
}

// The operands both steps begin with: the stream, then w, g, mu, nu and hyper.
auto BindAdamOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<AnyBuffer>()   // w
      .Arg<AnyBuffer>()   // g
      .Arg<AnyBuffer>()   // mu
      .Arg<AnyBuffer>()   // nu
      .Arg<AnyBuffer>();  // hyper
}

// adam's constants and the computation dtype, after the results.
template <typename Binding>
auto BindAdamAttrs(Binding b) {
  return std::move(b).template Attr<float>("b1")
      .template Attr<float>("b2")
      .template Attr<float>("one_minus_b1")
      .template Attr<float>("one_minus_b2")
      .template Attr<float>("eps")
      .template Attr<float>("eps_root")
      .template Attr<float>("weight_decay")
      .template Attr<int32_t>("dtype");
}

}  // namespace
}  // namespace jaxmlp

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8BlockAdam, jaxmlp::Fp8BlockAdam,
                              jaxmlp::BindAdamAttrs(jaxmlp::BindAdamOperands()
                                                        .Ret<xla::ffi::AnyBuffer>()   // new w
                                                        .Ret<xla::ffi::AnyBuffer>()   // new mu
                                                        .Ret<xla::ffi::AnyBuffer>()   // new nu
                                                        .Ret<xla::ffi::AnyBuffer>()   // q
                                                        .Ret<xla::ffi::AnyBuffer>()   // qt
                                                        .Ret<xla::ffi::AnyBuffer>()),  // e
                              jaxmlp::kGraphSafe);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8TensorAdam, jaxmlp::Fp8TensorAdam,
                              jaxmlp::BindAdamAttrs(jaxmlp::BindAdamOperands()
                                                        .Arg<xla::ffi::AnyBuffer>()   // delayed
                                                        .Ret<xla::ffi::AnyBuffer>()   // new w
                                                        .Ret<xla::ffi::AnyBuffer>()   // new mu
                                                        .Ret<xla::ffi::AnyBuffer>()   // new nu
                                                        .Ret<xla::ffi::AnyBuffer>()   // q
                                                        .Ret<xla::ffi::AnyBuffer>()   // qt
                                                        .Ret<xla::ffi::AnyBuffer>()),  // amax
                              jaxmlp::kGraphSafe);
