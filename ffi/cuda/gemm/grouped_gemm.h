// Grouped GEMMs over expert-sorted rows, with the group sizes on the device.
//
// One call's products (up to kMaxGemms, all over the same group_sizes) share one setup kernel that reads
// group_sizes, applies the policy of GroupOffsets (group_offsets.h) and writes the per-group dims and pointer
// arrays that cuBLAS reads. Three paths:
//   kGrouped  cuBLASLt grouped GEMM (CUBLASLT_BATCH_MODE_GROUPED): dims and pointers stay on the device,
//             so the call never syncs and can be captured in a CUDA graph.
//   kFallback cublasGemmGroupedBatchedEx: dims come from host arrays, so the group sizes are copied to
//             the host (one sync per call). For a cuBLAS without the grouped GEMM (before 13.4 on Hopper,
//             13.3 on Blackwell; any on other GPUs), float32, and row lengths not multiples of 8.
//   kCutlass  jaxmlp's CUTLASS engine on Hopper (cutlass_grouped.h): dims and pointers on the device as for
//             kGrouped; the products it does not serve (the weight gradients, the blockwise FP8 recipe's
//             products, a float32 output) run on cuBLASLt's.
//   kFused    cuBLASLt's grouped GEMM as kGrouped, except FC1's product (kNN) where the engine computes the
//             activation in its epilogue (FusesActivation), which no cuBLASLt grouped GEMM can: the
//             engine's plain products trail cuBLASLt's by 1-6%, its fused FC1 saves the activation pass.
//   kTiled    jaxmlp's own kernel (tiled_gemm.h) for small problems, where cuBLAS's fixed cost per
//             product dominates: no setup kernel, no sync, no zeroing kernel, independent products in
//             one launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "checks.h"
#include "codes.h"
#include "cuda/gemm/cublas_api.h"
#include "cuda/gemm/cutlass_grouped.h"

