// Probe (not a benchmark): variants of the fused adam + FP8 quantization kernels (the blockwise recipe's
// AdamWeightBlocksKernel, the tensorwise recipe's AdamWeightTensorKernel) and streaming kernels of the same
// adam arithmetic, timed in turn at dsv3's w1 (E 32, K 7168, N 4096, bfloat16 gradient) with cudaEvents,
// back to back; each fused variant's outputs (w, mu, nu, q, qt, exponents, the new maximum) are first
// compared bit for bit with the first of its recipe's on a shape of cut tiles. docs/performance.md ("Kernel
// measurements": adam's kernel) has what it measured: the blockwise kernel moves its 28 bytes a weight at
// 3.8 TB/s on an H200, as fast as a persistent streaming loop of the same arithmetic, while a streaming
// kernel of short-lived blocks (one 16-byte access per array a thread) reaches 4.2 TB/s, the rate of XLA's
// adam in a training step; the cluster variants (a tile's rows split over 2, 4 or 8 blocks that meet its
// maximum in distributed shared memory) gain 2-3% (6.72 ms at 4 against 6.91; a cluster needs a launch
// attribute in a build for every architecture, where __cluster_dims__ does not compile before Hopper: not yet
// in the kernel). The tensorwise kernel's delayed scale needs no tile maximum first: a block per tile
// holding its rounded weights (80 registers, 37% of the warps active against streaming adam's 64%, by Nsight
// Compute; no DRAM write amplification) took 6.90 ms, strips of 8-32 rows of a held tile 7.1-8.1, quantizing
// each pass as it goes, nothing held, 6.72 in blocks of 32 rows (52 registers), which AdamWeightTensorKernel
// now is (benchmarks/RESULTS-fp8.md); the probe times it beside other row counts and occupancies.
// It compiles the kernels' file into itself (their anonymous namespace), on a Hopper GPU with jaxlib's
// headers:
//
//   nvcc -O3 -DNDEBUG -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -Iffi -I<jaxlib>/include \
//     benchmarks/probes/adam_kernels.cu -o adam_kernels && ./adam_kernels [rounds]
#include "cuda/fp8/fp8_adam_kernels.cu"

#include <algorithm>
#include <functional>
#include <cooperative_groups.h>
#include <cstdio>
#include <cstring>
#include <vector>

