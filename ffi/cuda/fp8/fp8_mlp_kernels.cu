#include "cuda/fp8/fp8_mlp_kernels.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "activations.h"
#include "cuda/block_reduce.cuh"
#include "cuda/elements.cuh"
#include "cuda/fp8/tensor_scale.cuh"
#include "cuda/group_scan.cuh"
#include "cuda/launch.cuh"
#include "cuda/mlp/row_bias.cuh"

namespace jaxmlp {
namespace {

using Fp8 = __nv_fp8_e4m3;
constexpr int kThreads = 128;   // activation kernels: a block walks whole rows
constexpr int kMaxBlocks = 1024;  // grid-stride kernels: few blocks, so few atomics on one amax

__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(Fp8 v) { return float(v); }

// Round to nearest even, saturating at +-448; NaN stays NaN (jnp.clip then astype in jaxmlp/fp8.py).
__device__ __forceinline__ uint8_t ToE4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// The block's maximum reaches *amax with one atomic per warp (fmaxf drops NaN: a NaN input quantizes to
// NaN whatever the scale, as in the emulation).
__device__ __forceinline__ void ReduceAbsMax(float v, float* amax) {
  v = WarpMax(v);
  if (threadIdx.x % 32 == 0 && v > 0.0f) AtomicMaxNonNegative(amax, v);
}

// The same with one atomic per block of kWarps full warps, every thread reaching it, for the quantizers of
// many blocks: thousands of blocks' atomics on one address serialize in the L2 (an atomic a warp took
// QuantizeElementwiseKernel from 48 to 135 us at qwen3's x: docs/performance.md, "Kernel measurements").
template <int kWarps>
__device__ __forceinline__ void BlockReduceAbsMax(float v, float* amax) {
  v = BlockMax<kWarps>(v);
  if (threadIdx.x == 0 && v > 0.0f) AtomicMaxNonNegative(amax, v);
}

template <int V>
struct alignas(V) Bytes {
  uint8_t b[V];
};

template <typename T>
__device__ void ZeroRow(T* row, int64_t n) {
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) row[j] = T(0.0f);
}

// Where row r of a quantizer's input [.., n] starts (Fp8Rows), null for a gathered row of zeros.
template <typename T>
__device__ __forceinline__ const T* RowStart(const T* v, int64_t r, int64_t n, const Fp8Rows& from) {
  if (!from.gather) return v + r * n;
  const int32_t slot = from.gather[r];
  return slot >= 0 && slot / from.top_k < from.tokens ? v + int64_t(slot / from.top_k) * n : nullptr;
}

// Four independent 16-byte loads in flight per thread and iteration: one at a time left the kernel
// latency-bound at a third of the memory bandwidth. kGathered: the rows as `from` places them (n % V == 0),
// a zero row skipped.
template <typename T, int V, bool kGathered>
__global__ void AbsMaxKernel(const T* v, const int64_t* offsets, int64_t E, int64_t rows, int64_t n, float* amax,
                             Fp8Rows from, const float* skip) {
  if (skip && *skip > 0.0f) return;  // the whole grid alike
  constexpr int kUnroll = 4;
  const int64_t count = (offsets ? offsets[E] : rows) * n;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  float m = 0.0f;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < count; i += kUnroll * stride) {
    const T* at[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = i + u * stride;
      const T* row = e < count && kGathered ? RowStart(v, e / n, n, from) : nullptr;
      at[u] = e >= count ? nullptr : kGathered ? (row ? row + e % n : nullptr) : v + e;
    }
    Vec<T, V> x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (at[u]) x[u] = Load<T, V>(at[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (at[u])
#pragma unroll
        for (int k = 0; k < V; ++k) m = fmaxf(m, fabsf(ToFloat(x[u].v[k])));
  }
  ReduceAbsMax(m, amax);
}

// Quantization into the input's layout alone: 16-byte loads, V-byte stores, rows past the valid ones
// skipped. C % V == 0. seen: where given, max |v| of the rows quantized reaches it (delayed scaling).
// Blocks of kElementwiseThreads.
constexpr int kElementwiseThreads = 256;
template <typename T, int V>
__global__ void __launch_bounds__(kElementwiseThreads)
    QuantizeElementwiseKernel(const T* v, int64_t R, int64_t C, const float* amax, float* scale_out, Fp8Outputs o,
                              float* seen) {
  if (scale_out && blockIdx.x == 0 && threadIdx.x == 0) *scale_out = amax ? DequantScale(*amax) : 1.0f;
  const int64_t count = (o.row_offsets ? o.row_offsets[o.E] : R) * C;
  const float inv = InverseScale(amax);
  uint8_t* out = static_cast<uint8_t*>(o.rows_out);
  float m = 0.0f;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < count;
       i += int64_t(gridDim.x) * blockDim.x * V) {
    const Vec<T, V> x = Load<T, V>(v + i);
    Bytes<V> q;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      q.b[k] = ToE4m3(ToFloat(x.v[k]) * inv);
      m = fmaxf(m, fabsf(ToFloat(x.v[k])));
    }
    *reinterpret_cast<Bytes<V>*>(out + i) = q;
  }
  if (seen) BlockReduceAbsMax<kElementwiseThreads / 32>(m, seen);  // the whole grid alike
}

