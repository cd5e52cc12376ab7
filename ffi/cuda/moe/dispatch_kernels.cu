// The MoE dispatch and combine kernels. See dispatch_kernels.h for what each computes.
//
// The dispatch's counting sort is stable without a sort: the T*k choices, in priority order p = j * T + t
// (choice-major, then token order: GShard's), are cut into blocks of kBlockChoices. (1) Each block counts
// its choices per expert. (2) One block scans those counts over the blocks, per expert, into each block's
// first rank in every expert, and the kept group sizes into the group offsets. (3) Each block counts again
// per warp, scans over its warps, and each warp walks its choices in order, 32 at a time, ranking equal
// experts among the lanes with __match_any_sync: every rank is that of a sequential pass. Only counts use
// atomics (shared memory), so the positions are deterministic.
#include "cuda/moe/dispatch_kernels.h"

#include <algorithm>
#include <climits>

#include "cuda/block_reduce.cuh"
#include "cuda/elements.cuh"
#include "cuda/group_scan.cuh"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/launch.cuh"

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

// Also marks every row a padding row (-1), for RankKernel to overwrite the rows that choices take: one
// launch fewer than a memset ahead of it.
__global__ void CountKernel(const int32_t* experts, int64_t T, int64_t k, int32_t E, int32_t* block_count,
                            int32_t* slot_of_row, int64_t R) {
  extern __shared__ int32_t count[];
  WaitForPrevious();
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < R; r += int64_t(gridDim.x) * blockDim.x)
    slot_of_row[r] = -1;
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
  constexpr int kInFlight = 8;  // loads issued before the stores that the compiler cannot move them past
  WaitForPrevious();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = 0;
    for (int64_t b0 = 0; b0 < blocks; b0 += kInFlight) {
      int32_t c[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) c[i] = b0 + i < blocks ? block_base[(b0 + i) * E + e] : 0;
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        if (b0 + i < blocks) block_base[(b0 + i) * E + e] = run;
        run += c[i];
      }
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
  WaitForPrevious();
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

// One token per blockIdx.x, V columns per thread; the k terms summed in choice order. The row indices of
// kChunk choices are read first and their rows' loads then issued together, so that a thread waits on
// memory once per chunk, not once per choice (4 of 16 bytes: 56 registers in bfloat16, so 4 blocks of 256
// threads an SM keep 64 KiB of loads in flight; 8 would need over 100 registers, and capping them spills).
template <typename T, int V>
__global__ void CombineKernel(const T* __restrict__ rows, int64_t R, int64_t d,
                              const int32_t* __restrict__ row_of_slot, const float* __restrict__ weights, int64_t k,
                              T* __restrict__ y) {
  constexpr int kChunk = 4;
  WaitForPrevious();
  const int64_t t = blockIdx.x;
  const int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  if (c >= d) return;
  float acc[V] = {};
  for (int64_t j0 = 0; j0 < k; j0 += kChunk) {
    int32_t r[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      r[i] = j0 + i < k ? row_of_slot[t * k + j0 + i] : -1;
      if (r[i] >= R) r[i] = -1;
    }
    Vec<T, V> v[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      if (r[i] >= 0) v[i] = Load<T, V>(rows + r[i] * d + c);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      if (r[i] < 0) continue;
      const float w = weights ? weights[t * k + j0 + i] : 1.0f;
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += w * Conv<T>::To(v[i].v[e]);
    }
  }
  Vec<T, V> out;
#pragma unroll
  for (int i = 0; i < V; ++i) out.v[i] = Conv<T>::From(acc[i]);
  Store<T, V>(y + t * d + c, out);
}

constexpr int kScatterThreads = 256;  // a 4 KiB row (d = 2048 in bfloat16) is one 16-byte unit per thread

