// The cuBLAS side of GroupedGemms (grouped_gemm.h): the cuBLASLt grouped GEMM (kGrouped), with its
// handles and per-problem plans, and the cublasGemmGroupedBatchedEx fallback (kFallback). Both read the
// per-group dims and pointers that GroupedGemms::Prepare's setup kernel writes (grouped_gemm.cu).
#include "cuda/gemm/grouped_gemm.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace jaxmlp {
namespace {

cudaDataType CudaType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16:
      return CUDA_R_16BF;
    case ffi::DataType::F16:
      return CUDA_R_16F;
    case ffi::DataType::F8E4M3FN:
      return CUDA_R_8F_E4M3;
    default:
      return CUDA_R_32F;
  }
}

#define JAXMLP_CUBLAS(expr, what)                                                                   \
  do {                                                                                              \
    cublasStatus_t st_ = (expr);                                                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                               \
      return ffi::Error::Internal(std::string("jaxmlp: ") + what + ": " + CublasStatusString(st_)); \
  } while (0)

// ---- cuBLASLt state shared by all calls: a handle per device, descriptors and algorithms per problem --
struct LtKey {
  int device;
  GemmOp op;
  ffi::DataType in, out;
  int32_t K, N, E;
  int64_t avg_rows;
  bool accumulate;
  bool fast_accumulation;
  Fp8Scaling scaling;
  bool operator<(const LtKey& o) const {
    return std::tie(device, op, in, out, K, N, E, avg_rows, accumulate, fast_accumulation, scaling) <
           std::tie(o.device, o.op, o.in, o.out, o.K, o.N, o.E, o.avg_rows, o.accumulate, o.fast_accumulation,
                    o.scaling);
  }
};

struct LtPlan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatmulAlgo_t algo;
};

std::mutex lt_mutex;
std::map<int, cublasLtHandle_t> lt_handles;
std::map<LtKey, LtPlan> lt_plans;
std::map<int, cublasHandle_t> blas_handles;

// The grouped-dims hints are documented as uint32_t; some releases took int64_t, so try both.
cublasStatus_t SetAverageHint(const CublasApi& api, cublasLtMatmulPreference_t pref,
                              cublasLtMatmulPreferenceAttributes_t attr, int64_t value) {
  uint32_t v32 = uint32_t(std::max<int64_t>(value, 1));
  cublasStatus_t st = api.LtMatmulPreferenceSetAttribute(pref, attr, &v32, sizeof(v32));
  if (st == CUBLAS_STATUS_SUCCESS) return st;
  int64_t v64 = std::max<int64_t>(value, 1);
  return api.LtMatmulPreferenceSetAttribute(pref, attr, &v64, sizeof(v64));
}

// A matmul descriptor, destroyed unless a plan keeps it (release()).
struct Desc {
  const CublasApi& api;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatmulDesc_t release() { return std::exchange(desc, nullptr); }
  ~Desc() {
    if (desc) api.LtMatmulDescDestroy(desc);
  }
};

struct Layouts {
  const CublasApi& api;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  ~Layouts() {
    for (auto l : {a, b, d})
      if (l) api.LtMatrixLayoutDestroy(l);
  }
};

// A matmul preference, destroyed at the end of its scope.
struct Preference {
  const CublasApi& api;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Preference() {
    if (pref) api.LtMatmulPreferenceDestroy(pref);
  }
};