// One 128 x 128 tile of v per block, rows along blockIdx.x. Each thread loads its 16-byte chunks of the
// tile's rows (V elements each) all at once, then quantizes them, stores them in the input's layout if asked
// (128 contiguous bytes a row) and leaves them in shared memory row-major; then each thread gathers 16 rows
// of one column of the tile, four times, and stores each as one 16-byte store into the transposed layout
// where those rows are consecutive there and aligned (always for the weights, and for activations in groups
// whose first row is a multiple of 16), else byte by byte, with the zeros of the padded layout after a
// group's last row (so no pass zeroes cols_out before). Eight threads store a column's 128 rows, 128
// contiguous bytes. C % V == 0.
//
// Why this size: with 64 x 64 tiles (4 KB of FP8 a block) each block waited on its rows' group lookups and
// one load per thread before its stores; a 128 x 128 tile spreads those waits over four times the data
// (docs/performance.md, "Kernel measurements").
//
// Shared memory: row r's 16-byte chunk j lies at chunk j ^ (r / 16 % 8): the byte loads of a warp (4
// columns by the 8 chunks of 16 rows) then touch 8 different banks, one per row (unswizzled, every row of a
// column is in one bank).
constexpr int kTile = 128, kTileThreads = 256;
__device__ __forceinline__ int Swizzled(int row, int col) { return row * kTile + (col ^ (row / 16 % 8 * 16)); }
template <typename T>
__global__ void __launch_bounds__(kTileThreads, 3) QuantizeTileKernel(const T* v, int64_t R, int64_t C, const float* amax,
                                                                   float* scale_out, Fp8Outputs o, Fp8Rows from,
                                                                   float* seen) {
  constexpr int V = 16 / sizeof(T), kRowThreads = kTile / V, kRowsPerPass = kTileThreads / kRowThreads;
  constexpr int kPasses = kTile / kRowsPerPass;
  __shared__ alignas(16) uint8_t tile[kTile * kTile];  // [row][column], swizzled
  __shared__ int64_t dest[kTile];                      // cols_out index of (row, column 0); -1: none
  __shared__ int8_t padding[kTile];                    // zeros after the row in cols_out
  const int64_t valid = o.row_offsets ? o.row_offsets[o.E] : R;
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  if (scale_out && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    *scale_out = amax ? DequantScale(*amax) : 1.0f;
  if (r0 >= valid) return;  // the same for the whole block
  const int cc = (threadIdx.x % kRowThreads) * V, first_row = threadIdx.x / kRowThreads;
  uint4 x[kPasses];  // 16 bytes a chunk (as uint4: one byte a register would spill the e4m3 chunks)
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int64_t r = r0 + first_row + i * kRowsPerPass;
    if (r < valid && c0 + cc < C) {
      const T* row = RowStart(v, r, C, from);
      x[i] = row ? *reinterpret_cast<const uint4*>(row + c0 + cc) : make_uint4(0, 0, 0, 0);  // e4m3 zeros
    }
  }
  if (o.cols_out && threadIdx.x < kTile) {  // the group lookups while the loads are in flight
    const int64_t r = r0 + threadIdx.x;
    int64_t base = -1;
    int pad = 0;
    if (r < valid) {
      const int64_t g = o.row_offsets ? GroupOf(o.row_offsets, o.E, r) : r / o.group_rows;
      const int64_t first = o.row_offsets ? o.row_offsets[g] : g * o.group_rows;
      base = g * o.group_stride + (o.col_offsets ? o.col_offsets[g] : 0) + r - first;
      // The padded layout: a group's columns start at a multiple of 16 and run to one.
      if (o.col_offsets && r + 1 == o.row_offsets[g + 1]) pad = int((16 - (r + 1 - first) % 16) % 16);
    }
    dest[threadIdx.x] = base;
    padding[threadIdx.x] = int8_t(pad);
  }
  const float inv = InverseScale(amax);
  uint8_t* rows_out = static_cast<uint8_t*>(o.rows_out);
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int rr = first_row + i * kRowsPerPass;
    const int64_t r = r0 + rr;
    Bytes<V> q{};
    if (r < valid && c0 + cc < C) {
      if constexpr (std::is_same_v<T, Fp8>) {  // a transposition of e4m3 data (amax null): its bytes
        q = *reinterpret_cast<const Bytes<V>*>(&x[i]);
      } else {
        const Vec<T, V>& xv = *reinterpret_cast<const Vec<T, V>*>(&x[i]);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          q.b[k] = ToE4m3(ToFloat(xv.v[k]) * inv);
          m = fmaxf(m, fabsf(ToFloat(xv.v[k])));
        }
      }
      if (rows_out) *reinterpret_cast<Bytes<V>*>(rows_out + r * C + c0 + cc) = q;
    }
    *reinterpret_cast<Bytes<V>*>(&tile[Swizzled(rr, cc)]) = q;  // V <= 16: within one chunk
  }
  if (seen) BlockReduceAbsMax<kTileThreads / 32>(m, seen);  // every thread of the block reaches it
  if (!o.cols_out) return;  // the rows alone: gathered ones, which QuantizeElementwiseKernel does not read
  __syncthreads();
  // kTile columns x kTile / 16 chunks of 16 rows = 4 kTileThreads chunks: four per thread, a column each.
  constexpr int kChunks = kTile / 16;