namespace jaxmlp {
namespace {

// ---- adam, the next pass's loads issued before this pass's stores (registers) ----
template <typename R, typename G, int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) AdamAheadKernel(AdamStep s, const G* grad, int64_t K, int64_t N,
                                                                  uint8_t* q, uint8_t* qt, int32_t* e) {
  const WeightTile t(K, N);
  const float neg_lr = s.hyper[0], c1 = s.hyper[1], c2 = s.hyper[2];
  HeldTile<R> held;
  float amax = 0.0f;
  Vec<float, 8> w, mu, nu;
  Vec<G, 8> g;
  auto load = [&](int p) {
    const int64_t o = t.Offset(p);
    w = Load<float, 8>(s.w + o), mu = Load<float, 8>(s.mu + o), nu = Load<float, 8>(s.nu + o);
    g = Load<G, 8>(grad + o);
  };
  if (t.Holds(0)) load(0);
#pragma unroll
  for (int p = 0; p < WeightTile::kPasses; ++p) {
    if (!t.Holds(p)) continue;
    Vec<float, 8> cw = w, cmu = mu, cnu = nu;
    const Vec<G, 8> cg = g;
    if (p + 1 < WeightTile::kPasses && t.Holds(p + 1)) load(p + 1);
    const int64_t o = t.Offset(p);
    for (int u = 0; u < 8; ++u) AdamUpdate(s, neg_lr, c1, c2, Conv<G>::To(cg.v[u]), cw.v[u], cmu.v[u], cnu.v[u]);
    Store<float, 8>(s.w_out + o, cw), Store<float, 8>(s.mu_out + o, cmu), Store<float, 8>(s.nu_out + o, cnu);
    amax = fmaxf(amax, held.Hold(p, cw.v));
  }
  QuantizeWeightTile(t, amax, held, q, qt, e);
}

// ---- adam, each thread's next kDepth passes copied into shared memory by cp.async ----
__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void Commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void WaitGroup() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename G>
constexpr int kChunks = (3 * 32 + 8 * int(sizeof(G))) / 16;  // 16-byte pieces of one pass of one thread
template <typename R, typename G, int kDepth, int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) AdamStagedKernel(AdamStep s, const G* grad, int64_t K, int64_t N,
                                                                   uint8_t* q, uint8_t* qt, int32_t* e) {
  extern __shared__ uint4 stage[];  // [kDepth][kChunks][256]
  constexpr int kC = kChunks<G>, kGChunks = int(sizeof(G)) / 2;
  const WeightTile t(K, N);
  const float neg_lr = s.hyper[0], c1 = s.hyper[1], c2 = s.hyper[2];
  auto slot = [&](int p, int c) -> uint4* { return &stage[((p % kDepth) * kC + c) * 256 + threadIdx.x]; };
  auto issue = [&](int p) {
    if (p < WeightTile::kPasses && t.Holds(p)) {
      const int64_t o = t.Offset(p);
      CopyAsync16(slot(p, 0), s.w + o), CopyAsync16(slot(p, 1), s.w + o + 4);
      CopyAsync16(slot(p, 2), s.mu + o), CopyAsync16(slot(p, 3), s.mu + o + 4);
      CopyAsync16(slot(p, 4), s.nu + o), CopyAsync16(slot(p, 5), s.nu + o + 4);
      for (int c = 0; c < kGChunks; ++c) CopyAsync16(slot(p, 6 + c), grad + o + c * (8 / kGChunks));
    }
    Commit();
  };
#pragma unroll
  for (int p = 0; p < kDepth; ++p) issue(p);
  HeldTile<R> held;
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < WeightTile::kPasses; ++p) {
    WaitGroup<kDepth - 1>();
    if (t.Holds(p)) {
      Vec<float, 8> w, mu, nu;
      Vec<G, 8> g;
      reinterpret_cast<uint4*>(&w)[0] = *slot(p, 0), reinterpret_cast<uint4*>(&w)[1] = *slot(p, 1);
      reinterpret_cast<uint4*>(&mu)[0] = *slot(p, 2), reinterpret_cast<uint4*>(&mu)[1] = *slot(p, 3);
      reinterpret_cast<uint4*>(&nu)[0] = *slot(p, 4), reinterpret_cast<uint4*>(&nu)[1] = *slot(p, 5);
      for (int c = 0; c < kGChunks; ++c) reinterpret_cast<uint4*>(&g)[c] = *slot(p, 6 + c);
      const int64_t o = t.Offset(p);
      for (int u = 0; u < 8; ++u) AdamUpdate(s, neg_lr, c1, c2, Conv<G>::To(g.v[u]), w.v[u], mu.v[u], nu.v[u]);
      Store<float, 8>(s.w_out + o, w), Store<float, 8>(s.mu_out + o, mu), Store<float, 8>(s.nu_out + o, nu);
      amax = fmaxf(amax, held.Hold(p, w.v));
    }
    issue(p + kDepth);  // after this pass's stores, which needed its shared values read
  }
  QuantizeWeightTile(t, amax, held, q, qt, e);
}

// ---- adam alone (no quantization, 26 bytes a weight), a grid-stride loop over 16-byte accesses: persistent
// (a few blocks an SM) or a block per 1024 weights (one pass a thread) ----
template <typename G>
__global__ void __launch_bounds__(256) AdamStreamKernel(AdamStep s, const G* grad, int64_t n) {
  const float neg_lr = s.hyper[0], c1 = s.hyper[1], c2 = s.hyper[2];
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += int64_t(gridDim.x) * blockDim.x * 4) {
    Vec<float, 4> w = Load<float, 4>(s.w + i), mu = Load<float, 4>(s.mu + i), nu = Load<float, 4>(s.nu + i);
    const Vec<G, 4> g = Load<G, 4>(grad + i);
    for (int u = 0; u < 4; ++u) AdamUpdate(s, neg_lr, c1, c2, Conv<G>::To(g.v[u]), w.v[u], mu.v[u], nu.v[u]);
    Store<float, 4>(s.w_out + i, w), Store<float, 4>(s.mu_out + i, mu), Store<float, 4>(s.nu_out + i, nu);
  }
}

