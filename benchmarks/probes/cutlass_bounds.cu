// Probe: what a grouped GEMM with equal groups could reach on Hopper, product by product, and what the
// ptr-array kernel (jaxmlp's CUTLASS engine) loses against it. Not project code.
//
// Per product of an MLP step at E experts of `rows` rows each (balanced routing), timed in turn:
//   dense    one cuBLAS GEMM with the groups folded into the ragged dimension (the same FLOPs)
//   strided  cuBLAS strided-batched GEMM, a batch per group
//   batched  CUTLASS's stock batched kernel (L = E; one TMA descriptor per operand for the whole call)
//   pingpong the same with the ping-pong schedule, 128x128 tiles (one warpgroup's epilogue under the
//            other's main loop)
//   ptrarray CUTLASS's ptr-array grouped kernel, cooperative 128x256 with a 2x1 cluster (its TMA descriptors
//            rewritten whenever a CTA's next tile is in another group)
//   ptrruns  the same with its persistent CTAs taking runs of `run` consecutive tiles (clusters) in place of
//            every grid-th one, so that a CTA changes group (and descriptors) up to `run` times less often
//   pingruns ptrruns with pingpong's schedule and tiles
//   varlen   the engine's kernel: the ptr-array ping-pong kernel with jaxmlp's varlen main loop (ffi/cuda/
//            gemm/cutlass_varlen_mainloop.cuh: one A descriptor over all rows, B one 3-D descriptor, no
//            descriptor rewritten in the kernel), the ptr-array TMA epilogue (its D descriptor still
//            rewritten per group)
//   varnosmem the same with the epilogue storing from registers (no descriptor at all); kNN and kNT only
// batched/ptrarray isolates the per-group cost of the ptr-array design; dense bounds any grouped design.
// Run with run=1 (`cutlass_bounds E rows d f 1 1`), pingruns is CUTLASS's plain ptr-array ping-pong kernel,
// the varlen kernels' baseline. The "step ms" row sums the products each kernel ran (varlen: not the kTN).
// Products (row-major, as cutlass_grouped.h names them): FC1 x[c,d] w1[d,n1]; FC2 a[c,f] w2[f,d]; and the
// backward's dgrads (kNT) and wgrads (kTN).
//
// Build (the nvidia-cutlass wheel's headers; cuBLAS of any 13.x):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I<cutlass_library/source/include> \
//        -DOP=0|1|2 -c cutlass_bounds.cu   (one object per op, then link with -DOP=-1 main and -lcublas)
// or simply `bash benchmarks/probes/cutlass_bounds.sh` which does so.
// Run: ./cutlass_bounds E rows d f [gated=1] [run=4]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e = (x);                                                                        \
    if (e != cudaSuccess) { printf("CUDA %s at line %d\n", cudaGetErrorString(e), __LINE__); exit(1); } \
  } while (0)

enum Op { kNN = 0, kNT = 1, kTN = 2 };
enum Impl { kBatched = 0, kPingpong = 1, kPtrArray = 2, kPtrRuns = 3, kPingRuns = 4, kVarlen = 5, kVarNoSmem = 6, kImpls = 7 };

// One product over E equal groups: problem (m, n, k) per group in CUTLASS's terms, packed operands.
struct Problem {
  Op op;
  int E, m, n, k, run;
  const __nv_bfloat16 *A, *B;
  __nv_bfloat16* D;
};

