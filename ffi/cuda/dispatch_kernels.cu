// The MoE dispatch and combine kernels. See dispatch_kernels.h for what each computes.
//
// The dispatch's counting sort is stable without a sort: the T*k choices, in priority order p = j * T + t
// (choice-major, then token order: GShard's), are cut into blocks of kBlockChoices. (1) Each block counts
// its choices per expert. (2) One block scans those counts over the blocks, per expert, into each block's
// first rank in every expert, and the kept group sizes into the group offsets. (3) Each block counts again
// per warp, scans over its warps, and each warp walks its choices in order, 32 at a time, ranking equal
// experts among the lanes with __match_any_sync: every rank is that of a sequential pass. Only counts use
// atomics (shared memory), so the positions are deterministic.
#include "dispatch_kernels.h"

#include <algorithm>
#include <climits>

#include "elements.cuh"
#include "group_scan.cuh"
#include "grouped_gemm.h"
#include "launch.cuh"

namespace jaxmlp {
namespace {

constexpr int kSortWarps = 8;
constexpr int kSortThreads = kSortWarps * 32;
constexpr int kWarpChoices = 256;  // consecutive choices ranked by one warp
constexpr int kBlockChoices = kSortWarps * kWarpChoices;
constexpr int kScanThreads = 1024;

struct SortScratch {
  int32_t* block_base;  // [blocks, E] choices per block and expert, then each block's first rank
  int32_t* offsets;     // [E] first row of each group
};

SortScratch CarveSort(Carver& c, int64_t choices, int64_t E) {
  const int64_t blocks = (choices + kBlockChoices - 1) / kBlockChoices;
  SortScratch s;
  s.block_base = c.Take<int32_t>(blocks * E);
  s.offsets = c.Take<int32_t>(E);
  return s;
}

// The expert of choice p = j * T + t, or -1 if its id is not in [0, E).
__device__ __forceinline__ int32_t ExpertOf(const int32_t* experts, int64_t p, int64_t T, int64_t k, int32_t E) {
  const int32_t e = experts[(p % T) * k + p / T];
  return e >= 0 && e < E ? e : -1;
}

__global__ void CountKernel(const int32_t* experts, int64_t T, int64_t k, int32_t E, int32_t* block_count) {
  extern __shared__ int32_t count[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  const int64_t first = int64_t(blockIdx.x) * kBlockChoices, last = min(T * k, first + kBlockChoices);
  for (int64_t p = first + threadIdx.x; p < last; p += blockDim.x) {
    const int32_t e = ExpertOf(experts, p, T, k, E);
    if (e >= 0) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) block_count[int64_t(blockIdx.x) * E + e] = count[e];
}

// One block of kScanThreads.
__global__ void ScanKernel(int32_t* block_base, int64_t blocks, int32_t E, int32_t capacity, int32_t pad_to,
                           int32_t* group_sizes, int32_t* counts, int32_t* offsets) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t c = block_base[b * E + e];
      block_base[b * E + e] = run;
      run += c;
    }
    counts[e] = run;
    const int32_t kept = min(run, capacity);
    group_sizes[e] = (kept + pad_to - 1) / pad_to * pad_to;
  }
  __syncthreads();  // group_sizes of every expert written
  int64_t carry = 0;
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int64_t size = e < E ? group_sizes[e] : 0;
    int64_t total;
    const int64_t inclusive = BlockInclusiveSum<kScanThreads / 32>(size, &total);
    if (e < E) offsets[e] = int32_t(carry + inclusive - size);
    carry += total;
  }
}