#pragma unroll 1
  for (int pass = 0; pass < kTile * kChunks / kTileThreads; ++pass) {
    const int unit = pass * kTileThreads + threadIdx.x;
    const int col = unit / kChunks, first = (unit % kChunks) * 16;
    if (c0 + col >= C) break;  // the columns grow with the pass
    uint32_t packed[4] = {};
#pragma unroll
    for (int k = 0; k < 16; ++k) packed[k / 4] |= uint32_t(tile[Swizzled(first + k, col)]) << (8 * (k % 4));
    uint8_t* cols_out = static_cast<uint8_t*>(o.cols_out) + (c0 + col) * o.ld;
    const int64_t d0 = dest[first], d15 = dest[first + 15];
    if (d0 >= 0 && d15 == d0 + 15 && d0 % 16 == 0 && o.ld % 16 == 0) {
      *reinterpret_cast<uint4*>(cols_out + d0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    } else {
      for (int k = 0; k < 16; ++k) {
        const int64_t d = dest[first + k];
        if (d < 0) continue;
        cols_out[d] = uint8_t(packed[k / 4] >> (8 * (k % 4)));
        for (int z = 1; z <= padding[first + k]; ++z) cols_out[d + z] = 0;
      }
    }
  }
}

// The activation kernels walk the rows grid-stride, a block per row at a time. Within row `row` of h, each
// thread takes V elements at a time, as one load of the gate half and (gated) one of the up half, and calls
// fn(j, act) for columns [j, j + V), act(k) being the activation and its derivatives at column j + k.
template <typename T, int V, Act kAct, typename Fn>
__device__ __forceinline__ void ForEachActChunk(const ActParams& p, const T* h, int64_t row, int64_t f, Fn&& fn) {
  constexpr bool kGated = IsGated(kAct);
  const T* hr = h + row * (kGated ? 2 * f : f);
  for (int64_t j = threadIdx.x * V; j < f; j += blockDim.x * V) {
    const Vec<T, V> gate = Load<T, V>(hr + j);
    Vec<T, V> up;
    if (kGated) up = Load<T, V>(hr + f + j);
    fn(j, [&](int k) { return ActivationGradOf<kAct>(p, ToFloat(gate.v[k]), kGated ? ToFloat(up.v[k]) : 0.0f); });
  }
}

