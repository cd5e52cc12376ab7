#include "cuda/fp8/fp8_mlp_kernels.h"

#include <algorithm>
#include <string>

#include "activations.h"
#include "cuda/block_reduce.cuh"
#include "cuda/elements.cuh"
#include "cuda/fp8/tensor_scale.cuh"
#include "cuda/fp8/transposed_tile.cuh"
#include "cuda/group_scan.cuh"
#include "cuda/launch.cuh"
#include "cuda/mlp/row_bias.cuh"

namespace jaxmlp {
namespace {

constexpr int kThreads = 128;  // a block walks whole rows

template <typename T>
__device__ void ZeroRow(T* row, int64_t n) {
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) row[j] = T(0.0f);
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

// Pass 1 of the backward with 16-bit weight gradients (see fp8_mlp_kernels.h).
// With dhq (delayed scaling) it also does pass 2's work with the scale of *given_dh where that is positive,
// ActBackwardQuantizeKernel's arithmetic, and *amax_dh gets dh's maximum as observed.
template <typename T, int V, Act kAct>
__global__ void __launch_bounds__(kThreads) ActBackwardAbsMaxKernel(ActParams p, const int64_t* offsets, int64_t E,
                                                                    int64_t M, int64_t f, int64_t d, const T* h,
                                                                    const T* da, const T* scales, const T* dy,
                                                                    const T* b2, T* a16, T* dscales, T* dx,
                                                                    float* amax_dh, const float* given_dh,
                                                                    float* scale_dh, uint8_t* dhq, T* dh) {
  constexpr bool kGated = IsGated(kAct);
  const int64_t valid = offsets[E], F1 = kGated ? 2 * f : f;
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
      Bytes<V> qg, qu;
      Vec<T, V> a, vg, vu;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const ActGrad r = act(k);
        const float dak = ToFloat(dav.v[k]), g = dak * s, dgate = g * r.dgate, dup = g * r.dup;
        ds += dak * r.val;
        a.v[k] = T(r.val * s);
        m = fmaxf(m, fabsf(dgate));
        if (kGated) m = fmaxf(m, fabsf(dup));
        qg.b[k] = ToE4m3(dgate * inv_dh);
        qu.b[k] = ToE4m3(dup * inv_dh);
        vg.v[k] = T(dgate);
        vu.v[k] = T(dup);
      }
      Store<T, V>(a16 + row * f + j, a);
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

// The backward's activation over tiles (ActivationBackwardTiles): block (x, y) takes rows [128 x, +128) and
// a's columns [128 y, +128) with dh's gate and up columns of the same indices. A thread takes 8 columns of
// every 16th row of the tile (V = 8: 16-byte loads of h's halves and da), kActTileBatch rows' loads in flight
// at a time, stores dh's rows where asked and leaves the e4m3 values of a, dh's gate and dh's up in the block's
// tiles (dynamic shared memory, transposed_tile.cuh's layout), which the block then stores transposed.
//
// Why tiles and not ActBackwardAbsMaxKernel's rows: the weight gradients read a and dh transposed, and a
// row pass left that to QuantizeTileKernel, one more pass that read and wrote them (docs/fp8-performance.md).
// Why 2 blocks an SM (up to 128 registers): at 3 (80) the gated activations' kernels spill.
constexpr int kActTileBatch = 2;
template <typename T, Act kAct>
__global__ void __launch_bounds__(kTileThreads, 2)
    ActBackwardTileKernel(ActParams p, int64_t f, const T* h, const T* da, const T* scales, const float* amax_a,
                          Fp8ActTiles o) {
  constexpr bool kGated = IsGated(kAct);
  constexpr int V = 8, kRowThreads = kTile / V, kRowsPerPass = kTileThreads / kRowThreads;
  constexpr int kPasses = kTile / kRowsPerPass;
  static_assert(sizeof(T) == 2 && kPasses % kActTileBatch == 0, "16-bit types: 16-byte loads of 8 elements");
  extern __shared__ __align__(16) uint8_t tiles[];  // a's, dh gate's, dh up's: [kTile][kTile] swizzled each
  __shared__ int64_t dest[kTile];                   // at's and dht's index of (row, column 0); -1: none
  __shared__ int8_t padding[kTile];
  __shared__ uint32_t windows[kTile];
  if (o.skip && *o.skip > 0.0f) return;  // the whole grid alike, as the next line
  const bool emit_dh = o.dh_amax && (!o.dh_if_positive || *o.dh_amax > 0.0f);
  if (emit_dh && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *o.scale_dh = DequantScale(*o.dh_amax);
  const int64_t F1 = kGated ? 2 * f : f, valid = o.layout.row_offsets[o.layout.E];
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  if (r0 >= valid) return;  // the same for the whole block
  const bool transposed = o.at || emit_dh;
  const int64_t base = transposed ? TileDestinations(o.layout, r0, valid, dest, padding) : -1;
  const int cc = (threadIdx.x % kRowThreads) * V, first_row = threadIdx.x / kRowThreads;
  const int64_t c = c0 + cc;
  const bool column_in = c < f;  // f % 16 == 0: a thread's 8 columns are all in or all out
  const float inv_a = InverseScale(amax_a), inv_dh = emit_dh ? InverseScale(o.dh_amax) : 1.0f;
  uint8_t* dhq = static_cast<uint8_t*>(o.dhq);
  T* dh = static_cast<T*>(o.dh);
  float m = 0.0f;
#pragma unroll
  for (int i0 = 0; i0 < kPasses; i0 += kActTileBatch) {
    Vec<T, V> gate[kActTileBatch], up[kActTileBatch], dav[kActTileBatch];
    float s[kActTileBatch];
#pragma unroll
    for (int b = 0; b < kActTileBatch; ++b) {
      const int64_t r = r0 + first_row + (i0 + b) * kRowsPerPass;
      if (r < valid && column_in) {
        gate[b] = Load<T, V>(h + r * F1 + c);
        if (kGated) up[b] = Load<T, V>(h + r * F1 + f + c);
        dav[b] = Load<T, V>(da + r * f + c);
        s[b] = scales ? ToFloat(scales[r]) : 1.0f;
      }
    }
#pragma unroll
    for (int b = 0; b < kActTileBatch; ++b) {
      const int rr = first_row + (i0 + b) * kRowsPerPass;
      const int64_t r = r0 + rr;
      Bytes<V> qa{}, qg{}, qu{};
      float ds = 0.0f;
      if (r < valid && column_in) {
        Vec<T, V> vg, vu;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const ActGrad g = ActivationGradOf<kAct>(p, ToFloat(gate[b].v[k]), kGated ? ToFloat(up[b].v[k]) : 0.0f);
          const float dak = ToFloat(dav[b].v[k]), gs = dak * s[b], dgate = gs * g.dgate, dup = gs * g.dup;
          ds += dak * g.val;
          qa.b[k] = ToE4m3(g.val * s[b] * inv_a);
          m = fmaxf(m, fabsf(dgate));
          if (kGated) m = fmaxf(m, fabsf(dup));
          qg.b[k] = ToE4m3(dgate * inv_dh);
          qu.b[k] = ToE4m3(dup * inv_dh);
          vg.v[k] = T(dgate);
          vu.v[k] = T(dup);
        }
        if (emit_dh) {
          *reinterpret_cast<Bytes<V>*>(dhq + r * F1 + c) = qg;
          if (kGated) *reinterpret_cast<Bytes<V>*>(dhq + r * F1 + f + c) = qu;
          if (dh) {
            Store<T, V>(dh + r * F1 + c, vg);
            if (kGated) Store<T, V>(dh + r * F1 + f + c, vu);
          }
        }
      }
      if (o.ds_parts) {  // the row's sum over the tile's columns: its kRowThreads threads, aligned lanes
#pragma unroll
        for (int x = kRowThreads / 2; x > 0; x /= 2) ds += __shfl_xor_sync(~0u, ds, x);
        if (cc == 0 && column_in && r < valid) o.ds_parts[r * gridDim.y + blockIdx.y] = ds;  // (f > 0)
      }
      *reinterpret_cast<Bytes<V>*>(&tiles[Swizzled(rr, cc)]) = qa;  // V <= 16: within one chunk
      *reinterpret_cast<Bytes<V>*>(&tiles[kTile * kTile + Swizzled(rr, cc)]) = qg;
      if (kGated) *reinterpret_cast<Bytes<V>*>(&tiles[2 * kTile * kTile + Swizzled(rr, cc)]) = qu;
    }
  }
  if (o.observed) BlockReduceAbsMax<kTileThreads / 32>(m, o.observed);  // every thread of the block reaches it
  if (!transposed) return;
  const TransposedStores plan = PlanTransposedStores(base, dest, padding, windows);
  const int64_t ld = o.layout.ld;
  if (o.at)
    StoreTransposedTile(plan, tiles, dest, padding, windows, static_cast<uint8_t*>(o.at) + c0 * ld, ld, f - c0);
  if (!emit_dh) return;
  uint8_t* dht = static_cast<uint8_t*>(o.dht);
  StoreTransposedTile(plan, tiles + kTile * kTile, dest, padding, windows, dht + c0 * ld, ld, f - c0);
  if (kGated)
    StoreTransposedTile(plan, tiles + 2 * kTile * kTile, dest, padding, windows, dht + (f + c0) * ld, ld, f - c0);
}

// ActivationBackwardRows: rows grid-stride, a block a row (BlockSum); without dscales only the padding rows.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) ActBackwardRowsKernel(const int64_t* offsets, int64_t E, int64_t M,
                                                                  int64_t d, const float* ds_parts, int64_t parts,
                                                                  const T* dy, const T* b2, T* dscales, T* dx) {
  const int64_t valid = offsets[E];
  for (int64_t row = (dscales ? 0 : valid) + blockIdx.x; row < M; row += gridDim.x) {
    if (row >= valid) {
      ZeroRow(dx + row * d, d);
      if (dscales && threadIdx.x == 0) dscales[row] = T(0.0f);
      continue;
    }
    float ds = 0.0f;
    if (threadIdx.x == 0)
      for (int64_t i = 0; i < parts; ++i) ds += ds_parts[row * parts + i];
    if (b2) ds += BiasDotShare<T, V>(dy + row * d, b2 + GroupOf(offsets, E, row) * d, d);
    ds = BlockSum<kThreads / 32>(ds);
    if (threadIdx.x == 0) dscales[row] = T(ds);
  }
}

}  // namespace