// What the heuristic is told about product s: the workspace it may use, how aligned the matrices are,
// and the average group's dims.
ffi::Error SetPreferences(const CublasApi& api, const GemmSpec& s, int64_t avg_rows,
                          cublasLtMatmulPreference_t pref) {
  size_t ws_bytes = kLtWorkspaceBytes;
  JAXMLP_CUBLAS(api.LtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                   sizeof(ws_bytes)), "preference MAX_WORKSPACE_BYTES");
  // The per-group pointers the setup kernel writes (a group may start at any row; rows are multiples of
  // 16 bytes: K and N multiples of 8 16-bit or of 16 FP8 elements) are only sure to be 16-byte aligned,
  // and cuBLASLt cannot look at device pointer arrays from the host. The preference's default assumes
  // 256 bytes, so an algorithm that needs more could be picked; 16 rules those out, and the plan key
  // needs no alignment field.
  const uint32_t align = 16;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    JAXMLP_CUBLAS(api.LtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)), "preference MIN_ALIGNMENT");
  const bool weight_gradient = s.op == GemmOp::kTN || s.op == GemmOp::kTNPadded;
  const int64_t rows_d = s.op == GemmOp::kNT ? s.K : s.N;
  const int64_t cols_d = weight_gradient ? s.K : avg_rows;
  const int64_t reduction = weight_gradient ? avg_rows : (s.op == GemmOp::kNN ? s.K : s.N);
  // The hints only guide the heuristic's choice, and the releases since 13.4 differ in what they take: a
  // release that rejects one still runs every product right, so a rejected hint is left out, not an error.
  SetAverageHint(api, pref, kPrefGroupedAvgRowsD, rows_d);
  SetAverageHint(api, pref, kPrefGroupedAvgColsD, cols_d);
  SetAverageHint(api, pref, kPrefGroupedAvgReductionDim, reduction);
  return ffi::Error::Success();
}

// The matmul descriptor of product s: transposes and, for FP8, the operands' scales: scale_a and scale_b
// are cuBLAS's A and B scale pointers (our rhs and lhs, see RunGrouped), with kBlocks device arrays of a
// pointer per group.
ffi::Error MakeDesc(const CublasApi& api, const GemmSpec& s, const void* scale_a, const void* scale_b,
                    Desc* desc) {
  JAXMLP_CUBLAS(api.LtMatmulDescCreate(&desc->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  cublasOperation_t ta = s.op == GemmOp::kNT ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = s.op == GemmOp::kTN ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (s.op == GemmOp::kTNPadded) ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA");
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB");
  if (s.in_type != ffi::DataType::F8E4M3FN) return ffi::Error::Success();
  // kTensor: one scalar per operand for all groups (SCALAR_32F, the default mode; Hopper's grouped GEMM
  // rejects per-group scalars). kBlocks: the modes and per-group layouts measured in docs/performance.md.
  if (s.scaling == Fp8Scaling::kBlocks) {
    const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, blk = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t a_mode = s.op == GemmOp::kNT ? blk : vec;
    JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)),
                  "A_SCALE_MODE");
    JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, sizeof(vec)),
                  "B_SCALE_MODE");
  }
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a,
                                             sizeof(scale_a)), "A_SCALE_POINTER");
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b,
                                             sizeof(scale_b)), "B_SCALE_POINTER");
  const int8_t fast = s.fast_accumulation;
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
                "FAST_ACCUM");
  return ffi::Error::Success();
}

}  // namespace

bool GroupedPathAvailable(int device, std::string* reason) {
  const CublasApi& api = LoadCublas();
  int major = 0, minor = 0;
  if (!api.error.empty()) return *reason = api.error, false;
  if (!api.LtGroupedMatrixLayoutCreate)
    return *reason = "cuBLASLt " + std::to_string(api.lt_version) + " has no grouped GEMM API", false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // a query: leave no error behind for the next launch to report
    return *reason = "no CUDA device", false;
  }
  // Grouped GEMM kernels exist for Hopper from cuBLAS 13.4 and for Blackwell (10.x) from 13.3. Other
  // GPUs take the fallback rather than risk a call that finds no grouped kernel.
  size_t need = major == 10 ? 130300 : 130400;
  if (major != 9 && major != 10)
    return *reason = "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
                     ": jaxmlp uses the cuBLASLt grouped GEMM on Hopper (9.x) and Blackwell (10.x) only", false;
  if (api.lt_version < need)
    return *reason = "cuBLASLt " + std::to_string(api.lt_version) + " < " + std::to_string(need) +
                     " has no grouped GEMM kernels for compute capability " + std::to_string(major) + "." +
                     std::to_string(minor), false;
  return *reason = "cuBLASLt " + std::to_string(api.lt_version) + " grouped GEMM", true;
}