// h's row += b (FC1's bias of the row's group), rounded to T in place, each V-element chunk by the thread
// that ForEachActChunk then has read it back (no barrier between them).
template <typename T, int V, bool kGated>
__device__ __forceinline__ void AddBias(T* hr, const T* b, int64_t f) {
  for (int64_t j = threadIdx.x * V; j < f; j += blockDim.x * V)
#pragma unroll
    for (int half = 0; half < (kGated ? 2 : 1); ++half)
      Store<T, V>(hr + half * f + j, PlusBias<T, V>(Load<T, V>(hr + half * f + j), b + half * f + j));
}

// With aq (delayed scaling: the scale known before the pass) it also quantizes a into aq with the scale of
// *given where that is positive, ActQuantizeKernel's arithmetic, and *amax gets a's maximum as observed.
template <typename T, int V, Act kAct>
__global__ void __launch_bounds__(kThreads) ActAbsMaxKernel(ActParams p, const int64_t* offsets, int64_t E, int64_t M,
                                                            int64_t f, int64_t d, T* h, const T* b1,
                                                            const T* scales, T* y, const T* b2, float* amax,
                                                            const float* given, float* scale_out, uint8_t* aq) {
  constexpr bool kGated = IsGated(kAct);
  const int64_t F1 = kGated ? 2 * f : f, valid = offsets[E];
  aq = aq && *given > 0.0f ? aq : nullptr;  // the whole grid alike
  if (aq && blockIdx.x == 0 && threadIdx.x == 0) *scale_out = DequantScale(*given);
  const float inv = aq ? InverseScale(given) : 1.0f;
  float m = 0.0f;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    if (row >= valid) {  // padding: the GEMMs write only group rows
      ZeroRow(h + row * F1, F1);
      ZeroRow(y + row * d, d);
      continue;
    }
    const float s = scales ? ToFloat(scales[row]) : 1.0f;
    const int64_t g = (b1 || b2) ? GroupOf(offsets, E, row) : 0;
    if (b1) AddBias<T, V, kGated>(h + row * F1, b1 + g * F1, f);
    if (b2) ScaledBiasRow<T, V>(y + row * d, b2 + g * d, s, d);
    ForEachActChunk<T, V, kAct>(p, h, row, f, [&](int64_t j, auto act) {
      Bytes<V> q;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float a = act(k).val * s;
        m = fmaxf(m, fabsf(a));
        q.b[k] = ToE4m3(a * inv);
      }
      if (aq) *reinterpret_cast<Bytes<V>*>(aq + row * f + j) = q;
    });
  }
  ReduceAbsMax(m, amax);
}

// skip (delayed scaling): nothing where *skip is positive (ActAbsMaxKernel quantized a by it); else a by its
// own *amax, which amax_out (the amax the backward scales a by) then holds too.
template <typename T, int V, Act kAct>
__global__ void __launch_bounds__(kThreads) ActQuantizeKernel(ActParams p, const int64_t* offsets, int64_t E,
                                                              int64_t f, const T* h, const T* scales,
                                                              const float* amax, float* scale_out, uint8_t* aq,
                                                              const float* skip, float* amax_out) {
  if (skip && *skip > 0.0f) return;  // the whole grid alike
  const int64_t valid = offsets[E];
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *scale_out = DequantScale(*amax);
    if (amax_out) *amax_out = *amax;
  }
  const float inv = InverseScale(amax);
  for (int64_t row = blockIdx.x; row < valid; row += gridDim.x) {
    const float s = scales ? ToFloat(scales[row]) : 1.0f;
    ForEachActChunk<T, V, kAct>(p, h, row, f, [&](int64_t j, auto act) {
      Bytes<V> q;
#pragma unroll
      for (int k = 0; k < V; ++k) q.b[k] = ToE4m3(act(k).val * s * inv);
      *reinterpret_cast<Bytes<V>*>(aq + row * f + j) = q;
    });
  }
}

