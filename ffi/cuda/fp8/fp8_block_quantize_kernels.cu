#include "cuda/fp8/fp8_block_quantize_kernels.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "activations.h"
#include "cuda/block_reduce.cuh"
#include "cuda/elements.cuh"
#include "cuda/fp8/weight_tile.cuh"
#include "cuda/launch.cuh"

namespace jaxmlp {
namespace {

// A block per 128 x 128 tile of one expert: QuantizeWeightTile of w of type T (float32 master weights too)
// rounded to the computation dtype R on the way in: the quantization of w.astype(R), with no copy of it.
// A 16-bit w is read twice (the second time from L2): holding it in registers instead, as floats or as
// 16-bit vectors, cost occupancy and was slower; unbounded, ptxas gives it 56-70 registers (three or four
// blocks an SM), 3% faster than bounded to 42 (five blocks). A wider w is held in registers (HeldTile):
// its second read missed L2. Three blocks an SM at least there: ptxas fits the held tile in 80 registers
// (84, two blocks, unbounded; a few bytes of spills from float32), as it does the adam steps'
// (fp8_adam_kernels.cu). (docs/performance.md, "Kernel measurements".)
template <typename T, typename R>
__global__ void __launch_bounds__(256, sizeof(T) > sizeof(R) ? 3 : 1)
    WeightBlocksKernel(const T* w, int64_t K, int64_t N, uint8_t* q, uint8_t* qt, int32_t* e) {
  constexpr bool kHold = sizeof(T) > sizeof(R);
  const WeightTile t(K, N);
  HeldTile<R> held;
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < WeightTile::kPasses; ++p) {
    if (!t.Holds(p)) continue;
    const Vec<T, 8> x = Load<T, 8>(w + t.Offset(p));
    if constexpr (kHold) {  // held as R, rounded once
      float v[8];
      for (int u = 0; u < 8; ++u) v[u] = Conv<T>::To(x.v[u]);
      amax = fmaxf(amax, held.Hold(p, v));
    } else {
      for (int u = 0; u < 8; ++u) amax = fmaxf(amax, fabsf(RoundedTo<R>(x.v[u])));
    }
  }
  if constexpr (kHold) {
    QuantizeWeightTile(t, amax, held, q, qt, e);
  } else {
    QuantizeWeightTile(t, amax, [&](int p, float (&v)[8]) {
      const Vec<T, 8> x = Load<T, 8>(w + t.Offset(p));
      for (int u = 0; u < 8; ++u) v[u] = RoundedTo<R>(x.v[u]);
    }, q, qt, e);
  }
}

// What RowsAndColumnsKernel quantizes, read eight consecutive elements of a row at a time into its tile of
// Value: a tensor as it lies, or an activation of h computed on the way. Either is read in the groups'
// rows only.
template <typename T>
struct TensorSource {
  using Value = T;
  using Stored = T;  // the call's 16-bit (or float32) dtype
  const T* v;
  int64_t C;
  __device__ Vec<T, 8> operator()(int64_t r, int64_t c) const { return Load<T, 8>(v + r * C + c); }
  __device__ int64_t ColumnTile(int64_t t, int64_t) const { return t; }  // the t-th block's 128 columns
};

// Without da: a = act(h) * s [M, f], as jaxmlp.fp8.blockwise.activation_rows_and_columns computes it (s: the
// row's scale, 1 without scales). With da: dh = (da * s) * act'(h) [M, F1], the gate's derivatives in
// columns [0, f) and (gated) the up half's in [f, 2f), as the vjp in activation_grad_rows_and_columns.
template <typename T, Act kAct>
struct ActivationSource {
  using Value = float;
  using Stored = T;
  ActParams p;
  const T *h, *da, *scales;
  int64_t f;
  __device__ Vec<float, 8> operator()(int64_t r, int64_t c) const {
    constexpr bool kGated = IsGated(kAct);
    const bool up_half = kGated && c >= f;  // f % 16 == 0: eight columns lie in one half
    const int64_t j = up_half ? c - f : c;
    const T* hr = h + r * (kGated ? 2 * f : f);
    const Vec<T, 8> gate = Load<T, 8>(hr + j);
    Vec<T, 8> up{}, g{};
    if (kGated) up = Load<T, 8>(hr + f + j);
    if (da) g = Load<T, 8>(da + r * f + j);
    const float s = scales ? Conv<T>::To(scales[r]) : 1.0f;
    Vec<float, 8> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const ActGrad a = ActivationGradOf<kAct>(p, Conv<T>::To(gate.v[k]), kGated ? Conv<T>::To(up.v[k]) : 0.0f);
      out.v[k] = da ? Conv<T>::To(g.v[k]) * s * (up_half ? a.dup : a.dgate) : a.val * s;
    }
    return out;
  }
  // Gated with da, a gate tile of dh and the up tile of its columns read the same h and da: consecutive
  // blocks take them (where f % 128 == 0, so that the tiles pair up), the second one's reads hit L2.
  __device__ int64_t ColumnTile(int64_t t, int64_t tiles) const {
    if (!IsGated(kAct) || !da || f % kScaleBlock) return t;
    return t / 2 + (t % 2) * (tiles / 2);
  }
};

