#include "grouped_gemm.h"

#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "group_scan.cuh"
#include "launch.cuh"
#include "tiled_gemm.h"

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

// Kernel parameters: the products of one call, passed by value.
struct SetupParams {
  const int32_t* sizes;
  int32_t E;
  int64_t M;
  bool compact;  // fallback: only non-empty groups, packed in group order
  int32_t num_gemms;
  GemmSpec gemms[kMaxGemms];
  int32_t in_bytes[kMaxGemms], out_bytes[kMaxGemms];
  int64_t padded_ld;  // kTNPadded's leading dimension (PaddedRows)
  GroupArrays out;
};

// One block of kWarps warps: ScanGroups over group_sizes, then per group and product the cuBLAS
// (column-major) A, B and D pointers. Row-major out = lhs @ rhs is column-major out^T = rhs^T @ lhs^T, so
// cuBLAS A is our rhs and B our lhs (see RunGrouped for the dims).
template <int kWarps>
__global__ void __launch_bounds__(32 * kWarps) SetupKernel(SetupParams p) {
  int64_t carry_groups = 0;  // compact: slots taken by the non-empty groups so far
  int64_t carry_padded = 0;  // kTNPadded: columns taken by the groups so far, each rounded up to 16
  ScanGroups<kWarps>(p.sizes, p.E, p.M, p.out.counts, p.out.offsets, [&](int64_t g, int64_t start, int64_t count) {
    int64_t slot = g;
    if (p.compact) {  // the same on every thread: the block-wide sum runs on all of them
      int64_t nonempty;
      slot = carry_groups + BlockInclusiveSum<kWarps>(count > 0, &nonempty) - (count > 0);
      carry_groups += nonempty;
    }
    const int64_t padded = (count + 15) / 16 * 16;
    int64_t pass_padded;
    const int64_t padded_start = carry_padded + BlockInclusiveSum<kWarps>(padded, &pass_padded) - padded;
    carry_padded += pass_padded;
    if (g >= p.E || (p.compact && count == 0)) return;
    if (p.out.padded) {
      p.out.padded[g] = int32_t(padded);
      p.out.padded[p.E + g] = int32_t(p.padded_ld);
      p.out.padded_starts[g] = padded_start;
    }
    for (int i = 0; i < p.num_gemms; ++i) {
      const GemmSpec& s = p.gemms[i];
      const int64_t K = s.K, N = s.N, ib = p.in_bytes[i], ob = p.out_bytes[i];
      const char* lhs = static_cast<const char*>(s.lhs);
      const char* rhs = static_cast<const char*>(s.rhs);
      char* out = static_cast<char*>(s.out);
      const void *a, *b;
      void* d;
      switch (s.op) {
        case GemmOp::kNN:  // out[rows] = lhs[rows] @ rhs[g]
          a = rhs + g * K * N * ib, b = lhs + start * K * ib, d = out + start * N * ob;
          break;
        case GemmOp::kNT:  // out[rows] = lhs[rows] @ rhs[g]^T
          a = rhs + g * K * N * ib, b = lhs + start * N * ib, d = out + start * K * ob;
          break;
        case GemmOp::kTN:  // out[g] = lhs[rows]^T @ rhs[rows]
          a = rhs + start * N * ib, b = lhs + start * K * ib, d = out + g * K * N * ob;
          break;
        default:  // kTNPadded: out[g] = lhsT[:, padded columns of g] @ rhsT[:, same]^T
          a = rhs + padded_start * ib, b = lhs + padded_start * ib, d = out + g * K * N * ob;
      }
      const int64_t E = p.E;  // 64-bit slots: E may reach 2^30 (Prepare)
      p.out.dims[(i * 2 + 0) * E + slot] = s.K;
      p.out.dims[(i * 2 + 1) * E + slot] = s.N;
      p.out.ptrs[(i * 3 + 0) * E + slot] = const_cast<void*>(a);
      p.out.ptrs[(i * 3 + 1) * E + slot] = const_cast<void*>(b);
      p.out.ptrs[(i * 3 + 2) * E + slot] = d;
    }
  });
}