// Pass 1 of the backward (see fp8_mlp_kernels.h).
// With dhq (delayed scaling) it also does pass 2's work with the scale of *given_dh where that is positive,
// ActBackwardQuantizeKernel's arithmetic, and *amax_dh gets dh's maximum as observed.
template <typename T, int V, Act kAct>
__global__ void __launch_bounds__(kThreads) ActBackwardAbsMaxKernel(ActParams p, const int64_t* offsets, int64_t E,
                                                                    int64_t M, int64_t f, int64_t d, const T* h,
                                                                    const T* da, const T* scales, const float* amax_a,
                                                                    const T* dy, const T* b2, uint8_t* aq, T* a16,
                                                                    T* dscales, T* dx, float* amax_dh,
                                                                    const float* given_dh, float* scale_dh,
                                                                    uint8_t* dhq, T* dh) {
  constexpr bool kGated = IsGated(kAct);
  const int64_t valid = offsets[E], F1 = kGated ? 2 * f : f;
  const float inv_a = InverseScale(amax_a);
  dhq = dhq && *given_dh > 0.0f ? dhq : nullptr;  // the whole grid alike
  if (dhq && blockIdx.x == 0 && threadIdx.x == 0) *scale_dh = DequantScale(*given_dh);
  const float inv_dh = dhq ? InverseScale(given_dh) : 1.0f;
  float m = 0.0f;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {  // the whole block takes each row: BlockSum
    if (row >= valid) {
      ZeroRow(dx + row * d, d);
      if (dscales && threadIdx.x == 0) dscales[row] = T(0.0f);
      continue;
    }
    const float s = scales ? ToFloat(scales[row]) : 1.0f;
    float ds = 0.0f;
    ForEachActChunk<T, V, kAct>(p, h, row, f, [&](int64_t j, auto act) {
      const Vec<T, V> dav = Load<T, V>(da + row * f + j);
      Bytes<V> q, qg, qu;
      Vec<T, V> a, vg, vu;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const ActGrad r = act(k);
        const float dak = ToFloat(dav.v[k]), g = dak * s, dgate = g * r.dgate, dup = g * r.dup;
        ds += dak * r.val;
        q.b[k] = ToE4m3(r.val * s * inv_a);
        a.v[k] = T(r.val * s);
        m = fmaxf(m, fabsf(dgate));
        if (kGated) m = fmaxf(m, fabsf(dup));
        qg.b[k] = ToE4m3(dgate * inv_dh);
        qu.b[k] = ToE4m3(dup * inv_dh);
        vg.v[k] = T(dgate);
        vu.v[k] = T(dup);
      }
      if (a16) Store<T, V>(a16 + row * f + j, a);
      else *reinterpret_cast<Bytes<V>*>(aq + row * f + j) = q;
      if (dhq) {
        *reinterpret_cast<Bytes<V>*>(dhq + row * F1 + j) = qg;
        if (kGated) *reinterpret_cast<Bytes<V>*>(dhq + row * F1 + f + j) = qu;
      }
      if (dhq && dh) {
        Store<T, V>(dh + row * F1 + j, vg);
        if (kGated) Store<T, V>(dh + row * F1 + f + j, vu);
      }
    });
    if (dscales && b2) ds += BiasDotShare<T, V>(dy + row * d, b2 + GroupOf(offsets, E, row) * d, d);
    if (dscales) {
      ds = BlockSum<kThreads / 32>(ds);
      if (threadIdx.x == 0) dscales[row] = T(ds);
    }
  }
  ReduceAbsMax(m, amax_dh);
}

template <typename T, int V, Act kAct>
__global__ void __launch_bounds__(kThreads) ActBackwardQuantizeKernel(ActParams p, const int64_t* offsets, int64_t E,
                                                                      int64_t f, const T* h, const T* da,
                                                                      const T* scales, const float* amax_dh,
                                                                      float* scale_out, uint8_t* dhq, T* dh,
                                                                      const float* skip) {
  if (skip && *skip > 0.0f) return;  // delayed scaling: ActBackwardAbsMaxKernel quantized dh by it
  constexpr bool kGated = IsGated(kAct);
  const int64_t F1 = kGated ? 2 * f : f, valid = offsets[E];
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = DequantScale(*amax_dh);
  const float inv = InverseScale(amax_dh);
  for (int64_t row = blockIdx.x; row < valid; row += gridDim.x) {
    const float s = scales ? ToFloat(scales[row]) : 1.0f;
    ForEachActChunk<T, V, kAct>(p, h, row, f, [&](int64_t j, auto act) {
      const Vec<T, V> dav = Load<T, V>(da + row * f + j);
      Bytes<V> qg, qu;
      Vec<T, V> vg, vu;  // dh itself in T, where it is asked for (db1)
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const ActGrad r = act(k);
        const float g = ToFloat(dav.v[k]) * s, dgate = g * r.dgate, dup = g * r.dup;
        qg.b[k] = ToE4m3(dgate * inv);
        qu.b[k] = ToE4m3(dup * inv);
        vg.v[k] = T(dgate);
        vu.v[k] = T(dup);
      }
      *reinterpret_cast<Bytes<V>*>(dhq + row * F1 + j) = qg;
      if (kGated) *reinterpret_cast<Bytes<V>*>(dhq + row * F1 + f + j) = qu;
      if (dh) {
        Store<T, V>(dh + row * F1 + j, vg);
        if (kGated) Store<T, V>(dh + row * F1 + f + j, vu);
      }
    });
  }
}