// Launches kernel<T, V, Act> chosen at run time; V = 8 (16-byte loads): the FP8 path needs f % 16 == 0.
#define JAXMLP_ACT_LAUNCH(KERNEL, GRID, ...)                                                   \
  By16BitType(t, [&](auto tag) {                                                               \
    using T = decltype(tag);                                                                   \
    ByAct(p.act, [&](auto act) {                                                               \
      KERNEL<T, 8, decltype(act)::value><<<GRID, kThreads, 0, stream>>>(__VA_ARGS__);          \
    });                                                                                        \
  })

ffi::Error ActivationAbsMax(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                            int64_t E, int64_t M, int64_t f, int64_t d, void* h, const void* b1, const void* scales,
                            void* y, const void* b2, float* amax_a, const float* given_a, float* scale_a,
                            void* aq) {
  JAXMLP_ACT_LAUNCH(ActAbsMaxKernel, AmaxGridBlocks(M, 1), p, offsets, E, M, f, d, static_cast<T*>(h),
                    static_cast<const T*>(b1), static_cast<const T*>(scales), static_cast<T*>(y),
                    static_cast<const T*>(b2), amax_a, given_a, scale_a, static_cast<uint8_t*>(aq));
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation amax kernel");
}

ffi::Error ActivationQuantize(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                              int64_t E, int64_t M, int64_t f, const void* h, const void* scales, const float* amax_a,
                              float* scale_a, void* aq, const float* skip, float* amax_out) {
  JAXMLP_ACT_LAUNCH(ActQuantizeKernel, AmaxGridBlocks(M, 1), p, offsets, E, f, static_cast<const T*>(h),
                    static_cast<const T*>(scales), amax_a, scale_a, static_cast<uint8_t*>(aq), skip, amax_out);
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation kernel");
}

