// jaxmlp's grouped GEMM engine on Hopper (sm_90a): CUTLASS 3.x's persistent, warp-specialized ptr-array
// kernels (TMA loads, wgmma, TMA stores), which read each group's problem shape, pointers and leading
// dimensions from device arrays that GroupedGemms' setup kernel writes, so a call never syncs and can be
// captured in a CUDA graph. The kernels are instantiated from the headers of the nvidia-cutlass wheel (a
// build requirement), one translation unit per GemmOp (cutlass_grouped_<op>.cu), for sm_90a only.
//
// Each product runs as one CUTLASS grouped GEMM in row-major terms (problem M x N x K per group):
//   kNN: (c_g, N, K)  A = lhs rows [c_g, K] (K-major)     B = rhs[g] [K, N] (N-major)  D = out rows [c_g, N]
//   kNT: (c_g, K, N)  A = lhs rows [c_g, N] (N-major: the reduction)  B = rhs[g] [K, N] (reduction-major)
//   kTN: (K, N, c_g)  A = lhs rows^T (rows [c_g, K], M-major)  B = rhs rows [c_g, N] (N-major)  D = out[g]
// A group with no rows gets the problem (0, N, K) (kTN: (0, N, 0)), which has no tiles: nothing is read or
// written for it (kTN's out[g] is zeroed by GroupedGemms::ZeroEmptyGroups, as on the cuBLAS paths).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "checks.h"
#include "codes.h"

namespace jaxmlp {

struct GemmSpec;

// The device arrays of one product that the setup kernel writes for the engine: per group the problem
// shape (3 int32: M, N, K) and the leading dimensions of A, B and D (int64 each; the other strides of
// CUTLASS's ptr-array layouts are static). The pointers are GroupArrays::ptrs' (A = ptrs[1], B = ptrs[0],
// D = ptrs[2]: cuBLAS's column-major view swaps the operands).
struct CutlassProblems {
  int32_t* shapes;  // [E][3]
  int64_t* lds;     // [3][E]: A, B, D
};

// Writes product s's problem and leading dimensions of group g (c rows) into p; called by the setup kernel.
__host__ __device__ inline void WriteCutlassProblem(const CutlassProblems& p, int64_t E, int64_t g, int64_t c,
                                                    GemmOp op, int64_t K, int64_t N) {
  int64_t m, n, k, lda, ldb, ldd;
  switch (op) {
    case GemmOp::kNN: m = c, n = N, k = K, lda = K, ldb = N, ldd = N; break;
    case GemmOp::kNT: m = c, n = K, k = N, lda = N, ldb = N, ldd = K; break;
    default:          m = K, n = N, k = c, lda = K, ldb = N, ldd = N; break;  // kTN
  }
  if (c == 0) m = 0;  // no tiles
  p.shapes[3 * g + 0] = int32_t(m), p.shapes[3 * g + 1] = int32_t(n), p.shapes[3 * g + 2] = int32_t(k);
  p.lds[0 * E + g] = lda, p.lds[1 * E + g] = ldb, p.lds[2 * E + g] = ldd;
}

// Bytes of the engine's kernel workspace (its per-SM TMA descriptors), an upper bound for any device.
size_t CutlassWorkspaceBytes();

// Whether the engine serves product s: 16-bit inputs with the output in the same type, kNN, kNT or kTN,
// K and N multiples of 8 (16-byte rows for TMA), beta 0 or 1. Others run on cuBLASLt.
bool CutlassSupports(const GemmSpec& s);

// Whether the engine can run on CUDA device `device` (compute capability 9.0 and a build that holds its
// kernels), and if not, why.
bool CutlassPathAvailable(int device, std::string* reason);

// What one launch of a kernel needs, from RunCutlass.
struct CutlassLaunch {
  cudaStream_t stream;
  int device, sm_count;
  int64_t E;
  bool bf16;  // else float16
  const CutlassProblems* problems;
  void** ptrs;  // [3][E]: cuBLAS's A (our B), B (our A), D
  float beta;
  void* workspace;
};

// The kernels of each op (cutlass_grouped_<op>.cu), built with CUTLASS's headers.
ffi::Error RunCutlassNN(const CutlassLaunch& l);
ffi::Error RunCutlassNT(const CutlassLaunch& l);
ffi::Error RunCutlassTN(const CutlassLaunch& l);

// Enqueues product s over E groups on `stream`: problems as the setup kernel wrote them, ptrs the product's
// [3][E] pointer array, workspace of CutlassWorkspaceBytes().
ffi::Error RunCutlass(cudaStream_t stream, int device, const GemmSpec& s, int64_t E, const CutlassProblems& problems,
                      void** ptrs, void* workspace);

}  // namespace jaxmlp