// ---- adam alone with the tile kernel's addressing: a block per 128 x 128 tile, 8 rows a thread ----
template <typename G>
__global__ void __launch_bounds__(256) AdamTileStreamKernel(AdamStep s, const G* grad, int64_t K, int64_t N) {
  const WeightTile t(K, N);
  const float neg_lr = s.hyper[0], c1 = s.hyper[1], c2 = s.hyper[2];
#pragma unroll
  for (int p = 0; p < WeightTile::kPasses; ++p) {
    if (t.Holds(p)) AdamEight(s, neg_lr, c1, c2, grad, t.Offset(p));
  }
}

// ---- adam alone, a block per 16 rows x 128 columns (one row a thread's pass): short-lived, tile-shaped ----
template <typename G>
__global__ void __launch_bounds__(256) AdamStripStreamKernel(AdamStep s, const G* grad, int64_t K, int64_t N) {
  const int j = threadIdx.x % 16 * 8;
  const int64_t row = int64_t(blockIdx.y) * 16 + threadIdx.x / 16, col = int64_t(blockIdx.x) * 128 + j;
  if (row >= K || col >= N) return;
  const float neg_lr = s.hyper[0], c1 = s.hyper[1], c2 = s.hyper[2];
  AdamEight(s, neg_lr, c1, c2, grad, (blockIdx.z * K + row) * N + col);
}

// ---- the fused kernel over a cluster of kC blocks per 128 x 128 tile: each block 128 / kC rows (8 / kC
// passes), the tile's maximum met through distributed shared memory. cluster.sync() waits for the block's
// global stores (a membar): with one pass a block (kC 8) the new w, mu and nu are held until after it;
// the second barrier (no block leaves while a peer may read its maximum) arrives once the maxima are read
// and used, relaxed, and waits at the end. ----
template <typename R, typename G, int kC>
__global__ void __cluster_dims__(kC, 1, 1) __launch_bounds__(256, 3)
    AdamClusterKernel(AdamStep s, const G* grad, int64_t K, int64_t N, uint8_t* q, uint8_t* qt, int32_t* e) {
  namespace cg = cooperative_groups;
  constexpr int kRows = 128 / kC, kPasses = kRows / 16;
  constexpr bool kHoldUpdate = kPasses == 1;
  __shared__ uint8_t tile[kRows][kScaleBlock + 4];
  __shared__ float warp_max[8];
  __shared__ float block_max;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int64_t n0 = int64_t(blockIdx.x / kC) * kScaleBlock, k0 = int64_t(blockIdx.y) * kScaleBlock + rank * kRows;
  const int j = threadIdx.x % 16 * 8, first_row = threadIdx.x / 16;
  const float neg_lr = s.hyper[0], c1 = s.hyper[1], c2 = s.hyper[2];
  auto holds = [&](int p) { return k0 + first_row + 16 * p < K && n0 + j < N; };
  auto offset = [&](int p) { return (int64_t(blockIdx.z) * K + k0 + first_row + 16 * p) * N + n0 + j; };
  typename RoundedPair<R>::Type held[kPasses][4];
  Vec<float, 8> w, mu, nu;
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    if (!holds(p)) continue;
    const int64_t o = offset(p);
    w = Load<float, 8>(s.w + o), mu = Load<float, 8>(s.mu + o), nu = Load<float, 8>(s.nu + o);
    const Vec<G, 8> g = Load<G, 8>(grad + o);
    for (int u = 0; u < 8; ++u) AdamUpdate(s, neg_lr, c1, c2, Conv<G>::To(g.v[u]), w.v[u], mu.v[u], nu.v[u]);
    if (!kHoldUpdate) Store<float, 8>(s.w_out + o, w), Store<float, 8>(s.mu_out + o, mu), Store<float, 8>(s.nu_out + o, nu);
#pragma unroll
    for (int u = 0; u < 8; u += 2) {
      held[p][u / 2] = RoundedPair<R>::From(w.v[u], w.v[u + 1]);
      const float2 r = RoundedPair<R>::To(held[p][u / 2]);
      amax = fmaxf(amax, fmaxf(fabsf(r.x), fabsf(r.y)));
    }
  }
  amax = WarpMax(amax);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.0f;
    for (int i = 0; i < 8; ++i) m = fmaxf(m, warp_max[i]);
    block_max = m;
  }
  cluster.sync();  // every block's maximum written
  amax = 0.0f;
  for (int c = 0; c < kC; ++c) amax = fmaxf(amax, *cluster.map_shared_rank(&block_max, c));
  const int exp = Exponent(amax);  // uses the peers' maxima: their reads are done
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  if (kHoldUpdate && holds(0)) {
    const int64_t o = offset(0);
    Store<float, 8>(s.w_out + o, w), Store<float, 8>(s.mu_out + o, mu), Store<float, 8>(s.nu_out + o, nu);
  }
  const Unscale unscale(exp);
  if (threadIdx.x == 0 && rank == 0)
    e[(int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * (gridDim.x / kC) + blockIdx.x / kC] = exp;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    if (!holds(p)) continue;
    uint64_t packed = 0;
    for (int u = 0; u < 8; u += 2) {
      const float2 r = RoundedPair<R>::To(held[p][u / 2]);
      packed |= uint64_t(Quantize2(r.x, r.y, unscale)) << (8 * u);
    }
    for (int u = 0; u < 8; ++u) tile[first_row + 16 * p][j + u] = uint8_t(packed >> (8 * u));
    *reinterpret_cast<uint64_t*>(q + offset(p)) = packed;
  }
  __syncthreads();
  StoreTransposed(tile, n0, k0, K, N, qt);
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // no block leaves while a peer may read
}