// A CUTLASS launch of one implementation; returns false where it cannot run (and says why).
bool RunCutlass(Impl impl, const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

#if OP >= 0
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "../../ffi/cuda/gemm/cutlass_varlen_mainloop.cuh"

using namespace cute;
using T = cutlass::bfloat16_t;
// Layouts of A and B per op in CUTLASS's tags (cutlass_grouped.h's table).
using LayoutA = std::conditional_t<OP == kTN, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
using LayoutB = std::conditional_t<OP == kNT, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
using LayoutD = cutlass::layout::RowMajor;

template <class Tile, class Cluster, class KernelSchedule, class EpilogueSchedule, class ProblemShape,
          bool kPtr>
struct Config {
  template <class L> using Tag = std::conditional_t<kPtr, L*, L>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, T, Tag<LayoutD>, 8, T, Tag<LayoutD>, 8, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<T, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, Tag<LayoutA>, 8, T, Tag<LayoutB>, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>>;
};

using Batched = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                       cutlass::epilogue::TmaWarpSpecializedCooperative, Shape<int, int, int, int>, false>::Gemm;
using Pingpong = Config<Shape<_128, _128, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                        cutlass::epilogue::TmaWarpSpecialized, Shape<int, int, int, int>, false>::Gemm;
using GroupShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using PtrArray = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, GroupShape, true>::Gemm;

// The group problem shape with the run length of RunScheduler (its type selects that scheduler).
struct RunGroupShape : GroupShape {
  int run = 1;
};

// CUTLASS's group scheduler with another order of work: the CTA (cluster) at position u of U takes, at its
// i-th step, unit ((i / run) * U + u) * run + i % run (a unit: a cluster's tiles), in place of
// i * U + u. Ascending per CTA, as the group walk needs; every CTA still takes every U-th run of units.
template <class Base>
class RunScheduler : public Base {
 public:
  using typename Base::Params;
  using typename Base::SchedulerResponse;
  CUTLASS_DEVICE RunScheduler(Params const& params, SchedulerResponse* response) : Base(params, response), response_(response) {
#if defined(__CUDA_ARCH__)
    using Raster = typename Base::RasterOrder;
    const uint64_t cta = params.raster_order_ == Raster::AlongN ? uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x
                                                                : uint64_t(blockIdx.x) * gridDim.y + blockIdx.y;
    // A unit is a cluster: the base scheduler takes a cluster's CTAs as consecutive linear indices.
    const uint64_t per_unit = uint64_t(params.divmod_cluster_shape_minor_.divisor) * params.divmod_cluster_shape_major_.divisor;
    unit_ = cta / per_unit, within_ = cta % per_unit, per_unit_ = per_unit;
    units_ = uint64_t(gridDim.x) * gridDim.y * gridDim.z / per_unit;
    run_ = uint64_t(params.problem_shapes_.run > 0 ? params.problem_shapes_.run : 1);
#endif
  }
  template <class ClusterShape>
  CUTLASS_DEVICE auto initial_work_tile_info(ClusterShape) { return this->get_current_work_for_linear_idx(Linear()); }
  template <typename Pipeline, typename PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state, uint32_t advance_count = 1) {
    step_ += advance_count;
    auto work_tile = this->get_current_work_for_linear_idx(Linear());
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      response_[state.index()] = work_tile;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work_tile, true);
  }

 private:
  CUTLASS_DEVICE uint64_t Linear() const {
    return (((step_ / run_) * units_ + unit_) * run_ + step_ % run_) * per_unit_ + within_;
  }
  SchedulerResponse* response_;
  uint64_t step_ = 0, unit_ = 0, within_ = 0, per_unit_ = 1, units_ = 1, run_ = 1;
};

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, Stages, RunGroupShape> {
  using Scheduler = RunScheduler<PersistentTileSchedulerSm90Group<RunGroupShape, Stages>>;
};
}  // namespace cutlass::gemm::kernel::detail

using PtrRuns = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, RunGroupShape, true>::Gemm;
using PingRuns = Config<Shape<_128, _128, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, RunGroupShape, true>::Gemm;

template <class C>
using VarlenGemm = cutlass::gemm::device::GemmUniversalAdapter<cutlass::gemm::kernel::GemmUniversal<
    GroupShape, jaxmlp::cutlass_detail::VarlenMainloop<typename C::Mainloop>, typename C::Epilogue>>;
template <class EpilogueSchedule>
using PingPtr = Config<Shape<_128, _128, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       EpilogueSchedule, GroupShape, true>;

template <class Gemm>
bool Finish(typename Gemm::Arguments& args, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  Gemm gemm;
  if (Gemm::get_workspace_size(args) > workspace_bytes) return printf("  workspace too small\n"), false;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return printf("  cannot implement\n"), false;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return printf("  initialize failed\n"), false;
  return gemm.run(stream) == cutlass::Status::kSuccess;
}

template <class Gemm>
bool RunBatched(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream, int sm_count) {
  using K = typename Gemm::GemmKernel;
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
  args.problem_shape = {p.m, p.n, p.k, p.E};
  args.mainloop.ptr_A = reinterpret_cast<const T*>(p.A);
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename K::StrideA{}, make_shape(p.m, p.k, p.E));
  args.mainloop.ptr_B = reinterpret_cast<const T*>(p.B);
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename K::StrideB{}, make_shape(p.n, p.k, p.E));
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = reinterpret_cast<const T*>(p.D);
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename K::StrideC{}, make_shape(p.m, p.n, p.E));
  args.epilogue.ptr_D = reinterpret_cast<T*>(p.D);
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename K::StrideD{}, make_shape(p.m, p.n, p.E));
  args.hw_info.sm_count = sm_count;
  return Finish<Gemm>(args, workspace, workspace_bytes, stream);
}