// Column-major cuBLAS view of each op (c = rows of the group, the varying dim):
//   kNN: D(N x c)  = A(N x K)            * B(K x c)     A = rhs[g], B = lhs rows, D = out rows
//   kNT: D(K x c)  = A(N x K)^T          * B(N x c)     A = rhs[g], B = lhs rows, D = out rows
//   kTN: D(N x K)  = A(N x c)            * B(K x c)^T   A = rhs rows, B = lhs rows, D = out[g]
ffi::Error GroupedGemms::RunGrouped(const GemmSpec& s, int i) {
  const CublasApi& api = LoadCublas();
  if (!api.error.empty()) return ffi::Error::Internal("jaxmlp: " + api.error);
  if (!api.LtGroupedMatrixLayoutCreate) return ffi::Error::Internal("jaxmlp: cuBLASLt grouped GEMM unavailable");
  const int32_t* counts = arrays_.counts;
  const int32_t* K = arrays_.dims + (i * 2 + 0) * E_;
  const int32_t* N = arrays_.dims + (i * 2 + 1) * E_;
  void** ptrs = arrays_.ptrs + i * 3 * E_;
  const cudaDataType in = CudaType(s.in_type), out = CudaType(s.out_type);

  Layouts l{api};
  const int E = int(E_);
  switch (s.op) {
    case GemmOp::kNN:
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.a, in, E, N, K, N), "grouped layout A");
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.b, in, E, K, counts, K), "grouped layout B");
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.d, out, E, N, counts, N), "grouped layout D");
      break;
    case GemmOp::kNT:
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.a, in, E, N, K, N), "grouped layout A");
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.b, in, E, N, counts, N), "grouped layout B");
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.d, out, E, K, counts, K), "grouped layout D");
      break;
    case GemmOp::kTN:
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.a, in, E, N, counts, N), "grouped layout A");
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.b, in, E, K, counts, K), "grouped layout B");
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.d, out, E, N, K, N), "grouped layout D");
      break;
    case GemmOp::kTNPadded: {  // A(c x N)^T, B(c x K), both with the padded leading dimension
      const int32_t* rows = arrays_.padded;
      const int32_t* ld = arrays_.padded + E_;
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.a, in, E, rows, N, ld), "grouped layout A");
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.b, in, E, rows, K, ld), "grouped layout B");
      JAXMLP_CUBLAS(api.LtGroupedMatrixLayoutCreate(&l.d, out, E, N, K, N), "grouped layout D");
      break;
    }
  }

  const int64_t avg_rows = std::max<int64_t>(M_ / E_, 1);
  const LtKey key{device_, s.op, s.in_type, s.out_type, s.K, s.N, E, avg_rows, s.beta != 0.0f, s.fast_accumulation,
                  s.scaling};
  const bool blocks = s.scaling == Fp8Scaling::kBlocks;
  const void* scale_a = blocks ? static_cast<const void*>(arrays_.scale_ptrs + (i * 2 + 0) * E_) : s.rhs_scale;
  const void* scale_b = blocks ? static_cast<const void*>(arrays_.scale_ptrs + (i * 2 + 1) * E_) : s.lhs_scale;
  cublasLtHandle_t handle;
  LtPlan plan;
  {
    std::lock_guard<std::mutex> lock(lt_mutex);
    auto h = lt_handles.find(device_);
    if (h == lt_handles.end()) {
      cublasLtHandle_t created;
      JAXMLP_CUBLAS(api.LtCreate(&created), "cublasLtCreate");
      h = lt_handles.emplace(device_, created).first;
    }
    handle = h->second;
    auto it = lt_plans.find(key);
    if (it == lt_plans.end()) {
      // First call with this problem signature: build the descriptor and ask the heuristic once. Timing
      // its top candidates on the first call instead would tune the plan to that call's group sizes,
      // which later calls with the same signature need not share (docs/performance.md, "Kernel
      // measurements").
      Desc desc{api};
      JAXMLP_RETURN_IF_ERROR(MakeDesc(api, s, scale_a, scale_b, &desc));
      Preference pref{api};
      JAXMLP_CUBLAS(api.LtMatmulPreferenceCreate(&pref.pref), "cublasLtMatmulPreferenceCreate");
      JAXMLP_RETURN_IF_ERROR(SetPreferences(api, s, avg_rows, pref.pref));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      cublasStatus_t st =
          api.LtMatmulAlgoGetHeuristic(handle, desc.desc, l.a, l.b, l.d, l.d, pref.pref, 1, &result, &found);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0)
        return ffi::Error::Internal("jaxmlp: cuBLASLt found no grouped GEMM algorithm for op " +
                                    std::to_string(int(s.op)) + ", K=" + std::to_string(s.K) + ", N=" +
                                    std::to_string(s.N) + " (" + CublasStatusString(st) +
                                    "); set JAXMLP_GEMM_PATH=fallback");
      it = lt_plans.emplace(key, LtPlan{desc.release(), result.algo}).first;
    }
    plan = it->second;
  }
  // The scale pointers of an FP8 product point into this call's workspace: its descriptor is built per
  // call, with the cached algorithm (a cached descriptor is shared by every thread that calls).
  Desc per_call{api};
  if (s.in_type == ffi::DataType::F8E4M3FN) JAXMLP_RETURN_IF_ERROR(MakeDesc(api, s, scale_a, scale_b, &per_call));
  // One host scalar alpha and beta for all groups (Hopper takes no per-group scalars).
  const float alpha = 1.0f, beta = s.beta;
  JAXMLP_CUBLAS(api.LtMatmul(handle, per_call.desc ? per_call.desc : plan.desc, &alpha, ptrs + 0 * E_, l.a,
                             ptrs + 1 * E_, l.b, &beta, ptrs + 2 * E_, l.d, ptrs + 2 * E_, l.d, &plan.algo, cublas_ws_,
                             kLtWorkspaceBytes, stream_),
                "cublasLtMatmul (grouped)");
  return ffi::Error::Success();
}