// ---- the persistent loop's traffic with an add in place of adam's arithmetic ----
template <typename G>
__global__ void __launch_bounds__(256) CopyStreamKernel(AdamStep s, const G* grad, int64_t n) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += int64_t(gridDim.x) * blockDim.x * 4) {
    Vec<float, 4> w = Load<float, 4>(s.w + i), mu = Load<float, 4>(s.mu + i), nu = Load<float, 4>(s.nu + i);
    const Vec<G, 4> g = Load<G, 4>(grad + i);
    for (int u = 0; u < 4; ++u) w.v[u] += Conv<G>::To(g.v[u]), mu.v[u] *= 0.5f, nu.v[u] *= 0.5f;
    Store<float, 4>(s.w_out + i, w), Store<float, 4>(s.mu_out + i, mu), Store<float, 4>(s.nu_out + i, nu);
  }
}
}  // namespace
}  // namespace jaxmlp

using namespace jaxmlp;
using R = __nv_bfloat16;

static void Check(cudaError_t err, const char* what) { if (err != cudaSuccess) { printf("%s: %s\n", what, cudaGetErrorString(err)); exit(1); } }
#define CK(x) Check((x), #x)

struct Buffers {
  int64_t E, K, N, n;
  float *w, *mu, *nu, *w0, *mu0, *nu0, *hyper;
  R* g;
  uint8_t *q, *qt;
  int32_t* e;
  float *delayed, *amax;  // tensorwise: the last weights' maximum (below the new ones': saturation), the new one
  Buffers(int64_t E, int64_t K, int64_t N) : E(E), K(K), N(N), n(E * K * N) {
    for (float** p : {&w, &mu, &nu, &w0, &mu0, &nu0}) CK(cudaMalloc(p, n * 4));
    CK(cudaMalloc(&g, n * 2));
    CK(cudaMalloc(&q, n)), CK(cudaMalloc(&qt, n));
    CK(cudaMalloc(&e, E * ScaleBlocks(K) * ScaleBlocks(N) * 4));
    CK(cudaMalloc(&hyper, 12));
    CK(cudaMalloc(&delayed, 4)), CK(cudaMalloc(&amax, 4));
    const float last_max = 0.9f;
    CK(cudaMemcpy(delayed, &last_max, 4, cudaMemcpyHostToDevice));
    std::vector<float> h(n);
    uint32_t x = 12345;
    auto rnd = [&] { x = x * 1664525u + 1013904223u; return (int32_t(x >> 8) - (1 << 23)) / float(1 << 23); };
    for (auto& v : h) v = rnd();
    CK(cudaMemcpy(w0, h.data(), n * 4, cudaMemcpyHostToDevice));
    for (auto& v : h) v = rnd() * 1e-2f;
    CK(cudaMemcpy(mu0, h.data(), n * 4, cudaMemcpyHostToDevice));
    for (auto& v : h) v = fabsf(rnd()) * 1e-4f;
    CK(cudaMemcpy(nu0, h.data(), n * 4, cudaMemcpyHostToDevice));
    std::vector<R> hg(n);
    for (auto& v : hg) v = __float2bfloat16(rnd() * 1e-3f);
    CK(cudaMemcpy(g, hg.data(), n * 2, cudaMemcpyHostToDevice));
    const float hy[3] = {-1e-4f, 0.1f, 1e-3f};
    CK(cudaMemcpy(hyper, hy, 12, cudaMemcpyHostToDevice));
    Reset();
  }
  void Reset() {
    CK(cudaMemcpy(w, w0, n * 4, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(mu, mu0, n * 4, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(nu, nu0, n * 4, cudaMemcpyDeviceToDevice));
    // Poisoned (0xFF: an e4m3 NaN, exponent -1): a variant that leaves an element unwritten differs.
    CK(cudaMemset(q, 0xFF, n)), CK(cudaMemset(qt, 0xFF, n));
    CK(cudaMemset(e, 0xFF, E * ScaleBlocks(K) * ScaleBlocks(N) * 4));
    CK(cudaMemset(amax, 0, 4));
  }
  AdamStep Step() const { return AdamStep{w, mu, nu, g, w, mu, nu, hyper, 0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.0f, 0.0f}; }
  std::vector<uint8_t> Outputs() const {
    std::vector<uint8_t> out(n * 14 + E * ScaleBlocks(K) * ScaleBlocks(N) * 4 + 4);
    uint8_t* o = out.data();
    for (float* p : {w, mu, nu}) CK(cudaMemcpy(o, p, n * 4, cudaMemcpyDeviceToHost)), o += n * 4;
    CK(cudaMemcpy(o, q, n, cudaMemcpyDeviceToHost)), o += n;
    CK(cudaMemcpy(o, qt, n, cudaMemcpyDeviceToHost)), o += n;
    CK(cudaMemcpy(o, e, E * ScaleBlocks(K) * ScaleBlocks(N) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o + E * ScaleBlocks(K) * ScaleBlocks(N) * 4, amax, 4, cudaMemcpyDeviceToHost));
    return out;
  }
};

struct Variant {
  const char* name;
  char recipe;  // 'b' blockwise or 't' tensorwise: adam and the quantization (28 bytes a weight); 0 adam alone (26)
  std::function<void(Buffers&)> run;
};

template <typename Kernel>
void AllowSmem(Kernel k, int bytes) { CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)); }