// The ptr-array arrays (pointers, strides, problem shapes) in an allocation of their own, written when the
// problem changes: the timed launches, like the engine's, hold the CUTLASS launch alone. kVarlen: the varlen
// kernels, whose main loop takes A's rows of all groups as one tensor (group g from row g * m) and B as one
// [E] batch of matrices; the epilogue's per-group arrays are the same.
template <class Gemm, bool kVarlen = false>
static bool RunPtrArray(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream, int sm_count) {
  using K = typename Gemm::GemmKernel;
  using SD = typename K::InternalStrideD;
  static char* arrays = nullptr;
  static Problem written{};
  const int E = p.E;
  if (!arrays) CK(cudaMalloc(&arrays, size_t(16) << 20));
  char* w = arrays;
  const bool write = std::memcmp(&written, &p, sizeof p) != 0;
  written = p;
  auto put = [&](const auto& v) {
    const size_t bytes = v.size() * sizeof(v[0]);
    if (write) CK(cudaMemcpy(w, v.data(), bytes, cudaMemcpyHostToDevice));
    void* at = w;
    w += (bytes + 255) / 256 * 256;
    return at;
  };
  std::vector<GroupShape::UnderlyingProblemShape> shapes(E, {p.m, p.n, p.k});
  std::vector<T*> d(E);
  for (int g = 0; g < E; ++g) d[g] = reinterpret_cast<T*>(p.D) + size_t(g) * p.m * p.n;
  std::vector<SD> sd(E, cutlass::make_cute_packed_stride(SD{}, make_shape(p.m, p.n, 1)));
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape.num_groups = E;
  args.problem_shape.problem_shapes = static_cast<GroupShape::UnderlyingProblemShape*>(put(shapes));
  args.problem_shape.host_problem_shapes = nullptr;
  if constexpr (kVarlen) {
    std::vector<int64_t> offsets(E);
    for (int g = 0; g < E; ++g) offsets[g] = int64_t(g) * p.m;
    // kNN: B[g] is [k, n] (ld n); kNT: B[g] is stored [n, k] (ld k). A's rows are [m, k] in both.
    args.mainloop = {reinterpret_cast<const T*>(p.A), int64_t(E) * p.m, p.k, reinterpret_cast<const T*>(p.B), E,
                     p.op == kNN ? p.n : p.k, p.n, p.k, static_cast<const int64_t*>(put(offsets))};
  } else {
    using SA = typename K::InternalStrideA;
    using SB = typename K::InternalStrideB;
    std::vector<const T*> a(E), b(E);
    for (int g = 0; g < E; ++g) {
      a[g] = reinterpret_cast<const T*>(p.A) + size_t(g) * p.m * p.k;
      b[g] = reinterpret_cast<const T*>(p.B) + size_t(g) * p.n * p.k;
    }
    std::vector<SA> sa(E, cutlass::make_cute_packed_stride(SA{}, make_shape(p.m, p.k, 1)));
    std::vector<SB> sb(E, cutlass::make_cute_packed_stride(SB{}, make_shape(p.n, p.k, 1)));
    if constexpr (std::is_same_v<typename K::ProblemShape, RunGroupShape>) args.problem_shape.run = p.run;
    args.mainloop.ptr_A = static_cast<const T**>(put(a));
    args.mainloop.dA = static_cast<SA*>(put(sa));
    args.mainloop.ptr_B = static_cast<const T**>(put(b));
    args.mainloop.dB = static_cast<SB*>(put(sb));
  }
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = static_cast<const T**>(put(d));
  args.epilogue.dC = static_cast<SD*>(put(sd));
  args.epilogue.ptr_D = static_cast<T**>(put(d));
  args.epilogue.dD = static_cast<SD*>(put(sd));
  args.hw_info.sm_count = sm_count;
  return Finish<Gemm>(args, workspace, workspace_bytes, stream);
}