__global__ void ScalesKernel(const float* amax, int n, float* scale) {
  if (threadIdx.x < n) scale[threadIdx.x] = DequantScale(amax[threadIdx.x]);
}

unsigned Blocks(int64_t work, int64_t per_block) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, kMaxBlocks)));
}

}  // namespace

ffi::Error AbsMax(cudaStream_t stream, ffi::DataType t, const void* v, const int64_t* offsets, int64_t E,
                  int64_t rows, int64_t n, float* amax, const Fp8Rows& from, const float* skip) {
  if (from.gather && (n % 8 || from.top_k < 1))
    return ffi::Error::InvalidArgument("jaxmlp: a gathered FP8 amax needs rows of a multiple of 8, top_k >= 1");
  By16BitType(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const unsigned grid = Blocks(rows * n, 256 * V);
    const T* tv = static_cast<const T*>(v);
    if (from.gather) AbsMaxKernel<T, V, true><<<grid, 256, 0, stream>>>(tv, offsets, E, rows, n, amax, from, skip);
    else if (n % V == 0)
      AbsMaxKernel<T, V, false><<<grid, 256, 0, stream>>>(tv, offsets, E, rows, n, amax, from, skip);
    else AbsMaxKernel<T, 1, false><<<grid, 256, 0, stream>>>(tv, offsets, E, rows, n, amax, from, skip);
  });
  return CheckCuda(cudaGetLastError(), "launching the FP8 amax kernel");
}

ffi::Error QuantizeRows(cudaStream_t stream, ffi::DataType t, const void* v, int64_t R, int64_t C, const float* amax,
                        float* scale_out, const Fp8Outputs& out, const Fp8Rows& from, float* seen) {
  if (C % 16) return ffi::Error::InvalidArgument("jaxmlp: FP8 quantization needs rows of a multiple of 16 elements");
  if (seen && t == ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("jaxmlp: an FP8 transposition has no maximum to observe");
  if (from.gather && (t == ffi::DataType::F8E4M3FN || from.top_k < 1))
    return ffi::Error::InvalidArgument("jaxmlp: gathered FP8 quantization reads 16-bit tokens, top_k >= 1");
  const int64_t row_tiles = (R + kTile - 1) / kTile, col_tiles = (C + kTile - 1) / kTile;
  if (row_tiles > INT32_MAX || col_tiles > 65535)
    return ffi::Error::InvalidArgument("jaxmlp: FP8 quantization of a [" + std::to_string(R) + ", " +
                                       std::to_string(C) + "] tensor exceeds the grid");
  const dim3 grid(unsigned(std::max<int64_t>(row_tiles, 1)), unsigned(std::max<int64_t>(col_tiles, 1)));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (out.cols_out || from.gather)
      QuantizeTileKernel<T><<<grid, kTileThreads, 0, stream>>>(static_cast<const T*>(v), R, C, amax, scale_out, out,
                                                               from, seen);
    else
      QuantizeElementwiseKernel<T, V>
          <<<unsigned(std::clamp<int64_t>(R * C / (kElementwiseThreads * V), 1, 16384)), kElementwiseThreads, 0,
             stream>>>(static_cast<const T*>(v), R, C, amax, scale_out, out, seen);
  };
  if (t == ffi::DataType::F8E4M3FN) launch(Fp8{});
  else By16BitType(t, launch);
  return CheckCuda(cudaGetLastError(), "launching the FP8 quantization kernel");
}