// A block per 128-row block b of the columns' layout (first, count) and 128 columns: both the rows' and the
// columns' quantization of that 128 x 128 region from one read of it. Each row in groups lies in one block
// b; the rows past the groups, and the blocks past the groups' (no rows), are neither read nor written:
// no product reads them. Without qt (RowsAndColumns: the rows only) the block ends after the rows; with
// values, the rows' pass also stores each value rounded to Stored.
// The region is loaded into shared memory (rows 16-byte aligned: one 16-byte store per 16-byte load; all
// eight of bf16's loads in flight at once). Rows: a warp per row, four values a lane from one 8-byte read,
// its maximum by shuffles, and one 4-byte store a lane: a warp writes the row's 128 bytes at once. Columns:
// a thread per pair of columns and quarter of the rows (32), its 64 values read into registers as 32 pairs,
// the quarters' maxima met in shared memory, the quantized bytes packed four rows to a word into a
// transposed tile (over the region's, read by then), which the block writes out a row of qt (128 bytes)
// per warp store. Shared-memory instructions per element: under one, against four when each value is
// stored, read for its row and twice for its column alone (which kept neither the SMs' issue nor DRAM
// busy); and every store is a whole warp's row of q or qt, not 8 bytes a thread into another row. Three blocks an SM: the float tiles' 66 KB allow no more, and 64 registers (for four) make the
// 16-bit ones spill. The measurements behind these choices: docs/performance.md, "Kernel measurements".
template <typename T>
constexpr int kTilePitch = kScaleBlock + int(16 / sizeof(T));  // a tile row, in T: 16-byte aligned
constexpr int kQtPitch = kScaleBlock / 4 + 1;  // a transposed row, in words: 32 columns' same word in 32 banks
template <typename T>
constexpr int kTileBytes = kScaleBlock * kTilePitch<T> * int(sizeof(T));  // >= the transposed tile's
static_assert(kTileBytes<uint16_t> >= kScaleBlock * kQtPitch * 4);
template <typename Source>
__global__ void __launch_bounds__(256, 3) RowsAndColumnsKernel(Source v, int64_t M, int64_t C, const int32_t* first,
                                                            const int32_t* count, int64_t B, uint8_t* q, int32_t* e,
                                                            uint8_t* qt, int32_t* ec,
                                                            typename Source::Stored* values) {
  using T = typename Source::Value;
  using Stored = typename Source::Stored;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kPitch = kTilePitch<T>, kRows = kScaleBlock;
  T* tile = reinterpret_cast<T*>(smem);                    // [128][kPitch]
  uint32_t* qtile = reinterpret_cast<uint32_t*>(smem);     // [128 columns][kQtPitch], once tile is read
  __shared__ float quarter_max[4][kScaleBlock];
  // Blocks in row-block-major order: those of one row block run together (their rows' DRAM pages, and
  // the activations' shared reads, above).
  const int64_t tiles = ScaleBlocks(C), b = blockIdx.x / tiles;
  const int64_t column_tile = v.ColumnTile(blockIdx.x % tiles, tiles), c0 = column_tile * kScaleBlock;
  // Device data: the rows are clamped into [0, M) whatever first and count hold.
  const int64_t start = std::min<int64_t>(std::max<int32_t>(first[b], 0), M);
  const int64_t rows =
      std::min<int64_t>(std::min<int64_t>(std::max<int32_t>(count[b], 0), int64_t{kScaleBlock}), M - start);
  if (rows == 0) return;  // a block past the groups': no product reads its columns
  {  // 16 threads a row, eight columns each (C is a multiple of 16: eight are all in the row or all past it)
    constexpr int kPasses = kRows / 16, kBatch = 16 / sizeof(T);  // 256 threads: 16 rows a pass
    const int j = threadIdx.x % 16 * 8, i0 = threadIdx.x / 16;
#pragma unroll
    for (int p0 = 0; p0 < kPasses; p0 += kBatch) {
      Vec<T, 8> x[kBatch];
#pragma unroll
      for (int p = 0; p < kBatch; ++p) {
        const int i = i0 + 16 * (p0 + p);
        x[p] = Vec<T, 8>{};
        if (i < rows && c0 + j < C) x[p] = v(start + i, c0 + j);
      }
#pragma unroll
      for (int p = 0; p < kBatch; ++p) Store<T, 8>(tile + (i0 + 16 * (p0 + p)) * kPitch + j, x[p]);
    }
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool lane_in = c0 + 4 * lane < C;  // C is a multiple of 16: a lane's four columns all in or all past it
  for (int i = warp; i < rows; i += 8) {  // rows: 1 x 128 blocks
    const Vec<T, 4> xv = Load<T, 4>(tile + i * kPitch + 4 * lane);
    float x[4], amax = 0.0f;
    for (int u = 0; u < 4; ++u) {
      x[u] = Conv<T>::To(xv.v[u]);
      amax = fmaxf(amax, fabsf(x[u]));
    }
    const int exp = Exponent(WarpMax(amax));
    const int64_t r = start + i;
    if (lane == 0) e[r * tiles + column_tile] = exp;
    if (lane_in) *reinterpret_cast<uint32_t*>(q + r * C + c0 + 4 * lane) = Quantize4(x, Unscale(exp));
    if (values && lane_in) {
      Vec<Stored, 4> rounded;
      for (int u = 0; u < 4; ++u) rounded.v[u] = Conv<Stored>::From(x[u]);
      Store<Stored, 4>(values + r * C + c0 + 4 * lane, rounded);
    }
  }
  if (!qt) return;  // the rows only (the same for every thread of the grid)
  {  // columns: 128 x 1 blocks, zeros past the block's rows (the tile's rows past `rows` hold zeros)
    constexpr int kQuarter = kScaleBlock / 4;
    const int c = threadIdx.x % (kScaleBlock / 2) * 2, quarter = threadIdx.x / (kScaleBlock / 2);
    Vec<T, 2> pair[kQuarter];
    float amax0 = 0.0f, amax1 = 0.0f;
#pragma unroll
    for (int u = 0; u < kQuarter; ++u) {
      pair[u] = Load<T, 2>(tile + (quarter * kQuarter + u) * kPitch + c);
      amax0 = fmaxf(amax0, fabsf(Conv<T>::To(pair[u].v[0])));
      amax1 = fmaxf(amax1, fabsf(Conv<T>::To(pair[u].v[1])));
    }
    quarter_max[quarter][c] = amax0;
    quarter_max[quarter][c + 1] = amax1;
    __syncthreads();  // also: every read of the tile is done, qtile may take its place
    float max0 = 0.0f, max1 = 0.0f;
    for (int k = 0; k < 4; ++k) max0 = fmaxf(max0, quarter_max[k][c]), max1 = fmaxf(max1, quarter_max[k][c + 1]);
    const int exp0 = Exponent(max0), exp1 = Exponent(max1);
    if (quarter == 0 && c0 + c < C) ec[b * C + c0 + c] = exp0, ec[b * C + c0 + c + 1] = exp1;  // C, c even
    const Unscale unscale0(exp0), unscale1(exp1);
#pragma unroll
    for (int w = 0; w < kQuarter / 4; ++w) {  // four rows a word
      float x0[4], x1[4];
      for (int k = 0; k < 4; ++k) x0[k] = Conv<T>::To(pair[4 * w + k].v[0]), x1[k] = Conv<T>::To(pair[4 * w + k].v[1]);
      qtile[c * kQtPitch + quarter * (kQuarter / 4) + w] = Quantize4(x0, unscale0);
      qtile[(c + 1) * kQtPitch + quarter * (kQuarter / 4) + w] = Quantize4(x1, unscale1);
    }
  }
  __syncthreads();
  // qt's rows c0 .. c0 + 127, bytes 128 b .. 128 b + 127 of each: a warp per row, a word a lane.
  const int64_t L = B * kScaleBlock;
  for (int c = warp; c < kScaleBlock && c0 + c < C; c += 8)
    *reinterpret_cast<uint32_t*>(qt + (c0 + c) * L + b * kScaleBlock + 4 * lane) = qtile[c * kQtPitch + lane];
}

// Launches RowsAndColumnsKernel<Source> over the B column blocks.
template <typename Source>
ffi::Error LaunchRowsAndColumns(cudaStream_t stream, int32_t device, const Source& v, const RowsAndColumns& o) {
  if (o.C == 0 || o.B == 0) return ffi::Error::Success();
  using T = typename Source::Value;
  // The tiles' 34 KB (16-bit types) and 66 KB (float) of shared memory: the latter over the 48 KB a launch
  // gets without asking, asked once per device and kernel, not in every call (launch.cuh).
  const auto kernel = RowsAndColumnsKernel<Source>;
  const cudaError_t allowed = AllowDynamicSharedMemory(device, kernel, kTileBytes<T>);
  if (allowed != cudaSuccess) return CheckCuda(allowed, "allowing the rows-and-columns quantizer its shared memory");
  const unsigned grid = unsigned(o.B * ScaleBlocks(o.C));
  kernel<<<grid, 256, kTileBytes<T>, stream>>>(v, o.M, o.C, o.first, o.count, o.B, o.q, o.e, o.qt, o.ec,
                                               static_cast<typename Source::Stored*>(o.values));
  return CheckCuda(cudaGetLastError(), "launching the rows-and-columns quantizer");
}

}  // namespace