ffi::Error ActivationBackwardAbsMax(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                                    int64_t E, int64_t M, int64_t f, int64_t d, const void* h, const void* da,
                                    const void* scales, const void* dy, const void* b2, void* a16, void* dscales,
                                    void* dx, float* amax_dh, const float* given_dh, float* scale_dh, void* dhq,
                                    void* dh) {
  JAXMLP_ACT_LAUNCH(ActBackwardAbsMaxKernel, AmaxGridBlocks(M, 1), p, offsets, E, M, f, d, static_cast<const T*>(h),
                    static_cast<const T*>(da), static_cast<const T*>(scales), static_cast<const T*>(dy),
                    static_cast<const T*>(b2), static_cast<T*>(a16), static_cast<T*>(dscales), static_cast<T*>(dx),
                    amax_dh, given_dh, scale_dh, static_cast<uint8_t*>(dhq), static_cast<T*>(dh));
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation backward kernel");
}

ffi::Error ActivationBackwardQuantize(cudaStream_t stream, ffi::DataType t, const ActParams& p, const int64_t* offsets,
                                      int64_t E, int64_t M, int64_t f, const void* h, const void* da,
                                      const void* scales, const float* amax_dh, float* scale_dh, void* dhq,
                                      void* dh, const float* skip) {
  JAXMLP_ACT_LAUNCH(ActBackwardQuantizeKernel, AmaxGridBlocks(M, 1), p, offsets, E, f, static_cast<const T*>(h),
                    static_cast<const T*>(da), static_cast<const T*>(scales), amax_dh, scale_dh,
                    static_cast<uint8_t*>(dhq), static_cast<T*>(dh), skip);
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation gradient kernel");
}

