// GroupedGemms (grouped_gemm.h): the setup kernel that writes each group's dims and pointers, the kernels
// that zero what cuBLAS leaves unwritten, and each product's dispatch to its path (the cuBLAS paths in
// grouped_cublas.cu, the tiled one in tiled_gemm.cu).
#include "cuda/gemm/grouped_gemm.h"

#include <algorithm>
#include <vector>

#include "group_offsets.h"
#include "cuda/group_scan.cuh"
#include "cuda/launch.cuh"
#include "cuda/gemm/tiled_gemm.h"

namespace jaxmlp {
namespace {

// Kernel parameters: the products of one call, passed by value.
struct SetupParams {
  const int32_t* sizes;
  int32_t E;
  int64_t M;
  bool compact;  // fallback: only non-empty groups, packed in group order
  int32_t num_gemms;
  GemmSpec gemms[kMaxGemms];
  int32_t in_bytes[kMaxGemms], out_bytes[kMaxGemms];
  int64_t pad;        // kTNPadded: each group's first column is a multiple of pad (16, or 128 for kBlocks)
  int64_t padded_ld;  // kTNPadded's leading dimension (PaddedRows)
  GroupArrays out;
};

// One block of kWarps warps: ScanGroups over group_sizes, then per group and product the cuBLAS
// (column-major) A, B and D pointers. Row-major out = lhs @ rhs is column-major out^T = rhs^T @ lhs^T, so
// cuBLAS A is our rhs and B our lhs (see RunGrouped for the dims); for block-scaled FP8 products also the
// A and B scale pointers (Fp8Scaling).
template <int kWarps>
__global__ void __launch_bounds__(32 * kWarps) SetupKernel(SetupParams p) {
  int64_t carry_groups = 0;  // compact: slots taken by the non-empty groups so far
  int64_t carry_padded = 0;  // kTNPadded: columns taken by the groups so far, each rounded up to the pad
  ScanGroups<kWarps>(p.sizes, p.E, p.M, p.out.counts, p.out.offsets, [&](int64_t g, int64_t start, int64_t count) {
    int64_t slot = g;
    if (p.compact) {  // the same on every thread: the block-wide sum runs on all of them
      int64_t nonempty;
      slot = carry_groups + BlockInclusiveSum<kWarps>(count > 0, &nonempty) - (count > 0);
      carry_groups += nonempty;
    }
    const int64_t padded = (count + 15) / 16 * 16, span = (count + p.pad - 1) / p.pad * p.pad;
    int64_t pass_span;
    const int64_t padded_start = carry_padded + BlockInclusiveSum<kWarps>(span, &pass_span) - span;
    carry_padded += pass_span;
    if (g >= p.E || (p.compact && count == 0)) return;
    if (p.out.padded) {
      p.out.padded[g] = int32_t(padded);
      p.out.padded[p.E + g] = int32_t(p.padded_ld);
      p.out.padded_starts[g] = padded_start;
      if (g == p.E - 1) p.out.padded_starts[p.E] = padded_start + span;  // the padded layout's end
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
      if (s.scaling != Fp8Scaling::kBlocks) continue;
      const void *scale_a, *scale_b;
      if (s.op == GemmOp::kNT) {  // rhs[g] [K, N] in 128x128 blocks; lhs rows in 1x128 blocks along N
        const int64_t red_blocks = ScaleBlocks(N);
        scale_a = s.rhs_scale + g * ScaleBlocks(K) * ((red_blocks + 3) / 4 * 4);
        scale_b = s.lhs_scale + Vec128Base(start, g, red_blocks);
      } else {  // kTNPadded: 1x128 blocks along the tokens, the group's first block at padded_start / 128
        const int64_t block = padded_start / kScaleBlock;
        scale_a = s.rhs_scale + block * N, scale_b = s.lhs_scale + block * K;
      }
      p.out.scale_ptrs[(i * 2 + 0) * E + slot] = const_cast<void*>(scale_a);
      p.out.scale_ptrs[(i * 2 + 1) * E + slot] = const_cast<void*>(scale_b);
    }
    for (int i = 0; i < p.num_gemms; ++i)
      if (p.out.cutlass[i].shapes) WriteCutlassProblem(p.out.cutlass[i], g, count, p.gemms[i].op, p.gemms[i].K,
                                                       p.gemms[i].N);
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

// Zeros rows [offsets[E], M) of out [M, row_bytes], 16 bytes a store where the rows allow it (XLA buffers
// are at least 16-byte aligned).
__global__ void ZeroRowsKernel(const int64_t* offsets, int64_t E, int64_t M, int64_t row_bytes, char* out) {
  for (int64_t r = offsets[E] + blockIdx.x; r < M; r += gridDim.x) {
    char* row = out + r * row_bytes;
    if (row_bytes % 16 == 0) {
      for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
        reinterpret_cast<int4*>(row)[i] = int4{0, 0, 0, 0};
    } else {
      for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) row[i] = 0;
    }
  }
}

}  // namespace

GroupedGemms::GroupedGemms(GemmPath path, cudaStream_t stream, int device, const int32_t* group_sizes, int64_t E,
                           int64_t M, bool split_k, Carver& ws)
    : path_(path), stream_(stream), device_(device), group_sizes_(group_sizes), E_(E), M_(M) {
  arrays_.counts = ws.Take<int32_t>(E);
  arrays_.offsets = ws.Take<int64_t>(E + 1);
  split_arrivals_ = nullptr, split_partials_ = nullptr;
  if (path == GemmPath::kTiled) {  // needs no cuBLAS arrays or workspace
    arrays_.dims = nullptr, arrays_.ptrs = nullptr, arrays_.scale_ptrs = nullptr;
    arrays_.padded = nullptr, arrays_.padded_starts = nullptr;
    for (CutlassProblems& c : arrays_.cutlass) c = {nullptr, nullptr};
    cublas_ws_ = cutlass_ws_ = nullptr;
    if (split_k) {
      split_arrivals_ = ws.Take<int32_t>(kTiledSplitSlots);
      split_partials_ = ws.Take<float>(int64_t(kTiledSplitSlots) * kTiledTileElems);
    }
    return;
  }
  arrays_.dims = ws.Take<int32_t>(kMaxGemms * 2 * E);
  arrays_.ptrs = ws.Take<void*>(kMaxGemms * 3 * E);
  arrays_.scale_ptrs = ws.Take<void*>(kMaxGemms * 2 * E);
  arrays_.padded = ws.Take<int32_t>(2 * E);
  arrays_.padded_starts = ws.Take<int64_t>(E + 1);
  cublas_ws_ = ws.Take<char>(kLtWorkspaceBytes);
  const bool engine = path == GemmPath::kCutlass || path == GemmPath::kFused;
  for (CutlassProblems& c : arrays_.cutlass) {
    c.shapes = engine ? ws.Take<int32_t>(3 * E) : nullptr;
    c.ldd = engine ? ws.Take<int64_t>(E) : nullptr;
  }
  cutlass_ws_ = engine ? ws.Take<char>(CutlassWorkspaceBytes()) : nullptr;
}

size_t GroupedGemmsWorkspaceBytes(GemmPath path, int64_t E, bool split_k) {
  Carver c(nullptr);
  GroupedGemms counted(path, nullptr, 0, nullptr, E, 0, split_k, c);
  return c.used();
}

ffi::Error GroupedGemms::Prepare(std::initializer_list<GemmSpec> specs, bool padded_layout) {
  if (specs.size() > size_t(kMaxGemms)) return ffi::Error::Internal("jaxmlp: too many grouped GEMMs in one call");
  if (E_ <= 0 || E_ >= (int64_t(1) << 30)) return ffi::Error::InvalidArgument("jaxmlp: need 1 <= E < 2^30 groups");
  bool padded = padded_layout;
  int64_t pad = 16;
  for (const GemmSpec& s : specs) {
    if ((s.op == GemmOp::kTNPadded || s.in_type == ffi::DataType::F8E4M3FN) &&
        (path_ == GemmPath::kTiled || path_ == GemmPath::kFallback))
      return ffi::Error::Internal("jaxmlp: FP8 products run on cuBLASLt's grouped GEMM or the engine only");
    if (s.scaling == Fp8Scaling::kBlocks && s.op != GemmOp::kNT && s.op != GemmOp::kTNPadded)
      return ffi::Error::Internal("jaxmlp: block-scaled FP8 products are kNT or kTNPadded");
    if (s.gather && (s.op != GemmOp::kNN || (path_ != GemmPath::kCutlass && path_ != GemmPath::kFused)))
      return ffi::Error::Internal("jaxmlp: only the engine's FC1 gathers its rows");
    padded |= s.op == GemmOp::kTNPadded;
    if (s.op == GemmOp::kTNPadded && s.scaling == Fp8Scaling::kBlocks) pad = kScaleBlock;
  }
  for (const GemmSpec& s : specs)
    if (s.op == GemmOp::kTNPadded && (pad == kScaleBlock) != (s.scaling == Fp8Scaling::kBlocks))
      return ffi::Error::Internal("jaxmlp: one call's kTNPadded products share one padding");
  if (padded && PaddedRows(M_, E_, pad) > INT32_MAX)
    return ffi::Error::InvalidArgument("jaxmlp: M + " + std::to_string(pad - 1) +
                                       " E must be below 2^31 for the FP8 weight gradients");
  SetupParams p{};
  p.sizes = group_sizes_;
  p.E = int32_t(E_);
  p.M = M_;
  p.compact = path_ == GemmPath::kFallback;
  p.num_gemms = int32_t(specs.size());
  p.out = arrays_;
  if (!padded) p.out.padded = nullptr;  // nothing reads them; and a size near 2^31 would not round up in int32
  for (int i = 0; i < kMaxGemms; ++i)  // only the products the engine runs
    if (i >= int(specs.size()) || !CutlassSupports(specs.begin()[i])) p.out.cutlass[i] = {nullptr, nullptr};
  p.pad = pad;
  p.padded_ld = PaddedRows(M_, E_, pad);
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
  // for a load of group_sizes, so fewer passes are faster, while a larger block costs more to start and
  // to synchronise: 8 warps take the most groups for their cost (docs/performance.md, "Kernel
  // measurements").
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
    if (specs_[i].gather) return ffi::Error::Internal("jaxmlp: a gathered product runs with its activation only");
    if (path_ == GemmPath::kGrouped || path_ == GemmPath::kFused) JAXMLP_RETURN_IF_ERROR(RunGrouped(specs_[i], i));
    if (path_ == GemmPath::kCutlass) JAXMLP_RETURN_IF_ERROR(RunCutlassOrGrouped(specs_[i], i));
    if (path_ == GemmPath::kFallback) JAXMLP_RETURN_IF_ERROR(RunFallback(specs_[i], i));
  }
  if (path_ != GemmPath::kTiled) return ffi::Error::Success();
  // A call's first launch writes the group arrays; the kernels after it are all the call's own.
  const bool follows_own_kernel = tiled_launches_++ > 0;
  const TiledGroups groups{group_sizes_, E_, M_, arrays_.counts, arrays_.offsets, split_arrivals_, split_partials_};
  return RunTiledGemms(stream_, device_, groups, specs, n, follows_own_kernel);
}

ffi::Error GroupedGemms::RunCutlassOrGrouped(const GemmSpec& s, int i) {
  if (!CutlassSupports(s)) return RunGrouped(s, i);
  return RunCutlass(stream_, device_, s, E_, M_, arrays_.offsets, arrays_.cutlass[i], arrays_.ptrs + (i * 3 + 2) * E_,
                    cutlass_ws_);
}

bool GroupedGemms::FusesActivation(int i, Act act) const {
  if (i < 0 || i >= num_specs_) return false;
  const bool engine = path_ == GemmPath::kCutlass || (path_ == GemmPath::kFused && specs_[i].op == GemmOp::kNN);
  return engine && CutlassFusesActivation(specs_[i], act);
}

ffi::Error GroupedGemms::RunWithActivation(int i, const CutlassActivation& activation) {
  if (!FusesActivation(i, activation.act.act))
    return ffi::Error::Internal("jaxmlp: a product that runs without its activation fused");
  return RunCutlass(stream_, device_, specs_[i], E_, M_, arrays_.offsets, arrays_.cutlass[i],
                    arrays_.ptrs + (i * 3 + 2) * E_, cutlass_ws_, &activation);
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
  // blocks cost to schedule; where groups are empty, one block per SM already stores at full speed
  // (docs/performance.md, "Kernel measurements").
  const int64_t sms = std::max(1, MultiProcessorCount(device_));  // one block if the query fails
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

}  // namespace jaxmlp
