// The engine's entry points (cutlass_grouped.h): what it serves, where it runs, and the dispatch of a
// product to its kernel (cutlass_grouped_<op>.cu). Built without CUTLASS's headers (JAXMLP_WITH_CUTLASS
// undefined), the engine reports itself unavailable and runs nothing.
#include "cuda/gemm/cutlass_grouped.h"

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/launch.cuh"

namespace jaxmlp {

// Per SM the epilogue keeps three TMA descriptors (128 bytes each: C, and D for each of its two consumer
// warpgroups) in the workspace: 1 MiB covers 2730 SMs (Launch checks the kernel's own count).
size_t CutlassWorkspaceBytes() { return size_t(1) << 20; }

bool CutlassSupports(const GemmSpec& s) {
  const auto sixteen_bit = [](ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F16; };
  const bool beta = s.beta == 0.0f || s.beta == 1.0f;
  if (s.in_type == kFp8)
    return s.op == GemmOp::kNT && s.scaling == Fp8Scaling::kTensor && s.lhs_scale && s.rhs_scale &&
           sixteen_bit(s.out_type) && s.K % 16 == 0 && s.N % 16 == 0 && beta && !s.gather;
  const bool op = s.op == GemmOp::kNN || s.op == GemmOp::kNT;
  return sixteen_bit(s.in_type) && s.out_type == s.in_type && op && s.K % 8 == 0 && s.N % 8 == 0 && beta;
}

// FC2's data gradient takes the activation's backward only where its reduction (d, the spec's N) is long:
// the epilogue (h's loads, dh's and a_s's stores and the activation, by one warpgroup) takes longer than a
// 128 x 128 tile's main loop over d = 2048 on an H200, so the ping-pong kernel no longer hides it, and the
// product slows by more than the activation pass costs (gated, d = 2048: 267 us against 165 + 72; d = 4096
// and 7168: 8% and 6% faster than the product and the pass; docs/engine-performance.md). An ungated activation's
// pass is cheaper (h and dh f wide, not 2 f), and its epilogue pays later: at d = 4096 2-11% slower than the
// product and the pass, at 7168 3% faster (gelu, H200).
constexpr int32_t kGatedDgradMinReduction = 4096, kUngatedDgradMinReduction = 7168;

bool CutlassFusesActivation(const GemmSpec& s, Act act) {
  if (!CutlassSupports(s) || s.in_type == kFp8 || s.beta != 0.0f) return false;
  if (s.op == GemmOp::kNT)
    return s.K % 64 == 0 && s.N >= (IsGated(act) ? kGatedDgradMinReduction : kUngatedDgradMinReduction);
  return IsGated(act) ? s.N % 128 == 0 : s.N % 64 == 0 && !s.gather;
}

bool CutlassPathAvailable(int device, std::string* reason) {
#ifndef JAXMLP_WITH_CUTLASS
  (void)device;
  return *reason = "built without CUTLASS's headers (the nvidia-cutlass wheel)", false;
#else
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // a query: leave no error behind for the next launch to report
    return *reason = "no CUDA device", false;
  }
  if (major != 9 || minor != 0)
    return *reason = "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
                     ": jaxmlp's CUTLASS engine is built for Hopper (sm_90a) only", false;
  return *reason = "jaxmlp's CUTLASS grouped GEMM (sm_90a)", true;
#endif
}

ffi::Error RunCutlass(cudaStream_t stream, int device, const GemmSpec& s, int64_t E, int64_t rows,
                      const int64_t* offsets, const CutlassProblems& problems, void** out_ptrs, void* workspace,
                      const CutlassActivation* activation) {
#ifndef JAXMLP_WITH_CUTLASS
  (void)stream, (void)device, (void)s, (void)E, (void)rows, (void)offsets, (void)problems, (void)out_ptrs;
  (void)workspace, (void)activation;
  return ffi::Error::Internal("jaxmlp: built without the CUTLASS engine");
#else
  if (!CutlassSupports(s)) return ffi::Error::Internal("jaxmlp: a product the CUTLASS engine does not serve");
  if (activation && !CutlassFusesActivation(s, activation->act.act))
    return ffi::Error::Internal("jaxmlp: an activation the CUTLASS engine does not fuse");
  // The kernels are persistent: a CTA per SM, which the scheduler needs to know.
  const int sm_count = MultiProcessorCount(device);
  if (sm_count <= 0) return ffi::Error::Internal("jaxmlp: cannot query the SM count of CUDA device " +
                                                 std::to_string(device));
  const bool bf16 = s.out_type == ffi::DataType::BF16, fp8 = s.in_type == kFp8;  // (kFp8NT's dispatch below)
  if (s.gather && (!activation || s.op != GemmOp::kNN))
    return ffi::Error::Internal("jaxmlp: the engine gathers FC1's rows with its activation only");
  const CutlassLaunch l{stream, device, sm_count, E, bf16, s.lhs_scale, s.rhs_scale, s.lhs, s.rhs, rows, s.K,
                        s.N, offsets, &problems, out_ptrs, s.beta, workspace, s.out, activation, s.gather,
                        s.gather_div, s.sources};
  const bool gated = activation && IsGated(activation->act.act);
  CutlassKernel kernel = s.op == GemmOp::kNN ? CutlassKernel::kNN : CutlassKernel::kNT;
  if (fp8) kernel = CutlassKernel::kFp8NT;
  else if (s.gather) kernel = CutlassKernel::kGatedFc1Gathered;
  else if (activation && s.op == GemmOp::kNT)
    kernel = gated ? CutlassKernel::kGatedDgrad : CutlassKernel::kUngatedDgrad;
  else if (activation) kernel = gated ? CutlassKernel::kGatedFc1 : CutlassKernel::kUngatedFc1;
  ++cutlass_launches[int(kernel)];
  switch (kernel) {
    case CutlassKernel::kFp8NT: return s.fast_accumulation ? RunCutlassFp8NTFast(l) : RunCutlassFp8NT(l);
    case CutlassKernel::kGatedFc1Gathered: return RunCutlassGatedFc1Gathered(l);
    case CutlassKernel::kGatedDgrad: return RunCutlassGatedDgrad(l);
    case CutlassKernel::kUngatedDgrad: return RunCutlassUngatedDgrad(l);
    case CutlassKernel::kGatedFc1: return RunCutlassGatedFc1(l);
    case CutlassKernel::kUngatedFc1: return RunCutlassUngatedFc1(l);
    case CutlassKernel::kNN: return RunCutlassNN(l);
    default: return RunCutlassNT(l);
  }
#endif
}

}  // namespace jaxmlp