static bool RunCutlassOp(Impl impl, const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  static int sm_count = [] { int c = 0; cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, 0); return c; }();
  switch (impl) {
    case kBatched: return RunBatched<Batched>(p, workspace, workspace_bytes, stream, sm_count);
    case kPingpong: return RunBatched<Pingpong>(p, workspace, workspace_bytes, stream, sm_count);
    case kPtrArray: return RunPtrArray<PtrArray>(p, workspace, workspace_bytes, stream, sm_count);
    case kPtrRuns: return RunPtrArray<PtrRuns>(p, workspace, workspace_bytes, stream, sm_count);
    case kPingRuns: return RunPtrArray<PingRuns>(p, workspace, workspace_bytes, stream, sm_count);
    default:
      if constexpr (OP == kTN) return printf("  varlen: not for kTN\n"), false;
      else if (impl == kVarlen)
        return RunPtrArray<VarlenGemm<PingPtr<cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>>, true>(
            p, workspace, workspace_bytes, stream, sm_count);
      else
        return RunPtrArray<VarlenGemm<PingPtr<cutlass::epilogue::PtrArrayNoSmemWarpSpecialized>>, true>(
            p, workspace, workspace_bytes, stream, sm_count);
  }
}
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
bool CAT(RunCutlassOp, OP)(Impl impl, const Problem& p, void* w, size_t wb, cudaStream_t s) { return RunCutlassOp(impl, p, w, wb, s); }

#else  // OP < 0: the driver
bool RunCutlassOp0(Impl, const Problem&, void*, size_t, cudaStream_t);
bool RunCutlassOp1(Impl, const Problem&, void*, size_t, cudaStream_t);
bool RunCutlassOp2(Impl, const Problem&, void*, size_t, cudaStream_t);
static const char* kImplNames[] = {"batched", "pingpong", "ptrarray", "ptrruns", "pingruns", "varlen", "varnosmem"};
bool RunCutlass(Impl impl, const Problem& p, void* w, size_t wb, cudaStream_t s) {
  switch (p.op) {
    case kNN: return RunCutlassOp0(impl, p, w, wb, s);
    case kNT: return RunCutlassOp1(impl, p, w, wb, s);
    default: return RunCutlassOp2(impl, p, w, wb, s);
  }
}

__global__ void Fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i * 2654435761u) ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995, h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65535.f - 0.5f));
  }
}

// cuBLAS in row-major terms: D[m,n] (row-major) = op(A) op(B) as cutlass_grouped.h lays them out per op;
// column-major cuBLAS computes D^T = B^T A^T. batch > 1: strided, packed per group; batch == 1 and
// fold > 1: the groups folded into the ragged dimension (m for kNN/kNT, k for kTN).
void CublasRowMajor(cublasHandle_t h, Op op, int m, int n, int k, int batch, const void* A, const void* B, void* D) {
  const float one = 1.f, zero = 0.f;
  // kNN: A [m,k] K-major, B [k,n] N-major.  kNT: B stored [n,k] (K-major).  kTN: A stored [k,m] (M-major).
  const cublasOperation_t opB = op == kNT ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opA = op == kTN ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int ldb = op == kNT ? k : n, lda = op == kTN ? m : k, ldd = n;
  const cublasStatus_t st = cublasGemmStridedBatchedEx(
      h, opB, opA, n, m, k, &one, B, CUDA_R_16BF, ldb, (long long)n * k, A, CUDA_R_16BF, lda, (long long)m * k, &zero, D,
      CUDA_R_16BF, ldd, (long long)m * n, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS) printf("cuBLAS status %d\n", int(st)), exit(1);
}

float MaxAbsDiff(const __nv_bfloat16* x, const __nv_bfloat16* y, size_t n) {
  std::vector<__nv_bfloat16> hx(n), hy(n);
  CK(cudaMemcpy(hx.data(), x, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hy.data(), y, n * 2, cudaMemcpyDeviceToHost));
  float worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const float d = std::abs(__bfloat162float(hx[i]) - __bfloat162float(hy[i]));
    worst = d <= worst ? worst : d;  // NaN (an unwritten, poisoned element) wins
  }
  return worst;
}