namespace jaxmlp {

constexpr int kMaxGemms = 4;

enum class GemmPath { kGrouped, kFallback, kTiled, kCutlass, kFused };

// Carves aligned sub-buffers out of the workspace XLA passes as a result buffer. With a null base it only
// counts, so the same code computes the size Python must request (module.cc) and the layout in a call.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* Take(size_t count) {
    size_t offset = (used_ + 255) / 256 * 256;
    used_ = offset + count * sizeof(T);
    return base_ ? reinterpret_cast<T*>(base_ + offset) : nullptr;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// Whether the workspace result XLA passed holds what the Carver took from it.
inline ffi::Error CheckWorkspace(const Carver& c, const ffi::AnyBuffer& ws) {
  if (c.used() <= ws.size_bytes()) return ffi::Error::Success();
  return ffi::Error::InvalidArgument("jaxmlp: workspace of " + std::to_string(ws.size_bytes()) + " bytes, need " +
                                     std::to_string(c.used()));
}

// cuBLASLt workspace; 32 MiB is what cuBLAS recommends on Hopper.
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

// How an FP8 product's operands are scaled (GemmSpec::lhs_scale, rhs_scale):
//   kTensor  one float per operand for all groups (SCALAR_32F);
//   kBlocks  the blockwise recipe's power-of-two block scales (jaxmlp/fp8/blockwise.py), which cuBLASLt
//            reads per group through pointer arrays the setup kernel writes:
//            kNT       lhs rows in 1x128 blocks along the reduction (VEC128_32F), lhs_scale in the layout of
//                      Vec128Base; rhs[g] [K, N] in 128x128 blocks (BLK128x128_32F), rhs_scale
//                      [E, ceil(K / 128), round_up(ceil(N / 128), 4)];
//            kTNPadded both operands in 1x128 blocks along the tokens (VEC128_32F), each group's columns
//                      starting at a multiple of 128 (PaddedRows with pad 128), scales [ld / 128, rows]
//                      (rows: K for lhs, N for rhs).
enum class Fp8Scaling : int32_t { kTensor = 0, kBlocks = 1 };

// The format of every FP8 operand and copy, and the check of such a buffer's shape and dtype.
constexpr ffi::DataType kFp8 = ffi::DataType::F8E4M3FN;
inline ffi::Error CheckFp8Buffer(const char* name, const ffi::AnyBuffer& buf, std::initializer_list<int64_t> want) {
  return CheckShapeAndType(name, buf, want, kFp8, "dtype float8_e4m3fn");
}

// The FP8 scale blocks' length (VEC128, BLK128x128; jaxmlp.fp8.blockwise.BLOCK), and the blocks of n elements.
constexpr int64_t kScaleBlock = 128;
__host__ __device__ inline int64_t ScaleBlocks(int64_t n) { return (n + kScaleBlock - 1) / kScaleBlock; }

// Where kNT's VEC128 scales of group g (first row `start`, `blocks` blocks per row) begin: cuBLASLt reads
// scale (r, b) of the group at Vec128Base + b * round_up(rows, 4) + r, from a 16-byte aligned start (a
// group's scales at 4-byte alignment fault with a misaligned address). round_up(start + 3 g, 4) leaves
// each group round_up(rows, 4) rows of blocks before the next one's base, so all groups fit in
// blocks * (M + 3 E + 3) floats.
__host__ __device__ inline int64_t Vec128Base(int64_t start, int64_t g, int64_t blocks) {
  return blocks * ((start + 3 * g + 3) / 4 * 4);
}

// One grouped product (GemmOp in codes.h), row-major operands.
struct GemmSpec {
  GemmOp op;
  int32_t K, N;
  const void* lhs;
  const void* rhs;
  void* out;
  ffi::DataType in_type, out_type;
  float beta;  // 0: out = product, 1: out += product (onto a prefilled bias)
  // Operands that are inputs of the FFI call, which none of the call's kernels writes: the tiled path
  // starts copying them before the kernel ahead of it on the stream has finished.
  bool lhs_is_input = false, rhs_is_input = false;
  // FP8 (in_type F8E4M3FN; cuBLASLt's grouped GEMM, and the engine for kTensor kNT products): device
  // pointers to the operands' dequantization scales (see Fp8Scaling), and whether to use the faster, less
  // precise FP8 accumulation.
  const float* lhs_scale = nullptr;
  const float* rhs_scale = nullptr;
  bool fast_accumulation = false;
  Fp8Scaling scaling = Fp8Scaling::kTensor;
  // A gathered FC1 (kNN on the engine, with its activation: RunWithActivation only): lhs holds `sources`
  // tokens, and row r of the product is token gather[r] / gather_div (zeros where gather[r] < 0 or the token
  // lies past the tokens), read in the engine's loads (cutlass_varlen_mainloop.cuh); null: lhs is the rows.
  const int32_t* gather = nullptr;
  int32_t gather_div = 1;
  int64_t sources = 0;
};

// Leading dimension of the kTNPadded operands of a call over M rows and E groups, where each group's
// columns start at a multiple of `pad` (16: 16-byte aligned FP8 rows; 128: whole blocks of the blockwise
// recipe): room for every group's rows rounded up to pad, itself a multiple of pad.
inline int64_t PaddedRows(int64_t M, int64_t E, int64_t pad = 16) { return (M + (pad - 1) * E + pad - 1) / pad * pad; }

// Device arrays written by the setup kernel.
struct GroupArrays {
  int32_t* counts;   // [E] rows of each group after the policy
  int64_t* offsets;  // [E + 1] first row of each group; offsets[E] = rows in use
  int32_t* dims;     // [kMaxGemms][2][E]: K and N repeated per group (cuBLASLt reads dims from arrays)
  void** ptrs;       // [kMaxGemms][3][E]: cuBLAS A, B and D pointers per group
  void** scale_ptrs;  // [kMaxGemms][2][E]: cuBLAS A and B scale pointers per group (Fp8Scaling::kBlocks)
  int32_t* padded;   // [2][E]: kTNPadded's group sizes rounded up to 16, and its leading dimension
  int64_t* padded_starts;  // [E + 1]: kTNPadded's first column of each group (group sizes rounded up to the
                           // pad); padded_starts[E]: the end of the last one
  CutlassProblems cutlass[kMaxGemms];  // kCutlass, kFused: each product's problems; null elsewhere
};

// The grouped products of one FFI call, on one stream.
class GroupedGemms {
 public:
  // Takes its arrays and the cuBLAS workspace from `ws`; on the tiled path with split_k also the 4 MiB
  // split-K scratch, which only a call with more than one launch uses (see RunTiledGemms). `device` is
  // the call's (ffi::DeviceOrdinal): it keys the cuBLAS handles and plans and the per-kernel queries.
  GroupedGemms(GemmPath path, cudaStream_t stream, int device, const int32_t* group_sizes, int64_t E, int64_t M,
               bool split_k, Carver& ws);