ffi::Error ActivationBackwardTiles(cudaStream_t stream, int device, ffi::DataType t, const ActParams& p, int64_t M,
                                   int64_t f, const void* h, const void* da, const void* scales, const float* amax_a,
                                   const Fp8ActTiles& o) {
  if (f % 16) return ffi::Error::InvalidArgument("jaxmlp: the FP8 activation tiles need f a multiple of 16");
  const int64_t row_tiles = (M + kTile - 1) / kTile, col_tiles = (f + kTile - 1) / kTile;
  if (row_tiles > INT32_MAX || col_tiles > 65535)
    return ffi::Error::InvalidArgument("jaxmlp: the FP8 activation tiles of [" + std::to_string(M) + ", " +
                                       std::to_string(f) + "] exceed the grid");
  // Block (0, 0) writes *scale_dh whatever M and f.
  const dim3 grid(unsigned(std::max<int64_t>(row_tiles, 1)), unsigned(std::max<int64_t>(col_tiles, 1)));
  cudaError_t status = cudaSuccess;
  By16BitType(t, [&](auto tag) {
    using T = decltype(tag);
    ByAct(p.act, [&](auto act) {
      constexpr Act A = decltype(act)::value;
      const auto kernel = ActBackwardTileKernel<T, A>;
      // 32 or 48 KB of tiles and the block's other shared memory: over the 48 KB a launch gets without asking
      // (gated), asked once per device and kernel (launch.cuh).
      constexpr int kBytes = (IsGated(A) ? 3 : 2) * kTile * kTile;
      status = AllowDynamicSharedMemory(device, kernel, kBytes);
      if (status == cudaSuccess) {
        kernel<<<grid, kTileThreads, kBytes, stream>>>(p, f, static_cast<const T*>(h), static_cast<const T*>(da),
                                                       static_cast<const T*>(scales), amax_a, o);
        status = cudaGetLastError();
      }
    });
  });
  return CheckCuda(status, "launching the FP8 activation tiles kernel");
}

ffi::Error ActivationBackwardRows(cudaStream_t stream, ffi::DataType t, const int64_t* offsets, int64_t E, int64_t M,
                                  int64_t f, int64_t d, const float* ds_parts, const void* dy, const void* b2,
                                  void* dscales, void* dx) {
  By16BitType(t, [&](auto tag) {
    using T = decltype(tag);
    ActBackwardRowsKernel<T, 8><<<AmaxGridBlocks(M, 1), kThreads, 0, stream>>>(
        offsets, E, M, d, ds_parts, Fp8ActTileParts(f), static_cast<const T*>(dy), static_cast<const T*>(b2),
        static_cast<T*>(dscales), static_cast<T*>(dx));
  });
  return CheckCuda(cudaGetLastError(), "launching the FP8 activation rows kernel");
}

}  // namespace jaxmlp