int main(int argc, char** argv) {
  if (argc < 5) return printf("usage: %s E rows d f [gated=1]\n", argv[0]), 2;
  const int E = atoi(argv[1]), rows = atoi(argv[2]), d = atoi(argv[3]), f = atoi(argv[4]);
  const int n1 = (argc > 5 ? atoi(argv[5]) : 1) ? 2 * f : f;
  const int run = argc > 6 ? atoi(argv[6]) : 4;
  cublasHandle_t h;
  cublasCreate(&h);
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cublasSetStream(h, stream);
  const size_t big = size_t(E) * std::max<size_t>(size_t(rows) * std::max(d, n1), size_t(d) * n1);
  __nv_bfloat16 *A, *B, *D, *R;
  for (__nv_bfloat16** x : {&A, &B, &D, &R}) CK(cudaMalloc(x, big * 2));
  Fill<<<1024, 256>>>(A, big, 1);
  Fill<<<1024, 256>>>(B, big, 2);
  const size_t workspace_bytes = size_t(64) << 20;
  void* workspace;
  CK(cudaMalloc(&workspace, workspace_bytes));
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0), cudaEventCreate(&t1);
  struct Row { const char* name; Op op; int m, n, k; };
  // Per group, CUTLASS's (m, n, k) of each product (cutlass_grouped.h): kNN (c, N, K), kNT (c, K, N), kTN (K, N, c).
  const Row products[] = {{"fc1", kNN, rows, n1, d},  {"fc2", kNN, rows, d, f},    {"fc2.dgrad", kNT, rows, f, d},
                          {"fc2.wgrad", kTN, f, d, rows}, {"fc1.dgrad", kNT, rows, d, n1}, {"fc1.wgrad", kTN, d, n1, rows}};
  const int kInTurn = 7, kIters = 20;
  printf("E=%d rows=%d d=%d f=%d n1=%d run=%d (bf16, fp32 accumulation; TFLOP/s, median of %d rounds in turn)\n", E, rows, d, f, n1, run, kInTurn);
  printf("%-10s %8s %8s", "product", "dense", "strided");
  for (const char* name : kImplNames) printf(" %8s", name);
  printf("   ptrarray/batched ptrruns/batched best/dense  maxdiff\n");
  double step[2 + kImpls] = {};
  for (const Row& r : products) {
    const Problem p{r.op, E, r.m, r.n, r.k, run, A, B, D};
    const double flops = 2.0 * E * r.m * r.n * r.k;
    // The launches, in turn: 0 dense, 1 strided, 2.. CUTLASS impls.
    auto launch = [&](int which) -> bool {
      if (which == 0) {
        if (r.op == kTN) CublasRowMajor(h, r.op, r.m, r.n, r.k * E, 1, A, B, D);
        else CublasRowMajor(h, r.op, r.m * E, r.n, r.k, 1, A, B, D);
        return true;
      }
      if (which == 1) return CublasRowMajor(h, r.op, r.m, r.n, r.k, E, A, B, D), true;
      return RunCutlass(Impl(which - 2), p, workspace, workspace_bytes, stream);
    };
    // Correctness against cuBLAS strided.
    float diff[kImpls];
    launch(1);
    CK(cudaMemcpyAsync(R, D, size_t(E) * r.m * r.n * 2, cudaMemcpyDeviceToDevice, stream));
    bool ok[2 + kImpls];
    for (int i = 0; i < kImpls; ++i) {
      CK(cudaMemsetAsync(D, 0xff, size_t(E) * r.m * r.n * 2, stream));
      ok[2 + i] = launch(2 + i);
      CK(cudaStreamSynchronize(stream));
      diff[i] = ok[2 + i] ? MaxAbsDiff(D, R, size_t(E) * r.m * r.n) : -1;
    }
    ok[0] = ok[1] = true;
    std::vector<float> ms[2 + kImpls];
    for (int round = 0; round < kInTurn; ++round)
      for (int i = 0; i < 2 + kImpls; ++i) {
        if (!ok[i]) continue;
        launch(i);
        cudaEventRecord(t0, stream);
        for (int it = 0; it < kIters; ++it) launch(i);
        cudaEventRecord(t1, stream);
        CK(cudaEventSynchronize(t1));
        float t;
        cudaEventElapsedTime(&t, t0, t1);
        ms[i].push_back(t / kIters);
      }
    double med[2 + kImpls];
    for (int i = 0; i < 2 + kImpls; ++i) {
      if (!ok[i]) { med[i] = 1e30; continue; }
      std::sort(ms[i].begin(), ms[i].end());
      med[i] = ms[i][ms[i].size() / 2];
      step[i] += med[i];
    }
    const double best = *std::min_element(med + 1, med + 2 + kImpls);
    printf("%-10s", r.name);
    for (int i = 0; i < 2 + kImpls; ++i) printf(" %8.0f", flops / med[i] / 1e9);
    printf("   %16.3f %15.3f %10.3f ", med[2 + kPtrArray] / med[2 + kBatched], med[2 + kPtrRuns] / med[2 + kBatched], med[0] / best);
    for (float x : diff) printf(" %.3g", x);
    printf("\n");
  }
  printf("%-10s", "step ms");
  for (double s : step) printf(" %8.3f", s);
  printf("   %16.3f %15.3f %10.3f\n", step[2 + kPtrArray] / step[2 + kBatched], step[2 + kPtrRuns] / step[2 + kBatched],
         step[0] / *std::min_element(step + 1, step + 2 + kImpls));
  return 0;
}
#endif