ffi::Error GroupedGemms::RunFallback(const GemmSpec& s, int i) {
  const CublasApi& api = LoadCublas();
  if (!api.error.empty()) return ffi::Error::Internal("jaxmlp: " + api.error);
  // Host dims of the non-empty groups, in the order the setup kernel packed their pointers.
  std::vector<int> m, n, k, lda, ldb, ldc;
  for (int64_t g = 0; g < E_; ++g) {
    const int c = int(host_offsets_[g + 1] - host_offsets_[g]);
    if (c == 0) continue;
    switch (s.op) {
      case GemmOp::kNN:
        m.push_back(s.N), n.push_back(c), k.push_back(s.K), lda.push_back(s.N), ldb.push_back(s.K), ldc.push_back(s.N);
        break;
      case GemmOp::kNT:
        m.push_back(s.K), n.push_back(c), k.push_back(s.N), lda.push_back(s.N), ldb.push_back(s.N), ldc.push_back(s.K);
        break;
      case GemmOp::kTN:
        m.push_back(s.N), n.push_back(s.K), k.push_back(c), lda.push_back(s.N), ldb.push_back(s.K), ldc.push_back(s.N);
        break;
    }
  }
  const int groups = int(m.size());
  if (groups == 0) return ffi::Error::Success();
  std::vector<cublasOperation_t> ta(groups, s.op == GemmOp::kNT ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<cublasOperation_t> tb(groups, s.op == GemmOp::kTN ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<float> alpha(groups, 1.0f), beta(groups, s.beta);
  std::vector<int> ones(groups, 1);
  std::lock_guard<std::mutex> lock(lt_mutex);  // the handle's stream and workspace are per call
  auto h = blas_handles.find(device_);
  if (h == blas_handles.end()) {
    cublasHandle_t created;
    JAXMLP_CUBLAS(api.Create(&created), "cublasCreate");
    h = blas_handles.emplace(device_, created).first;
  }
  JAXMLP_CUBLAS(api.SetStream(h->second, stream_), "cublasSetStream");
  JAXMLP_CUBLAS(api.SetWorkspace(h->second, cublas_ws_, kLtWorkspaceBytes), "cublasSetWorkspace");
  void** ptrs = arrays_.ptrs + i * 3 * E_;
  JAXMLP_CUBLAS(api.GemmGroupedBatchedEx(h->second, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(),
                                         ptrs + 0 * E_, CudaType(s.in_type), lda.data(), ptrs + 1 * E_,
                                         CudaType(s.in_type), ldb.data(), beta.data(), ptrs + 2 * E_,
                                         CudaType(s.out_type), ldc.data(), groups, ones.data(), CUBLAS_COMPUTE_32F),
                "cublasGemmGroupedBatchedEx");
  return ffi::Error::Success();
}

}  // namespace jaxmlp