// Zeros out[g] of product blockIdx.y for the groups g with no rows. Grid (blocks, products): each block
// reads the counts, kZeroThreads at a time with one load per thread, and takes its share of every empty
// group, so a launch costs a load per thread and pass however many groups there are, and an empty group
// is zeroed by all the blocks.
struct ZeroTargets {
  char* out[kMaxGemms];
  int64_t group_bytes[kMaxGemms];  // K * N elements of the product's output type
};
constexpr int kZeroThreads = 256;
__global__ void __launch_bounds__(kZeroThreads) ZeroEmptyGroupsKernel(const int32_t* counts, int64_t E,
                                                                      ZeroTargets t) {
  __shared__ unsigned empty_in_warp[kZeroThreads / 32];
  const int64_t group_bytes = t.group_bytes[blockIdx.y];
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t first = 0; first < E; first += kZeroThreads) {
    const bool empty = first + threadIdx.x < E && counts[first + threadIdx.x] == 0;
    const unsigned ballot = __ballot_sync(~0u, empty);
    if (threadIdx.x % 32 == 0) empty_in_warp[threadIdx.x / 32] = ballot;
    if (!__syncthreads_or(empty)) continue;  // nearly always: no group of this pass is empty
    for (int w = 0; w < kZeroThreads / 32; ++w) {
      for (unsigned m = empty_in_warp[w]; m; m &= m - 1) {
        char* dst = t.out[blockIdx.y] + (first + 32 * w + __ffs(m) - 1) * group_bytes;
        if (group_bytes % 16 == 0) {  // XLA buffers are at least 16-byte aligned
          for (int64_t i = start; i < group_bytes / 16; i += step) reinterpret_cast<int4*>(dst)[i] = int4{0, 0, 0, 0};
        } else {
          for (int64_t i = start; i < group_bytes; i += step) dst[i] = 0;
        }
      }
    }
    __syncthreads();  // before the next pass writes empty_in_warp again
  }
}

// Zeros rows [offsets[E], M) of out [M, row_bytes].
__global__ void ZeroRowsKernel(const int64_t* offsets, int64_t E, int64_t M, int64_t row_bytes, char* out) {
  for (int64_t r = offsets[E] + blockIdx.x; r < M; r += gridDim.x)
    for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) out[r * row_bytes + i] = 0;
}

// ---- cuBLASLt state shared by all calls: a handle per device, descriptors and algorithms per problem --
struct LtKey {
  int device;
  GemmOp op;
  ffi::DataType in, out;
  int32_t K, N, E;
  int64_t avg_rows;
  bool accumulate;
  bool fast_accumulation;
  bool operator<(const LtKey& o) const {
    return std::tie(device, op, in, out, K, N, E, avg_rows, accumulate, fast_accumulation) <
           std::tie(o.device, o.op, o.in, o.out, o.K, o.N, o.E, o.avg_rows, o.accumulate, o.fast_accumulation);
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

// The matmul descriptor of product s: transposes and, for FP8, the operands' scales. cuBLAS's A is our rhs
// and its B our lhs (see RunGrouped).
ffi::Error MakeDesc(const CublasApi& api, const GemmSpec& s, Desc* desc) {
  JAXMLP_CUBLAS(api.LtMatmulDescCreate(&desc->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  cublasOperation_t ta = s.op == GemmOp::kNT ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = s.op == GemmOp::kTN ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (s.op == GemmOp::kTNPadded) ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA");
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB");
  if (s.in_type != ffi::DataType::F8E4M3FN) return ffi::Error::Success();
  // One scalar scale per operand for all groups (SCALAR_32F, the default mode; Hopper's grouped GEMM
  // rejects per-group scalars).
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &s.rhs_scale,
                                             sizeof(s.rhs_scale)), "A_SCALE_POINTER");
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &s.lhs_scale,
                                             sizeof(s.lhs_scale)), "B_SCALE_POINTER");
  const int8_t fast = s.fast_accumulation;
  JAXMLP_CUBLAS(api.LtMatmulDescSetAttribute(desc->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
                "FAST_ACCUM");
  return ffi::Error::Success();
}

}  // namespace