__global__ void RankKernel(const int32_t* experts, int64_t T, int64_t k, int32_t E, int32_t capacity, int64_t R,
                           const int32_t* block_base, const int32_t* offsets, int32_t* row_of_slot,
                           int32_t* slot_of_row) {
  extern __shared__ int32_t next[];  // [kSortWarps, E]: counts, then each warp's next rank per expert
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < kSortWarps * E; i += blockDim.x) next[i] = 0;
  __syncthreads();
  const int64_t first = int64_t(blockIdx.x) * kBlockChoices + warp * kWarpChoices;
  const int64_t last = min(T * k, first + kWarpChoices);
  int32_t* mine = next + warp * E;
  for (int64_t p = first + lane; p < last; p += 32) {
    const int32_t e = ExpertOf(experts, p, T, k, E);
    if (e >= 0) atomicAdd(&mine[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = block_base[int64_t(blockIdx.x) * E + e];
    for (int w = 0; w < kSortWarps; ++w) {
      const int32_t c = next[w * E + e];
      next[w * E + e] = run;
      run += c;
    }
  }
  __syncthreads();
  const unsigned lower_lanes = (1u << lane) - 1;
  for (int64_t p0 = first; p0 < last; p0 += 32) {  // warp-uniform bounds: every lane takes part in the match
    const int64_t p = p0 + lane;
    const bool in = p < last;
    const int32_t e = in ? ExpertOf(experts, p, T, k, E) : -1;
    const unsigned peers = __match_any_sync(~0u, in ? e : -2);
    const int32_t rank = e >= 0 ? mine[e] + __popc(peers & lower_lanes) : 0;
    __syncwarp();  // every lane has read mine[e] before the last of its peers advances it
    if (e >= 0 && lane == 31 - __clz(peers)) mine[e] += __popc(peers);
    __syncwarp();
    if (!in) continue;
    const int64_t slot = (p % T) * k + p / T;
    int32_t row = -1;
    if (e >= 0 && rank < capacity) {
      const int64_t r = int64_t(offsets[e]) + rank;
      row = r < R ? int32_t(r) : -1;  // always true for R from DispatchRowBound; never write out of bounds
    }
    row_of_slot[slot] = row;
    if (row >= 0) slot_of_row[row] = int32_t(slot);
  }
}

// One warp per row; V is a 16-, 8-, 4- or 2-byte unit of the row.
template <typename V>
__global__ void GatherKernel(const V* x, int64_t choices, int64_t k, int64_t units, const int32_t* slot_of_row,
                             int64_t R, V* rows) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= R) return;
  const int lane = threadIdx.x % 32;
  const int32_t s = slot_of_row[r];
  V* dst = rows + r * units;
  if (s < 0 || s >= choices) {
    for (int64_t i = lane; i < units; i += 32) dst[i] = V{};
    return;
  }
  const V* __restrict__ src = x + (s / k) * units;
#pragma unroll 4
  for (int64_t i = lane; i < units; i += 32) dst[i] = src[i];
}

template <typename V>
cudaError_t LaunchGather(cudaStream_t stream, const void* x, int64_t T, int64_t k, int64_t row_bytes,
                         const int32_t* slot_of_row, int64_t R, void* rows) {
  constexpr int kWarps = 8;
  GatherKernel<V><<<(R + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(
      static_cast<const V*>(x), T * k, k, row_bytes / int64_t(sizeof(V)), slot_of_row, R, static_cast<V*>(rows));
  return cudaGetLastError();
}

// One token per blockIdx.x, V columns per thread; the k terms summed in choice order.
template <typename T, int V>
__global__ void CombineKernel(const T* rows, int64_t R, int64_t d, const int32_t* row_of_slot, const float* weights,
                              int64_t k, T* y) {
  const int64_t t = blockIdx.x;
  const int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  if (c >= d) return;
  float acc[V] = {};
#pragma unroll 4
  for (int64_t j = 0; j < k; ++j) {
    const int32_t r = row_of_slot[t * k + j];
    if (r < 0 || r >= R) continue;
    const float w = weights ? weights[t * k + j] : 1.0f;
    const Vec<T, V> v = Load<T, V>(rows + r * d + c);
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] += w * Conv<T>::To(v.v[i]);
  }
  Vec<T, V> out;
#pragma unroll
  for (int i = 0; i < V; ++i) out.v[i] = Conv<T>::From(acc[i]);
  Store<T, V>(y + t * d + c, out);
}

