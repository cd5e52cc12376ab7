// jaxmlp's grouped GEMM engine on Hopper (sm_90a): CUTLASS 3.x's persistent, warp-specialized ptr-array
// kernel (ping-pong: one consumer warpgroup's epilogue runs under the other's main loop; wgmma, TMA stores)
// with a main loop of our own (cutlass_varlen_mainloop.cuh) that loads every group's operands through one TMA
// descriptor per operand, so that no descriptor is rewritten inside the kernel. Group sizes stay on the
// device: each group's problem shape, row offset and output pointer come from GroupedGemms' setup kernel, so
// a call never syncs and can be captured in a CUDA graph. The kernels are instantiated from the headers of
// the nvidia-cutlass wheel (a build requirement), one translation unit per GemmOp (cutlass_grouped_<op>.cu),
// for sm_90a only.
//
// The engine serves the products whose ragged dimension is the rows (problem M x N x K per group, row-major):
//   kNN: (c_g, N, K)  A = lhs rows [c_g, K] (K-major)     B = rhs[g] [K, N] (N-major)  D = out rows [c_g, N]
//   kNT: (c_g, K, N)  A = lhs rows [c_g, N] (N-major: the reduction)  B = rhs[g] [K, N] (reduction-major)
// A group with no rows gets the problem (0, N, K), which has no tiles: nothing is read or written for it.
// kNT also takes the tensorwise FP8 recipe's products: e4m3 operands (both reduction-major, as FP8 wgmma needs
// them), out = (lhs_scale rhs_scale) A B in bfloat16 or float16 (+ beta out).
// FC1 can take the activation in its epilogue, and FC2's data gradient the activation's backward
// (CutlassActivation), which no cuBLASLt grouped GEMM can.
// The weight gradients (kTN, ragged in the reduction) run on cuBLASLt's grouped GEMM, faster than CUTLASS's
// ptr-array kernel at every measured shape (docs/engine-performance.md, "The engine against cuBLASLt").
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "checks.h"
#include "codes.h"