// Launches kernel<T, V, Act> chosen at run time; V = 8 (16-byte loads): the FP8 path needs f % 16 == 0.
#define JAXMLP_ACT_LAUNCH(KERNEL, GRID, ...)                                                   \
  By16BitType(t, [&](auto tag) {                                                               \
    using T = decltype(tag);                                                                   \
    ByAct(p.act, [&](auto act) {                                                               \
      KERNEL<T, 8, decltype(act)::value><<<GRID, kThreads, 0, stream>>>(__VA_ARGS__);          \
    });                                                                                        \
  })

__global__ void ZeroPaddedTailKernel(uint8_t* cols, int64_t R, int64_t ld, const int64_t* padded_end) {
  const int64_t end = std::clamp<int64_t>(*padded_end, 0, ld);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x)
    for (int64_t j = end + threadIdx.x; j < ld; j += blockDim.x) cols[r * ld + j] = 0;
}

ffi::Error ZeroPaddedTail(cudaStream_t stream, void* cols, int64_t R, int64_t ld, const int64_t* padded_end) {
  if (R == 0 || ld == 0) return ffi::Error::Success();
  ZeroPaddedTailKernel<<<unsigned(std::min<int64_t>(R, 4096)), 256, 0, stream>>>(static_cast<uint8_t*>(cols), R, ld,
                                                                                 padded_end);
  return CheckCuda(cudaGetLastError(), "launching the padded layout's tail zeroing");
}

ffi::Error ActivationAbsMax(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                            int64_t E, int64_t M, int64_t f, int64_t d, void* h, const void* b1, const void* scales,
                            void* y, const void* b2, float* amax_a, const float* given_a, float* scale_a,
                            void* aq) {
  JAXMLP_ACT_LAUNCH(ActAbsMaxKernel, Blocks(M, 1), p, offsets, E, M, f, d, static_cast<T*>(h),
                    static_cast<const T*>(b1), static_cast<const T*>(scales), static_cast<T*>(y),
                    static_cast<const T*>(b2), amax_a, given_a, scale_a, static_cast<uint8_t*>(aq));
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation amax kernel");
}

ffi::Error ActivationQuantize(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                              int64_t E, int64_t M, int64_t f, const void* h, const void* scales, const float* amax_a,
                              float* scale_a, void* aq, const float* skip, float* amax_out) {
  JAXMLP_ACT_LAUNCH(ActQuantizeKernel, Blocks(M, 1), p, offsets, E, f, static_cast<const T*>(h),
                    static_cast<const T*>(scales), amax_a, scale_a, static_cast<uint8_t*>(aq), skip, amax_out);
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation kernel");
}

ffi::Error ActivationBackwardAbsMax(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                                    int64_t E, int64_t M, int64_t f, int64_t d, const void* h, const void* da,
                                    const void* scales, const float* amax_a, const void* dy, const void* b2,
                                    void* aq, void* a16, void* dscales, void* dx, float* amax_dh,
                                    const float* given_dh, float* scale_dh, void* dhq, void* dh) {
  JAXMLP_ACT_LAUNCH(ActBackwardAbsMaxKernel, Blocks(M, 1), p, offsets, E, M, f, d, static_cast<const T*>(h),
                    static_cast<const T*>(da), static_cast<const T*>(scales), amax_a, static_cast<const T*>(dy),
                    static_cast<const T*>(b2), static_cast<uint8_t*>(aq), static_cast<T*>(a16),
                    static_cast<T*>(dscales), static_cast<T*>(dx), amax_dh, given_dh, scale_dh,
                    static_cast<uint8_t*>(dhq), static_cast<T*>(dh));
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation backward kernel");
}

ffi::Error ActivationBackwardQuantize(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                                      int64_t E, int64_t M, int64_t f, const void* h, const void* da,
                                      const void* scales, const float* amax_dh, float* scale_dh, void* dhq,
                                      void* dh, const float* skip) {
  JAXMLP_ACT_LAUNCH(ActBackwardQuantizeKernel, Blocks(M, 1), p, offsets, E, f, static_cast<const T*>(h),
                    static_cast<const T*>(da), static_cast<const T*>(scales), amax_dh, scale_dh,
                    static_cast<uint8_t*>(dhq), static_cast<T*>(dh), skip);
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation gradient kernel");
}

ffi::Error ScalesOf(cudaStream_t stream, const float* amax, int n, float* scale) {
  ScalesKernel<<<1, 32, 0, stream>>>(amax, n, scale);
  return CheckCuda(cudaGetLastError(), "launching the FP8 scales kernel");
}

}  // namespace jaxmlp