// out[r] = w[s] * src[s / k] for s = slot_of_row[r], or 0 where s is not a choice and zero_padding (else
// such a row is left alone) (kScaled false: w = 1, a plain copy); with dweights, also dweights[s] = <src[s / k], rows[row_of_slot[s]]> (0 for a dropped choice).
//
// Blocks below T: block t reads src[t] once and writes it to each row r = row_of_slot[s] of its choices s
// that the row holds back (slot_of_row[r] == s). One warp per row instead would read each token's row k
// times, through an L2 that the R * d bytes being written keep evicting. Blocks from T on: one warp per 32
// rows writes the rows that no choice wrote this way (padding rows, and whatever a plan that dispatch did
// not make leaves over, by slot_of_row), so every row is written exactly once and indices from the device
// are range-checked before use. At most 32 registers, for 8 blocks an SM: a token block mostly waits (for
// its lookups, then its row) before its k stores, so it takes many of them to keep the stores streaming.
// Some variants then spill a few dozen bytes; fewer blocks an SM at more registers, which spill less, were
// no faster (docs/performance.md, "Kernel measurements").
template <typename T, int V, bool kScaled>
__global__ void __launch_bounds__(kScatterThreads, 8) ScatterRowsKernel(
    const T* __restrict__ src, int64_t num_tokens, int64_t k, int64_t d, const int32_t* __restrict__ row_of_slot,
    const int32_t* __restrict__ slot_of_row, int64_t R, const float* __restrict__ weights,
    const T* __restrict__ rows, float* __restrict__ dweights, T* __restrict__ out, bool zero_padding) {
  __shared__ int32_t row_of[kScatterThreads];  // a chunk of the token's choices: the row in [0, R), or -1
  __shared__ bool holds[kScatterThreads];      // whether that row holds the choice (slot_of_row agrees)
  __shared__ float weight_of[kScatterThreads];
  WaitForPrevious();
  const int64_t choices = num_tokens * k;
  if (blockIdx.x >= num_tokens) {
    const int lane = threadIdx.x % 32;
    const int64_t first = ((int64_t(blockIdx.x) - num_tokens) * (blockDim.x / 32) + threadIdx.x / 32) * 32;
    const int64_t r = first + lane;
    int32_t s = -1;
    bool left = false;
    if (r < R) {
      s = slot_of_row[r];
      if (s < 0 || s >= choices) s = -1;
      left = s < 0 ? zero_padding : row_of_slot[s] != r;
    }
    Vec<T, V> zero;
#pragma unroll
    for (int i = 0; i < V; ++i) zero.v[i] = Conv<T>::From(0.0f);
    for (unsigned todo = __ballot_sync(~0u, left); todo; todo &= todo - 1) {
      const int i = __ffs(todo) - 1;
      const int32_t si = __shfl_sync(~0u, s, i);
      T* dst = out + (first + i) * d;
      if (si < 0) {
        for (int64_t c = lane * V; c < d; c += 32 * V) Store<T, V>(dst + c, zero);
        continue;
      }
      const float w = kScaled ? weights[si] : 1.0f;
      const T* g = src + (si / k) * d;
      for (int64_t c = lane * V; c < d; c += 32 * V) {
        Vec<T, V> v = Load<T, V>(g + c);
        if constexpr (kScaled) {
#pragma unroll
          for (int e = 0; e < V; ++e) v.v[e] = Conv<T>::From(w * Conv<T>::To(v.v[e]));
        }
        Store<T, V>(dst + c, v);
      }
    }
    return;
  }
  const int64_t t = blockIdx.x;
  const T* g = src + t * d;
  for (int64_t j0 = 0; j0 < k; j0 += blockDim.x) {
    const int n = int(k - j0 < int64_t(blockDim.x) ? k - j0 : int64_t(blockDim.x));
    if (threadIdx.x < n) {  // the lookups of the chunk's choices at once, not one after another
      const int64_t s = t * k + j0 + threadIdx.x;
      const int32_t r = row_of_slot[s];
      const bool valid = r >= 0 && r < R;
      row_of[threadIdx.x] = valid ? r : -1;
      holds[threadIdx.x] = valid && slot_of_row[r] == s;
      weight_of[threadIdx.x] = kScaled ? weights[s] : 1.0f;
    }
    __syncthreads();
    for (int i = 0; i < n; ++i) {
      const int32_t r = row_of[i];
      const bool store = holds[i], dot_it = dweights != nullptr && r >= 0;
      const float w = weight_of[i];
      float dot = 0.0f;
      if (store || dot_it) {
        for (int64_t c = int64_t(threadIdx.x) * V; c < d; c += int64_t(blockDim.x) * V) {
          const Vec<T, V> gv = Load<T, V>(g + c);
          if (store) {
            Vec<T, V> v = gv;
            if constexpr (kScaled) {
#pragma unroll
              for (int e = 0; e < V; ++e) v.v[e] = Conv<T>::From(w * Conv<T>::To(gv.v[e]));
            }
            Store<T, V>(out + int64_t(r) * d + c, v);
          }
          if (dot_it) {
            const Vec<T, V> rv = Load<T, V>(rows + int64_t(r) * d + c);
#pragma unroll
            for (int e = 0; e < V; ++e) dot += Conv<T>::To(gv.v[e]) * Conv<T>::To(rv.v[e]);
          }
        }
      }
      if (dweights) {  // block-uniform: every thread reaches the barriers
        dot = BlockSum<kScatterThreads / 32>(dot);
        if (threadIdx.x == 0) dweights[t * k + j0 + i] = dot;
      }
    }
    __syncthreads();  // the chunk's entries are read before the next chunk overwrites them
  }
}