std::vector<Variant> Variants() {
  std::vector<Variant> v;
  auto tiles = [](Buffers& b, int split) {
    return dim3(unsigned(ScaleBlocks(b.N) * split), unsigned(ScaleBlocks(b.K)), unsigned(b.E));
  };
  const int chunk = kChunks<R> * 256 * 16;  // a row's shared stage of AdamStagedKernel
  AllowSmem(AdamStagedKernel<R, R, 3, 2>, 3 * chunk);
  // Fused: adam and the quantization, 28 bytes a weight.
  v.push_back({"kernel (three blocks an SM)", 'b', [=](Buffers& b) {
    AdamWeightBlocksKernel<R, R><<<tiles(b, 1), 256>>>(b.Step(), b.g, b.K, b.N, b.q, b.qt, b.e); }});
  v.push_back({"next row's loads first", 'b', [=](Buffers& b) {
    AdamAheadKernel<R, R, 2><<<tiles(b, 1), 256>>>(b.Step(), b.g, b.K, b.N, b.q, b.qt, b.e); }});
  v.push_back({"3 rows staged by cp.async", 'b', [=](Buffers& b) {
    AdamStagedKernel<R, R, 3, 2><<<tiles(b, 1), 256, 3 * chunk>>>(b.Step(), b.g, b.K, b.N, b.q, b.qt, b.e); }});
  v.push_back({"cluster of 2 a tile", 'b', [=](Buffers& b) {
    AdamClusterKernel<R, R, 2><<<tiles(b, 2), 256>>>(b.Step(), b.g, b.K, b.N, b.q, b.qt, b.e); }});
  v.push_back({"cluster of 4 a tile", 'b', [=](Buffers& b) {
    AdamClusterKernel<R, R, 4><<<tiles(b, 4), 256>>>(b.Step(), b.g, b.K, b.N, b.q, b.qt, b.e); }});
  v.push_back({"cluster of 8 a tile", 'b', [=](Buffers& b) {
    AdamClusterKernel<R, R, 8><<<tiles(b, 8), 256>>>(b.Step(), b.g, b.K, b.N, b.q, b.qt, b.e); }});
  // Tensorwise, fused: the kernel (32 rows a block), and blocks of other rows and occupancies.
  // amax zeroed before each launch, as the handler does (else later launches skip their atomics).
  auto tensor = [=](auto kernel, int split) {
    return [=](Buffers& b) {
      CK(cudaMemsetAsync(b.amax, 0, 4));
      kernel<<<tiles(b, split), 256>>>(b.Step(), b.g, b.K, b.N, b.delayed, b.q, b.qt, b.amax);
    };
  };
  v.push_back({"tensorwise: 32 rows, 4/SM (kernel)", 't', tensor(AdamWeightTensorKernel<R, R>, 4)});
  v.push_back({"tensorwise: 32 rows, 5/SM", 't', tensor(AdamWeightTensorKernel<R, R, 32, 5>, 4)});
  v.push_back({"tensorwise: 32 rows, 6/SM", 't', tensor(AdamWeightTensorKernel<R, R, 32, 6>, 4)});
  v.push_back({"tensorwise: 64 rows, 4/SM", 't', tensor(AdamWeightTensorKernel<R, R, 64, 4>, 2)});
  v.push_back({"tensorwise: 128 rows, 4/SM", 't', tensor(AdamWeightTensorKernel<R, R, 128, 4>, 1)});
  // adam alone, 26 bytes a weight.
  v.push_back({"stream, persistent", 0, [=](Buffers& b) {
    AdamStreamKernel<R><<<132 * 8, 256>>>(b.Step(), b.g, b.n); }});
  v.push_back({"stream, a block per 1024", 0, [=](Buffers& b) {
    AdamStreamKernel<R><<<unsigned(b.n / 1024), 256>>>(b.Step(), b.g, b.n); }});
  v.push_back({"stream, a block per tile", 0, [=](Buffers& b) {
    AdamTileStreamKernel<R><<<tiles(b, 1), 256>>>(b.Step(), b.g, b.K, b.N); }});
  v.push_back({"stream, a block per 16 rows", 0, [=](Buffers& b) {
    AdamStripStreamKernel<R><<<dim3(unsigned(ScaleBlocks(b.N)), unsigned((b.K + 15) / 16), unsigned(b.E)), 256>>>(
        b.Step(), b.g, b.K, b.N); }});
  v.push_back({"stream, an add for adam", 0, [=](Buffers& b) {
    CopyStreamKernel<R><<<132 * 8, 256>>>(b.Step(), b.g, b.n); }});
  return v;
}