bool GroupedPathAvailable(std::string* reason) {
  const CublasApi& api = LoadCublas();
  int device = 0, major = 0, minor = 0;
  if (!api.error.empty()) return *reason = api.error, false;
  if (!api.LtGroupedMatrixLayoutCreate)
    return *reason = "cuBLASLt " + std::to_string(api.lt_version) + " has no grouped GEMM API", false;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
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

GroupedGemms::GroupedGemms(GemmPath path, cudaStream_t stream, const int32_t* group_sizes, int64_t E, int64_t M,
                           bool split_k, Carver& ws)
    : path_(path), stream_(stream), group_sizes_(group_sizes), E_(E), M_(M) {
  arrays_.counts = ws.Take<int32_t>(E);
  arrays_.offsets = ws.Take<int64_t>(E + 1);
  split_arrivals_ = nullptr, split_partials_ = nullptr;
  if (path == GemmPath::kTiled) {  // needs no cuBLAS arrays or workspace
    arrays_.dims = nullptr, arrays_.ptrs = nullptr, arrays_.padded = nullptr, arrays_.padded_starts = nullptr;
    cublas_ws_ = nullptr;
    if (split_k) {
      split_arrivals_ = ws.Take<int32_t>(kTiledSplitSlots);
      split_partials_ = ws.Take<float>(int64_t(kTiledSplitSlots) * kTiledTileElems);
    }
    return;
  }
  arrays_.dims = ws.Take<int32_t>(kMaxGemms * 2 * E);
  arrays_.ptrs = ws.Take<void*>(kMaxGemms * 3 * E);
  arrays_.padded = ws.Take<int32_t>(2 * E);
  arrays_.padded_starts = ws.Take<int64_t>(E);
  cublas_ws_ = ws.Take<char>(kLtWorkspaceBytes);
}

size_t GroupedGemmsWorkspaceBytes(GemmPath path, int64_t E, bool split_k) {
  Carver c(nullptr);
  GroupedGemms counted(path, nullptr, nullptr, E, 0, split_k, c);
  return c.used();
}

ffi::Error GroupedGemms::Prepare(std::initializer_list<GemmSpec> specs) {
  if (specs.size() > size_t(kMaxGemms)) return ffi::Error::Internal("jaxmlp: too many grouped GEMMs in one call");
  if (E_ <= 0 || E_ >= (int64_t(1) << 30)) return ffi::Error::InvalidArgument("jaxmlp: need 1 <= E < 2^30 groups");
  bool padded = false;
  for (const GemmSpec& s : specs) {
    if ((s.op == GemmOp::kTNPadded || s.in_type == ffi::DataType::F8E4M3FN) && path_ != GemmPath::kGrouped)
      return ffi::Error::Internal("jaxmlp: FP8 products run on the cuBLASLt grouped path only");
    padded |= s.op == GemmOp::kTNPadded;
  }
  if (padded && PaddedRows(M_, E_) > INT32_MAX)
    return ffi::Error::InvalidArgument("jaxmlp: M + 15 E must be below 2^31 for the FP8 weight gradients");
  SetupParams p{};
  p.sizes = group_sizes_;
  p.E = int32_t(E_);
  p.M = M_;
  p.compact = path_ == GemmPath::kFallback;
  p.num_gemms = int32_t(specs.size());
  p.out = arrays_;
  if (!padded) p.out.padded = nullptr;  // nothing reads them; and a size near 2^31 would not round up in int32
  p.padded_ld = PaddedRows(M_, E_);
  num_specs_ = 0;
  for (const GemmSpec& s : specs) {
    p.in_bytes[num_specs_] = int32_t(ffi::ByteWidth(s.in_type));
    p.out_bytes[num_specs_] = int32_t(ffi::ByteWidth(s.out_type));
    p.gemms[num_specs_] = specs_[num_specs_] = s;
    ++num_specs_;
  }
  // Each tiled launch finds its groups itself (and RunTiledGemms checks its products).
  if (path_ == GemmPath::kTiled) return ffi::Error::Success();
  // One warp walks 32 groups a pass; more groups take a block of 8 warps, 256 a pass. Each pass waits
  // for a load of group_sizes: one warp took ~1 us per 32 groups, 8 warps 3.4-4.2 us per launch at
  // E = 128 and 256 alike, and 32 warps (1024 a pass) ~2 us more (H100, docs/performance.md).
  if (E_ <= 32)
    SetupKernel<1><<<1, 32, 0, stream_>>>(p);
  else
    SetupKernel<8><<<1, 256, 0, stream_>>>(p);
  JAXMLP_RETURN_IF_ERROR(CheckCuda(cudaGetLastError(), "launching the setup kernel"));
  if (path_ == GemmPath::kFallback) {
    // cublasGemmGroupedBatchedEx takes dims from host arrays: the one sync of this path.
    std::vector<int32_t> sizes(E_);
    host_offsets_.resize(E_ + 1);
    cudaError_t e = cudaMemcpyAsync(sizes.data(), group_sizes_, E_ * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    JAXMLP_RETURN_IF_ERROR(CheckCuda(e, "copying group_sizes to the host"));
    GroupOffsets(sizes.data(), E_, M_, host_offsets_.data());
  }
  return ffi::Error::Success();
}

ffi::Error GroupedGemms::Run(int i) { return RunIndependent({i}); }

ffi::Error GroupedGemms::RunIndependent(std::initializer_list<int> products) {
  const GemmSpec* specs[kMaxGemms];
  int n = 0;
  for (int i : products) {
    if (i < 0 || i >= num_specs_ || n == kMaxGemms) return ffi::Error::Internal("jaxmlp: GEMM index out of range");
    specs[n++] = &specs_[i];
    if (path_ == GemmPath::kGrouped) JAXMLP_RETURN_IF_ERROR(RunGrouped(specs_[i], i));
    if (path_ == GemmPath::kFallback) JAXMLP_RETURN_IF_ERROR(RunFallback(specs_[i], i));
  }
  if (path_ != GemmPath::kTiled) return ffi::Error::Success();
  // A call's first launch writes the group arrays; the kernels after it are all the call's own.
  const bool follows_own_kernel = tiled_launches_++ > 0;
  const TiledGroups groups{group_sizes_, E_, M_, arrays_.counts, arrays_.offsets, split_arrivals_, split_partials_};
  return RunTiledGemms(stream_, groups, specs, n, follows_own_kernel);
}

ffi::Error GroupedGemms::ZeroEmptyGroups(std::initializer_list<int> products) {
  if (path_ == GemmPath::kTiled) return ffi::Error::Success();
  ZeroTargets t{};
  int n = 0;
  int64_t largest = 0;
  for (int i : products) {
    if (i < 0 || i >= num_specs_ || n == kMaxGemms) return ffi::Error::Internal("jaxmlp: GEMM index out of range");
    const GemmSpec& s = specs_[i];
    t.out[n] = static_cast<char*>(s.out);
    t.group_bytes[n] = int64_t(s.K) * s.N * int64_t(ffi::ByteWidth(s.out_type));
    largest = std::max(largest, t.group_bytes[n++]);
  }
  // Blocks enough for the largest group, at most one per SM and product, not blocks per group: nearly
  // always no group is empty, and then every block only reads the counts, so the launch costs what its
  // blocks cost to schedule. On an H100 with no group empty, 2 x 528 blocks took 7-8 us, 2 x 132 took
  // 3.5-5.5; where groups are empty, 132 blocks per product store as fast as 528 (docs/performance.md).
  const int64_t sms = std::max<int64_t>(1, OncePerDeviceAndKernel(
      reinterpret_cast<const void*>(ZeroEmptyGroupsKernel), [](int device) -> std::optional<int64_t> {
        int count = 0;
        if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) return count;
        cudaGetLastError();  // a query: leave no error behind for the launch to report
        return std::nullopt;  // one block this time
      }));
  const int64_t bytes_per_block = int64_t(kZeroThreads) * 16;  // 16 bytes a thread
  const dim3 grid(unsigned(std::min<int64_t>((largest + bytes_per_block - 1) / bytes_per_block, sms)), unsigned(n));
  ZeroEmptyGroupsKernel<<<grid, kZeroThreads, 0, stream_>>>(arrays_.counts, E_, t);
  return CheckCuda(cudaGetLastError(), "launching the kernel that zeroes empty groups");
}

ffi::Error GroupedGemms::ZeroPaddingRows(int i) {
  if (path_ == GemmPath::kTiled) return ffi::Error::Success();
  if (i < 0 || i >= num_specs_ || specs_[i].op == GemmOp::kTN)
    return ffi::Error::Internal("jaxmlp: padding rows of a product that is not kNN/kNT");
  const GemmSpec& s = specs_[i];
  const int64_t row_bytes = (s.op == GemmOp::kNN ? s.N : s.K) * int64_t(ffi::ByteWidth(s.out_type));
  ZeroRowsKernel<<<unsigned(std::min<int64_t>(M_, 1024)), 256, 0, stream_>>>(arrays_.offsets, E_, M_, row_bytes,
                                                                              static_cast<char*>(s.out));
  return CheckCuda(cudaGetLastError(), "launching the kernel that zeroes padding rows");
}

// Column-major cuBLAS view of each op (c = rows of the group, the varying dim):
//   kNN: D(N x c)  = A(N x K)            * B(K x c)     A = rhs[g], B = lhs rows, D = out rows
//   kNT: D(K x c)  = A(N x K)^T          * B(N x c)     A = rhs[g], B = lhs rows, D = out rows
//   kTN: D(N x K)  = A(N x c)            * B(K x c)^T   A = rhs rows, B = lhs rows, D = out[g]
ffi::Error GroupedGemms::RunGrouped(const GemmSpec& s, int i) {
  const CublasApi& api = LoadCublas();
  if (!api.LtGroupedMatrixLayoutCreate) return ffi::Error::Internal("jaxmlp: cuBLASLt grouped GEMM unavailable");
  int device = 0;
  cudaGetDevice(&device);
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
  const LtKey key{device, s.op, s.in_type, s.out_type, s.K, s.N, E, avg_rows, s.beta != 0.0f, s.fast_accumulation};
  cublasLtHandle_t handle;
  LtPlan plan;
  {
    std::lock_guard<std::mutex> lock(lt_mutex);
    auto h = lt_handles.find(device);
    if (h == lt_handles.end()) {
      cublasLtHandle_t created;
      JAXMLP_CUBLAS(api.LtCreate(&created), "cublasLtCreate");
      h = lt_handles.emplace(device, created).first;
    }
    handle = h->second;
    auto it = lt_plans.find(key);
    if (it == lt_plans.end()) {
      // First call with this problem signature: build the descriptor and ask the heuristic once. (Timing
      // its top 8 on the first call instead was measured: -2% to +4% where later calls had the first
      // call's group sizes, down to -19% where they had others; docs/performance.md.)
      Desc desc{api};
      JAXMLP_RETURN_IF_ERROR(MakeDesc(api, s, &desc));
      cublasLtMatmulPreference_t pref;
      JAXMLP_CUBLAS(api.LtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
      size_t ws_bytes = kLtWorkspaceBytes;
      api.LtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes));
      const bool weight_gradient = s.op == GemmOp::kTN || s.op == GemmOp::kTNPadded;
      const int64_t rows_d = s.op == GemmOp::kNT ? s.K : s.N;
      const int64_t cols_d = weight_gradient ? s.K : avg_rows;
      const int64_t reduction = weight_gradient ? avg_rows : (s.op == GemmOp::kNN ? s.K : s.N);
      SetAverageHint(api, pref, kPrefGroupedAvgRowsD, rows_d);
      SetAverageHint(api, pref, kPrefGroupedAvgColsD, cols_d);
      SetAverageHint(api, pref, kPrefGroupedAvgReductionDim, reduction);
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      cublasStatus_t st = api.LtMatmulAlgoGetHeuristic(handle, desc.desc, l.a, l.b, l.d, l.d, pref, 1, &result, &found);
      api.LtMatmulPreferenceDestroy(pref);
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
  if (s.in_type == ffi::DataType::F8E4M3FN) JAXMLP_RETURN_IF_ERROR(MakeDesc(api, s, &per_call));
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
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(lt_mutex);  // the handle's stream and workspace are per call
  auto h = blas_handles.find(device);
  if (h == blas_handles.end()) {
    cublasHandle_t created;
    JAXMLP_CUBLAS(api.Create(&created), "cublasCreate");
    h = blas_handles.emplace(device, created).first;
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