// Blocks below row_blocks: one warp per row r. Above: one thread per choice, writing the dweights (0) of
// the choices that no row's warp writes, so each is written exactly once.
template <typename T, int V>
__global__ void CombineBackwardKernel(const T* dy, const T* rows, const int32_t* row_of_slot,
                                      const int32_t* slot_of_row, const float* weights, int64_t choices, int64_t k,
                                      int64_t R, int64_t d, T* drows, float* dweights, int64_t row_blocks) {
  if (blockIdx.x >= row_blocks) {
    const int64_t s = (int64_t(blockIdx.x) - row_blocks) * blockDim.x + threadIdx.x;
    if (s >= choices) return;
    const int32_t r = row_of_slot[s];
    if (r < 0 || r >= R || slot_of_row[r] != s) dweights[s] = 0.0f;
    return;
  }
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= R) return;
  const int lane = threadIdx.x % 32;
  const int32_t s = slot_of_row[r];
  T* dst = drows + r * d;
  if (s < 0 || s >= choices) {
    Vec<T, V> zero;
#pragma unroll
    for (int i = 0; i < V; ++i) zero.v[i] = Conv<T>::From(0.0f);
    for (int64_t c = lane * V; c < d; c += 32 * V) Store<T, V>(dst + c, zero);
    return;
  }
  const float w = weights ? weights[s] : 1.0f;
  const T* g = dy + (s / k) * d;
  float dot = 0.0f;
  for (int64_t c = lane * V; c < d; c += 32 * V) {
    const Vec<T, V> gv = Load<T, V>(g + c);
    Vec<T, V> out;
#pragma unroll
    for (int i = 0; i < V; ++i) out.v[i] = weights ? Conv<T>::From(w * Conv<T>::To(gv.v[i])) : gv.v[i];
    Store<T, V>(dst + c, out);
    if (weights) {
      const Vec<T, V> rv = Load<T, V>(rows + r * d + c);
#pragma unroll
      for (int i = 0; i < V; ++i) dot += Conv<T>::To(gv.v[i]) * Conv<T>::To(rv.v[i]);
    }
  }
  if (!weights) return;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(~0u, dot, o);  // a fixed tree: deterministic
  if (lane == 0 && row_of_slot[s] == r) dweights[s] = dot;
}

// Calls fn(T{}, std::integral_constant<int, V>{}) with 16-byte accesses where the row length allows.
template <typename Fn>
void ByTypeAndWidth(ffi::DataType t, int64_t d, Fn fn) {
  ByType(t, [&](auto zero) {
    using T = decltype(zero);
    constexpr int kWide = 16 / sizeof(T);
    if (d % kWide == 0) fn(T{}, std::integral_constant<int, kWide>{});
    else fn(T{}, std::integral_constant<int, 1>{});
  });
}

}  // namespace

size_t DispatchWorkspaceBytes(int64_t choices, int64_t E) {
  Carver c(nullptr);
  CarveSort(c, choices, E);
  return c.used();
}