int main(int argc, char** argv) {
  auto variants = Variants();
  // The fused variants bit for bit against the first of their recipe, on shapes of cut tiles (K a multiple of
  // 16 and of 32, not of 128; then of 128, N still cut).
  for (int64_t K : {400, 416, 512}) {
    Buffers b(3, K, 272);
    std::vector<uint8_t> want[2];
    for (auto& v : variants) {
      if (!v.recipe) continue;
      b.Reset();
      v.run(b);
      CK(cudaDeviceSynchronize());
      auto got = b.Outputs();
      auto& w = want[v.recipe == 't'];
      if (w.empty()) w = got;
      printf("check K %3ld %-30s %s\n", long(K), v.name, got == w ? "same bits" : "DIFFERENT");
    }
  }
  Buffers b(32, 7168, 4096);  // dsv3's w1
  const int rounds = argc > 1 ? atoi(argv[1]) : 7, reps = 5;
  std::vector<std::vector<float>> ms(variants.size());
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start)), CK(cudaEventCreate(&stop));
  for (auto& v : variants) v.run(b);
  CK(cudaDeviceSynchronize());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < variants.size(); ++i) {
      const size_t k = (i + r) % variants.size();  // a rotating order
      variants[k].run(b);
      CK(cudaEventRecord(start));
      for (int j = 0; j < reps; ++j) variants[k].run(b);
      CK(cudaEventRecord(stop));
      CK(cudaEventSynchronize(stop));
      float t;
      CK(cudaEventElapsedTime(&t, start, stop));
      ms[k].push_back(t / reps);
    }
  }
  CK(cudaGetLastError());
  printf("%-32s %9s %8s\n", "dsv3's w1, medians", "ms", "TB/s");
  for (size_t k = 0; k < variants.size(); ++k) {
    auto t = ms[k];
    std::sort(t.begin(), t.end());
    const double med = t[t.size() / 2], bytes = variants[k].recipe ? 28 : 26;
    printf("%-32s %9.3f %8.2f\n", variants[k].name, med, bytes * double(b.n) / med / 1e9);
  }
}