ffi::Error QuantizeRowsAndColumns(cudaStream_t stream, int device, ffi::DataType t, const void* v,
                                  const RowsAndColumns& o) {
  ffi::Error status = ffi::Error::Success();
  ByType(t, [&](auto tag) {
    using T = decltype(tag);
    status = LaunchRowsAndColumns(stream, device, TensorSource<T>{static_cast<const T*>(v), o.C}, o);
  });
  return status;
}

ffi::Error QuantizeActivationRowsAndColumns(cudaStream_t stream, int device, ffi::DataType t, const ActParams& p,
                                            const void* h, const void* da, const void* scales, int64_t f,
                                            const RowsAndColumns& o) {
  ffi::Error status = ffi::Error::Success();
  By16BitType(t, [&](auto tag) {
    using T = decltype(tag);
    ByAct(p.act, [&](auto a) {
      const ActivationSource<T, decltype(a)::value> v{p, static_cast<const T*>(h), static_cast<const T*>(da),
                                                      static_cast<const T*>(scales), f};
      status = LaunchRowsAndColumns(stream, device, v, o);
    });
  });
  return status;
}

ffi::Error QuantizeWeightBlocks(cudaStream_t stream, ffi::DataType t, ffi::DataType r, const void* w, int64_t E,
                                int64_t K, int64_t N, uint8_t* q, uint8_t* qt, int32_t* e) {
  if (E == 0 || K == 0 || N == 0) return ffi::Error::Success();
  ByType(t, [&](auto tag) {
    using T = decltype(tag);
    By16BitType(r, [&](auto rounded) {
      using R = decltype(rounded);
      WeightBlocksKernel<T, R><<<WeightTiles(E, K, N), 256, 0, stream>>>(static_cast<const T*>(w), K, N, q, qt, e);
    });
  });
  return CheckCuda(cudaGetLastError(), "launching the 128x128 quantizer");
}

}  // namespace jaxmlp