  // Writes the dims and pointer arrays of all products (one kernel launch); on the fallback path also
  // copies group_sizes to the host and waits for it. The tiled path launches nothing here. padded_layout:
  // also padded_starts() (16-row padding) without a kTNPadded product, for a layout that a later call's
  // products read (the FP8 forward's transposed x).
  ffi::Error Prepare(std::initializer_list<GemmSpec> specs, bool padded_layout = false);
  // Enqueues product i of Prepare's list.
  ffi::Error Run(int i);
  // Whether product i runs with the activation in its epilogue (CutlassFusesActivation: on the kCutlass
  // path, and on kFused for kNN), and RunWithActivation enqueues it so.
  bool FusesActivation(int i, Act act) const;
  ffi::Error RunWithActivation(int i, const CutlassActivation& activation);
  // Enqueues products none of which reads another's output (nor writes memory another reads or writes):
  // one launch on the tiled path, in no order between them. The cuBLAS paths enqueue them one by one in
  // the list's order, which must not be relied on: a caller whose products depend on each other calls Run
  // for each in turn.
  ffi::Error RunIndependent(std::initializer_list<int> products);
  // Writes zeros to out[g] of the given kTN products for every group with no rows (cuBLAS may leave them
  // unwritten), in one launch. Nothing to do on the tiled path, which writes them itself.
  ffi::Error ZeroEmptyGroups(std::initializer_list<int> products);
  // Writes zeros to the rows past the groups (padding) of kNN/kNT product i's output, which cuBLAS
  // leaves alone. Nothing to do on the tiled path, which writes them itself.
  ffi::Error ZeroPaddingRows(int i);

  // Device pointer; valid once Prepare (cuBLAS paths) or the first Run (tiled path) is enqueued.
  const int64_t* offsets() const { return arrays_.offsets; }
  // Device pointer, where Prepare had a kTNPadded product or padded_layout: each group's first column in
  // the padded operands, and at [E] the end of the last group's.
  const int64_t* padded_starts() const { return arrays_.padded_starts; }

 private:
  ffi::Error RunGrouped(const GemmSpec& s, int i);
  ffi::Error RunFallback(const GemmSpec& s, int i);
  ffi::Error RunCutlassOrGrouped(const GemmSpec& s, int i);

  GemmPath path_;
  cudaStream_t stream_;
  int device_;
  const int32_t* group_sizes_;
  int64_t E_, M_;
  GroupArrays arrays_;
  void* cublas_ws_;
  void* cutlass_ws_;  // kCutlass, kFused: the engine's workspace (CutlassWorkspaceBytes), else null
  int32_t* split_arrivals_;  // tiled path with split_k: the split-K scratch (TiledGroups), else null
  float* split_partials_;
  GemmSpec specs_[kMaxGemms];
  int num_specs_ = 0;
  int tiled_launches_ = 0;
  std::vector<int64_t> host_offsets_;  // fallback path only
};

// Bytes GroupedGemms takes from a Carver.
size_t GroupedGemmsWorkspaceBytes(GemmPath path, int64_t E, bool split_k);

// Whether the cuBLASLt grouped GEMM can run on CUDA device `device` (an ordinal, as ffi::DeviceOrdinal: not
// the calling thread's current device, which on a host with mixed GPUs may be another), and if not, why.
bool GroupedPathAvailable(int device, std::string* reason);

}  // namespace jaxmlp