template <typename T, int V, bool kScaled>
cudaError_t LaunchScatter(cudaStream_t stream, int device, const void* src, int64_t T_, int64_t k, int64_t d,
                          const int32_t* row_of_slot, const int32_t* slot_of_row, int64_t R, const float* weights,
                          const void* rows, float* dweights, void* out, bool zero_padding) {
  const int64_t units = d / V;
  const int threads = int(std::min<int64_t>(kScatterThreads, (units + 31) / 32 * 32));
  const int64_t fill_blocks = (R + threads - 1) / threads;  // 32 rows per warp
  return LaunchOverlapped(ScatterRowsKernel<T, V, kScaled>, unsigned(T_ + fill_blocks), threads, 0, stream, device,
                          static_cast<const T*>(src), T_, k, d, row_of_slot, slot_of_row, R, weights,
                          static_cast<const T*>(rows), dweights, static_cast<T*>(out), zero_padding);
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

ffi::Error DispatchPlan(cudaStream_t stream, int device, const int32_t* experts, int64_t T, int64_t k, int64_t E,
                        int64_t capacity, int64_t pad_to, int64_t R, int32_t* group_sizes, int32_t* counts,
                        int32_t* row_of_slot, int32_t* slot_of_row, void* workspace) {
  if (E > kDispatchMaxExperts)
    return ffi::Error::InvalidArgument("jaxmlp: the CUDA dispatch takes at most " +
                                       std::to_string(kDispatchMaxExperts) + " experts, got " + std::to_string(E));
  Carver c(workspace);
  const SortScratch s = CarveSort(c, T * k, E);
  const int64_t blocks = (T * k + kBlockChoices - 1) / kBlockChoices;
  const int32_t cap = capacity < 0 ? INT32_MAX : int32_t(std::min<int64_t>(capacity, INT32_MAX));
  CountKernel<<<blocks, kSortThreads, E * sizeof(int32_t), stream>>>(experts, T, k, int32_t(E), s.block_base,
                                                                     slot_of_row, R);
  // The kernels after the first are launched overlapped: their launch hides behind the tail of the one before.
  JAXMLP_RETURN_IF_ERROR(CheckCuda(cudaGetLastError(), "dispatch count"));
  JAXMLP_RETURN_IF_ERROR(CheckCuda(LaunchOverlapped(ScanKernel, 1, kScanThreads, 0, stream, device, s.block_base,
                                                    blocks, int32_t(E), cap, int32_t(pad_to), group_sizes, counts,
                                                    s.offsets),
                                   "dispatch scan"));
  return CheckCuda(LaunchOverlapped(RankKernel, unsigned(blocks), kSortThreads, kSortWarps * E * sizeof(int32_t),
                                    stream, device, experts, T, k, int32_t(E), cap, R, s.block_base, s.offsets,
                                    row_of_slot, slot_of_row),
                   "dispatch rank");
}

ffi::Error GatherRows(cudaStream_t stream, int device, ffi::DataType t, const void* x, int64_t T, int64_t k, int64_t d,
                      const int32_t* row_of_slot, const int32_t* slot_of_row, int64_t R, void* rows,
                      bool zero_padding) {
  cudaError_t e = cudaSuccess;
  ByTypeAndWidth(t, d, [&](auto zero, auto width) {
    e = LaunchScatter<decltype(zero), decltype(width)::value, false>(stream, device, x, T, k, d, row_of_slot,
                                                                      slot_of_row, R, nullptr, nullptr, nullptr, rows,
                                                                      zero_padding);
  });
  return CheckCuda(e, "dispatch rows");
}

ffi::Error CombineRows(cudaStream_t stream, int device, ffi::DataType t, const void* rows, int64_t R, int64_t d,
                       const int32_t* row_of_slot, const float* weights, int64_t T, int64_t k, void* y) {
  cudaError_t e = cudaSuccess;
  ByTypeAndWidth(t, d, [&](auto zero, auto width) {
    using E = decltype(zero);
    constexpr int V = decltype(width)::value;
    const int64_t units = d / V;
    const int threads = int(std::min<int64_t>(256, (units + 31) / 32 * 32));
    const dim3 grid(unsigned(T), unsigned((units + threads - 1) / threads));
    e = LaunchOverlapped(CombineKernel<E, V>, grid, threads, 0, stream, device, static_cast<const E*>(rows), R, d,
                         row_of_slot, weights, k, static_cast<E*>(y));
  });
  return CheckCuda(e, "combine");
}

ffi::Error CombineBackwardRows(cudaStream_t stream, int device, ffi::DataType t, const void* dy, const void* rows,
                               const int32_t* row_of_slot, const int32_t* slot_of_row, const float* weights,
                               int64_t T, int64_t k, int64_t R, int64_t d, void* drows, float* dweights,
                               bool zero_padding) {
  cudaError_t e = cudaSuccess;
  ByTypeAndWidth(t, d, [&](auto zero, auto width) {
    using E = decltype(zero);
    constexpr int V = decltype(width)::value;
    e = weights ? LaunchScatter<E, V, true>(stream, device, dy, T, k, d, row_of_slot, slot_of_row, R, weights, rows,
                                            dweights, drows, zero_padding)
                : LaunchScatter<E, V, false>(stream, device, dy, T, k, d, row_of_slot, slot_of_row, R, nullptr,
                                             nullptr, nullptr, drows, zero_padding);
  });
  return CheckCuda(e, "combine backward");
}

}  // namespace jaxmlp