ffi::Error DispatchPlan(cudaStream_t stream, const int32_t* experts, int64_t T, int64_t k, int64_t E,
                        int64_t capacity, int64_t pad_to, int64_t R, int32_t* group_sizes, int32_t* counts,
                        int32_t* row_of_slot, int32_t* slot_of_row, void* workspace) {
  if (E > kDispatchMaxExperts)
    return ffi::Error::InvalidArgument("jaxmlp: the CUDA dispatch takes at most " +
                                       std::to_string(kDispatchMaxExperts) + " experts, got " + std::to_string(E));
  Carver c(workspace);
  const SortScratch s = CarveSort(c, T * k, E);
  const int64_t blocks = (T * k + kBlockChoices - 1) / kBlockChoices;
  const int32_t cap = capacity < 0 ? INT32_MAX : int32_t(std::min<int64_t>(capacity, INT32_MAX));
  // -1 (all bytes 0xFF) marks the padding rows, which no choice's row claims.
  JAXMLP_RETURN_IF_ERROR(CheckCuda(cudaMemsetAsync(slot_of_row, 0xFF, R * sizeof(int32_t), stream), "dispatch"));
  CountKernel<<<blocks, kSortThreads, E * sizeof(int32_t), stream>>>(experts, T, k, int32_t(E), s.block_base);
  ScanKernel<<<1, kScanThreads, 0, stream>>>(s.block_base, blocks, int32_t(E), cap, int32_t(pad_to), group_sizes,
                                             counts, s.offsets);
  RankKernel<<<blocks, kSortThreads, kSortWarps * E * sizeof(int32_t), stream>>>(
      experts, T, k, int32_t(E), cap, R, s.block_base, s.offsets, row_of_slot, slot_of_row);
  return CheckCuda(cudaGetLastError(), "dispatch kernels");
}

ffi::Error GatherRows(cudaStream_t stream, ffi::DataType t, const void* x, int64_t T, int64_t k, int64_t d,
                      const int32_t* slot_of_row, int64_t R, void* rows) {
  const int64_t row_bytes = d * int64_t(ffi::ByteWidth(t));
  cudaError_t e;
  if (row_bytes % 16 == 0) e = LaunchGather<uint4>(stream, x, T, k, row_bytes, slot_of_row, R, rows);
  else if (row_bytes % 8 == 0) e = LaunchGather<uint2>(stream, x, T, k, row_bytes, slot_of_row, R, rows);
  else if (row_bytes % 4 == 0) e = LaunchGather<uint32_t>(stream, x, T, k, row_bytes, slot_of_row, R, rows);
  else e = LaunchGather<uint16_t>(stream, x, T, k, row_bytes, slot_of_row, R, rows);
  return CheckCuda(e, "dispatch row gather");
}

ffi::Error CombineRows(cudaStream_t stream, ffi::DataType t, const void* rows, int64_t R, int64_t d,
                       const int32_t* row_of_slot, const float* weights, int64_t T, int64_t k, void* y) {
  ByTypeAndWidth(t, d, [&](auto zero, auto width) {
    using E = decltype(zero);
    constexpr int V = decltype(width)::value;
    const int64_t units = d / V;
    const int threads = int(std::min<int64_t>(256, (units + 31) / 32 * 32));
    const dim3 grid(unsigned(T), unsigned((units + threads - 1) / threads));
    CombineKernel<E, V><<<grid, threads, 0, stream>>>(static_cast<const E*>(rows), R, d, row_of_slot, weights, k,
                                                      static_cast<E*>(y));
  });
  return CheckCuda(cudaGetLastError(), "combine");
}

ffi::Error CombineBackwardRows(cudaStream_t stream, ffi::DataType t, const void* dy, const void* rows,
                               const int32_t* row_of_slot, const int32_t* slot_of_row, const float* weights,
                               int64_t T, int64_t k, int64_t R, int64_t d, void* drows, float* dweights) {
  constexpr int kWarps = 8, kThreads = kWarps * 32;
  const int64_t row_blocks = (R + kWarps - 1) / kWarps;
  const int64_t slot_blocks = weights ? (T * k + kThreads - 1) / kThreads : 0;
  ByTypeAndWidth(t, d, [&](auto zero, auto width) {
    using E = decltype(zero);
    constexpr int V = decltype(width)::value;
    CombineBackwardKernel<E, V><<<unsigned(row_blocks + slot_blocks), kThreads, 0, stream>>>(
        static_cast<const E*>(dy), static_cast<const E*>(rows), row_of_slot, slot_of_row, weights, T * k, k, R, d,
        static_cast<E*>(drows), dweights, row_blocks);
  });
  return CheckCuda(cudaGetLastError(), "combine backward");
}

}  // namespace jaxmlp