namespace jaxmlp {

// The engine's kernels by what they compute, and how often RunCutlass enqueued each (its host code: a
// command-buffer replay does not count): tests read them (jaxmlp._cuda.cutlass_launches) to see that a
// product ran the kernel its path promises, the activation in an epilogue where the results could not tell.
enum class CutlassKernel : int {
  kNN, kNT, kGatedFc1, kUngatedFc1, kGatedFc1Gathered, kGatedDgrad, kUngatedDgrad, kFp8NT, kCount
};
inline constexpr const char* kCutlassKernelNames[] = {"nn", "nt", "gated_fc1", "ungated_fc1", "gated_fc1_gathered",
                                                      "gated_dgrad", "ungated_dgrad", "fp8_nt"};
static_assert(sizeof(kCutlassKernelNames) / sizeof(kCutlassKernelNames[0]) == size_t(CutlassKernel::kCount));
inline std::atomic<int64_t> cutlass_launches[int(CutlassKernel::kCount)];

struct GemmSpec;

// The device arrays of one product that the setup kernel writes for the engine: per group the problem
// shape (3 int32: M, N, K) and the leading dimension of D (int64; the other strides of CUTLASS's ptr-array
// layout are static). The output pointers are GroupArrays::ptrs' D (ptrs[2]); the operands' rows start at
// GroupArrays::offsets.
struct CutlassProblems {
  int32_t* shapes;  // [E][3]
  int64_t* ldd;     // [E]
};

// Writes product s's problem of group g (c rows) into p; called by the setup kernel for kNN and kNT.
__host__ __device__ inline void WriteCutlassProblem(const CutlassProblems& p, int64_t g, int64_t c, GemmOp op,
                                                    int64_t K, int64_t N) {
  const int64_t n = op == GemmOp::kNN ? N : K, k = op == GemmOp::kNN ? K : N;
  p.shapes[3 * g + 0] = int32_t(c), p.shapes[3 * g + 1] = int32_t(n), p.shapes[3 * g + 2] = int32_t(k);
  p.ldd[g] = n;
}

// Bytes of the engine's kernel workspace (its epilogue's per-SM TMA descriptors), an upper bound for any
// device.
size_t CutlassWorkspaceBytes();

// Whether the engine serves product s: 16-bit inputs with the output in the same type, kNN or kNT, K and N
// multiples of 8 (16-byte rows for TMA), beta 0 or 1; or a tensorwise FP8 kNT product (e4m3 inputs, their
// scales device floats, the output bfloat16 or float16), K and N multiples of 16. Others run on cuBLASLt.
bool CutlassSupports(const GemmSpec& s);

// Whether the engine can run on CUDA device `device` (compute capability 9.0 and a build that holds its
// kernels), and if not, why.
bool CutlassPathAvailable(int device, std::string* reason);

// The partial sums of one row's scale gradient that FC2's data-gradient epilogue leaves: one per 128-column
// tile of f.
__host__ __device__ inline int64_t ScaleGradientParts(int64_t f) { return (f + 127) / 128; }

// The MLP's activation in a product's epilogue (cutlass_activation_epilogue.cuh), for two of its products:
//   FC1 (kNN, N = 2 f gated, else f): the product writes h (with b1: h + b1[g], each rounded, as the
//     activation pass adds it to the stored product) and, for every row in a group, a = act(h) *
//     scales[row] (gated: act(gate, up)): the activation forward (ActivationForward).
//   FC2's data gradient (kNT, da = dy w2^T, K = f): for every row in a group,
//     dh = da * scales[row] * act'(h) (dh may be h), a_s = act(h) * scales[row] in the product's output
//     instead of da, and with scales the partial sums of da * act(h) per row and 128 columns,
//     ds_parts[row, ceil(f / 128)]: what ActivationBackward computes from da, but the scales' gradients,
//     which it then adds from ds_parts.
struct CutlassActivation {
  ActParams act;
  const void* scales;  // [rows], or null
  void* a;             // FC1: [rows, f]
  const void* b1;      // FC1: [E, N], or null
  const void* h;       // FC2's data gradient: [rows, 2 f] FC1's output (ungated: [rows, f])
  void* dh;            // FC2's data gradient: h's shape
  float* ds_parts;     // FC2's data gradient with scales: [rows, ceil(f / 128)]; else null
};

// Whether the engine runs product s with activation `act` in its epilogue: beta 0 (no output to add to),
// and either FC1 (kNN; gated: f = N / 2 a multiple of 64, so that each 128-column tile holds 64 gate and 64
// up columns; ungated: f = N a multiple of 64, whole 64-column pieces; rows gathered: gated only) or FC2's
// data gradient (kNT, f = K a multiple of 64: whole 64-column pieces; d = N at least 4096, ungated 7168,
// where the main loop hides the epilogue: cutlass_grouped.cu).
bool CutlassFusesActivation(const GemmSpec& s, Act act);

// What one launch of a kernel needs, from RunCutlass.
struct CutlassLaunch {
  cudaStream_t stream;
  int device, sm_count;
  int64_t E;
  bool bf16;  // the output (and 16-bit operands'), else float16
  // FP8 (kFp8NT): the e4m3 operands' dequantization scales (one device float each).
  const float* lhs_scale;
  const float* rhs_scale;
  const void* lhs;  // [rows, K] (kNN) or [rows, N] (kNT), the groups' rows in order
  const void* rhs;  // [E, K, N]
  int64_t rows, K, N;
  const int64_t* offsets;  // [E] each group's first row of lhs and out
  const CutlassProblems* problems;
  void** out_ptrs;  // [E] each group's first output row
  float beta;
  void* workspace;
  void* out;  // the output's first row (the activation epilogues' h or a_s)
  const CutlassActivation* activation;  // null, or the activation epilogue's
  // Gathered FC1 (GemmSpec::gather): lhs is `sources` tokens, row r of the product token gather[r] /
  // gather_div (zeros where gather[r] < 0); else gather is null.
  const int32_t* gather;
  int32_t gather_div;
  int64_t sources;
};

// The kernels of each op (cutlass_grouped_<op>.cu, cutlass_gated_fc1*.cu, cutlass_ungated_fc1.cu,
// cutlass_gated_dgrad.cu, cutlass_ungated_dgrad.cu), built with CUTLASS's headers.
ffi::Error RunCutlassNN(const CutlassLaunch& l);
ffi::Error RunCutlassNT(const CutlassLaunch& l);
ffi::Error RunCutlassGatedFc1(const CutlassLaunch& l);
ffi::Error RunCutlassGatedFc1Gathered(const CutlassLaunch& l);
ffi::Error RunCutlassUngatedFc1(const CutlassLaunch& l);
ffi::Error RunCutlassGatedDgrad(const CutlassLaunch& l);
ffi::Error RunCutlassUngatedDgrad(const CutlassLaunch& l);
ffi::Error RunCutlassFp8NT(const CutlassLaunch& l);  // cutlass_fp8_nt.cu
ffi::Error RunCutlassFp8NTFast(const CutlassLaunch& l);  // cutlass_fp8_nt_fast.cu

// Enqueues product s over E groups of `rows` rows on `stream`: offsets and problems as the setup kernel wrote
// them, out_ptrs the product's [E] output pointers, workspace of CutlassWorkspaceBytes(). With `activation`
// (where CutlassFusesActivation), the activation in its epilogue.
ffi::Error RunCutlass(cudaStream_t stream, int device, const GemmSpec& s, int64_t E, int64_t rows,
                      const int64_t* offsets, const CutlassProblems& problems, void** out_ptrs, void* workspace,
                      const CutlassActivation* activation = nullptr);

}  // namespace jaxmlp
