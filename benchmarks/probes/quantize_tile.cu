// Probe (not a benchmark): QuantizeTileKernel (x's and dy's e4m3 rows and transposed copy, the weight
// gradients' operands) against a candidate, timed in turn with cudaEvents (medians of rounds) on the
// activations' padded layout, balanced and skewed groups:
//   production  the kernel as built: 16-row chunks of the tile, each one 16-byte store where its rows are
//               aligned in the transposed layout, else 16 byte stores (every chunk of a group whose first
//               row is not a multiple of 16: any routing but groups of multiples of 16);
//   windows     the candidate: windows of 16 bytes aligned in the transposed layout, byte stores only for
//               those a tile shares with its neighbours;
//   uniform     production with groups of group_rows (no group lookups: the weights' path), where the groups
//               are equal (the same output);
//   rows only   QuantizeElementwiseKernel (the same reads, no transposed bytes: the bandwidth to aim at).
// windows' outputs are compared byte for byte with production's (poisoned buffers: an unwritten byte
// differs), also as the weights' path takes them where the groups are equal. Measured on an H200
// (benchmarks/RESULTS-fp8.md): production 2.5-2.8 TB/s balanced, 0.6-0.8 skewed (3.4x the time at dsv3's
// x); uniform 2-3% faster than production, and a variant whose group lookups searched offsets staged in
// shared memory 1-2% slower: the lookups are not what holds it at balanced routing. windows: not yet run.
// It compiles the kernels' file into itself (their anonymous namespace), on a Hopper GPU with jaxlib's
// headers:
//
//   nvcc -O3 -DNDEBUG -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -Iffi -I<jaxlib>/include \
//     benchmarks/probes/quantize_tile.cu -o quantize_tile && ./quantize_tile [rounds]
#include "cuda/fp8/fp8_mlp_kernels.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

namespace jaxmlp {
namespace {

// The 16-byte windows, aligned in the transposed layout, that a tile's rows fill in each column: a window
// starts at a valid row (dest >= 0) whose destination is a multiple of 16, follows no row of its group (the
// tile's first row, a group's first), or both; it takes the next rows of its group up to its 16th byte or the
// tile's end. windows[i] = first row | lead << 8 | rows << 16 | pad << 24 (lead: the window's bytes before
// its first row, another tile's or group's; pad: zeros of the padded layout after its last row, a group's
// last). Returns how many, at most kTile. Every thread of the block calls it; it has two barriers.
__device__ __forceinline__ int TransposedWindows(const int64_t* dest, const int8_t* padding, uint32_t* windows) {
  __shared__ int per_warp[kTile / 32];
  const int r = threadIdx.x, lane = r % 32;
  const int64_t d = r < kTile ? dest[r] : -1;
  const bool starts = d >= 0 && (r == 0 || d % 16 == 0 || dest[r - 1] != d - 1);
  const unsigned ballot = __ballot_sync(~0u, starts);  // kTileThreads: whole warps
  if (r < kTile && lane == 0) per_warp[r / 32] = __popc(ballot);
  __syncthreads();
  int before = 0, count = 0;
#pragma unroll
  for (int w = 0; w < kTile / 32; ++w) {
    before += w < r / 32 ? per_warp[w] : 0;
    count += per_warp[w];
  }
  if (starts) {
    const int lead = int(d % 16);
    int rows = 1;
    while (r + rows < kTile && lead + rows < 16 && dest[r + rows] == d + rows) ++rows;
    windows[before + __popc(ballot & ((1u << lane) - 1))] =
        uint32_t(r) | uint32_t(lead) << 8 | uint32_t(rows) << 16 | uint32_t(padding[r + rows - 1]) << 24;
  }
  __syncthreads();
  return count;
}

// The candidate: QuantizeTileKernel whose transposed stores go in windows of 16 bytes aligned in the
// transposed layout, byte stores only for windows a tile shares with its neighbours (a group cut by the
// tile's edge: at most two a column and group) or with another group (the unpadded layout).
template <typename T>
__global__ void __launch_bounds__(kTileThreads, 3) WindowsTileKernel(const T* v, int64_t R, int64_t C, const float* amax,
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
  __shared__ uint32_t windows[kTile];
  const int count = TransposedWindows(dest, padding, windows);
  const bool aligned = o.ld % 16 == 0;
#pragma unroll 1
  for (int unit = threadIdx.x; unit < count * kTile; unit += kTileThreads) {
    const int col = unit / count, w = windows[unit % count];
    if (c0 + col >= C) break;  // the columns grow with the unit
    const int first = w & 0xff, lead = (w >> 8) & 0xff, rows = (w >> 16) & 0xff, pad = w >> 24;
    uint64_t lo = 0, hi = 0;  // the window's rows from its byte 0, then moved to byte `lead`
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (k < rows) (k < 8 ? lo : hi) |= uint64_t(tile[Swizzled(first + k, col)]) << (8 * (k % 8));
    uint8_t* at = static_cast<uint8_t*>(o.cols_out) + (c0 + col) * o.ld + dest[first] - lead;
    if (lead == 0 && rows + pad == 16 && aligned) {
      *reinterpret_cast<uint4*>(at) = make_uint4(uint32_t(lo), uint32_t(lo >> 32), uint32_t(hi), uint32_t(hi >> 32));
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k)
        if (k < rows) at[lead + k] = uint8_t((k < 8 ? lo : hi) >> (8 * (k % 8)));
      for (int z = 0; z < pad; ++z) at[lead + rows + z] = 0;
    }
  }
}

}  // namespace
}  // namespace jaxmlp

using namespace jaxmlp;
using Bf16 = __nv_bfloat16;

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

struct Case {
  const char* name;
  int64_t R, C;
  std::vector<int64_t> sizes;
};

static std::vector<int64_t> Balanced(int E, int64_t rows) { return std::vector<int64_t>(E, rows); }

static std::vector<int64_t> Skewed(int E, int64_t total, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<double> w(E);
  for (auto& x : w) x = std::pow(std::uniform_real_distribution<double>(0, 1)(g), 4.0);
  w[1] = 0;  // an empty group
  double s = 0;
  for (double x : w) s += x;
  std::vector<int64_t> sizes(E);
  for (int e = 0; e < E; ++e) sizes[e] = int64_t(w[e] / s * total * 0.97);  // padding rows at the end
  return sizes;
}

static std::vector<int64_t> Small(int E, int most, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int64_t> sizes(E);
  for (auto& s : sizes) s = std::uniform_int_distribution<int>(0, most)(g);
  return sizes;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  const std::vector<Case> cases = {
      {"dsv3 x (32768 x 7168, 32 groups of 1024)", 32768, 7168, Balanced(32, 1024)},
      {"dsv3 x, skewed", 32768, 7168, Skewed(32, 32768, 1)},
      {"qwen3 x (32768 x 2048, 128 groups of 256)", 32768, 2048, Balanced(128, 256)},
      {"qwen3 x, skewed", 32768, 2048, Skewed(128, 32768, 2)},
      {"gptoss x (16384 x 2880, 32 groups of 512)", 16384, 2880, Balanced(32, 512)},
      {"groups of 1000 rows (16000 x 512)", 16000, 512, Balanced(16, 1000)},
      {"1000 small groups, 0-40 rows (32768 x 256)", 32768, 256, Small(1000, 40, 3)},
  };
  for (const Case& c : cases) {
    const int64_t E = c.sizes.size(), R = c.R, C = c.C;
    std::vector<int64_t> ro(E + 1, 0), co(E, 0);
    for (int64_t e = 0; e < E; ++e) ro[e + 1] = ro[e] + c.sizes[e];
    int64_t ld = 0;
    for (int64_t e = 0; e < E; ++e) co[e] = ld, ld += (c.sizes[e] + 15) / 16 * 16;
    ld = std::max<int64_t>((ld + 15) / 16 * 16, 16);
    std::vector<Bf16> host(R * C);
    std::mt19937 g(7);
    std::normal_distribution<float> n(0, 1);
    for (auto& h : host) h = __float2bfloat16(n(g));
    Bf16* v;
    int64_t *d_ro, *d_co;
    float* amax;
    uint8_t *rows[2], *cols[2];
    CHECK(cudaMalloc(&v, R * C * 2));
    CHECK(cudaMemcpy(v, host.data(), R * C * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&d_ro, (E + 1) * 8));
    CHECK(cudaMalloc(&d_co, E * 8));
    CHECK(cudaMemcpy(d_ro, ro.data(), (E + 1) * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_co, co.data(), E * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&amax, 4));
    const float four = 4.0f;
    CHECK(cudaMemcpy(amax, &four, 4, cudaMemcpyHostToDevice));
    for (int k = 0; k < 2; ++k) {
      CHECK(cudaMalloc(&rows[k], R * C));
      CHECK(cudaMalloc(&cols[k], C * ld));
      CHECK(cudaMemset(rows[k], 0x7f, R * C));  // poisoned: an unwritten byte differs
      CHECK(cudaMemset(cols[k], 0x7f, C * ld));
    }
    auto outputs = [&](int k, bool uniform) {
      Fp8Outputs o;
      o.rows_out = rows[k];
      o.cols_out = cols[k];
      o.E = E;
      o.ld = ld;
      if (uniform) {
        o.group_rows = o.group_stride = c.sizes[0];
      } else {
        o.row_offsets = d_ro;
        o.col_offsets = d_co;
      }
      return o;
    };
    const dim3 grid(unsigned((R + kTile - 1) / kTile), unsigned((C + kTile - 1) / kTile));
    auto production = [&] {
      QuantizeTileKernel<Bf16><<<grid, kTileThreads>>>(v, R, C, amax, nullptr, outputs(0, false), Fp8Rows{}, nullptr);
    };
    auto uniform = [&] {
      QuantizeTileKernel<Bf16><<<grid, kTileThreads>>>(v, R, C, amax, nullptr, outputs(0, true), Fp8Rows{}, nullptr);
    };
    auto windows = [&] {
      WindowsTileKernel<Bf16><<<grid, kTileThreads>>>(v, R, C, amax, nullptr, outputs(1, false), Fp8Rows{}, nullptr);
    };
    auto rows_only = [&] {
      Fp8Outputs o = outputs(0, false);
      o.cols_out = nullptr;
      QuantizeElementwiseKernel<Bf16, 8><<<unsigned(std::clamp<int64_t>(R * C / 2048, 1, 16384)), kElementwiseThreads>>>(
          v, R, C, amax, nullptr, o, nullptr);
    };
    // windows' outputs against production's, byte for byte, from poisoned buffers; with equal groups also
    // as the weights' path takes them (group_rows: no lookups, and no padding where they are not multiples
    // of 16: windows shared by two groups).
    auto same_as_production = [&](bool uniform_groups) {
      for (int k = 0; k < 2; ++k) {
        CHECK(cudaMemset(rows[k], 0x7f, R * C));
        CHECK(cudaMemset(cols[k], 0x7f, C * ld));
      }
      QuantizeTileKernel<Bf16><<<grid, kTileThreads>>>(v, R, C, amax, nullptr, outputs(0, uniform_groups), Fp8Rows{},
                                                       nullptr);
      WindowsTileKernel<Bf16><<<grid, kTileThreads>>>(v, R, C, amax, nullptr, outputs(1, uniform_groups), Fp8Rows{},
                                                     nullptr);
      CHECK(cudaDeviceSynchronize());
      bool same = true;
      for (int part = 0; part < 2; ++part) {
        const int64_t bytes = part ? C * ld : R * C;
        std::vector<uint8_t> a(bytes), b(bytes);
        CHECK(cudaMemcpy(a.data(), part ? cols[0] : rows[0], bytes, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(b.data(), part ? cols[1] : rows[1], bytes, cudaMemcpyDeviceToHost));
        same = same && a == b;
      }
      return same;
    };
    const bool equal = std::all_of(c.sizes.begin(), c.sizes.end(), [&](int64_t s) { return s == c.sizes[0]; }) &&
                       ro[E] == R;
    const bool same = same_as_production(false) && (!equal || same_as_production(true));
    std::vector<std::pair<const char*, std::function<void()>>> runs = {
        {"production", production}, {"windows", windows}, {"rows only", rows_only}};
    if (equal) runs.insert(runs.begin() + 2, {"uniform", uniform});
    std::vector<std::vector<float>> ms(runs.size());
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    constexpr int kReps = 20;
    for (int round = 0; round < rounds; ++round)
      for (size_t i = 0; i < runs.size(); ++i) {
        CHECK(cudaEventRecord(t0));
        for (int r = 0; r < kReps; ++r) runs[i].second();
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float t;
        CHECK(cudaEventElapsedTime(&t, t0, t1));
        ms[i].push_back(t / kReps);
      }
    CHECK(cudaGetLastError());
    std::printf("%s: windows == production byte for byte%s: %s\n", c.name, equal ? " (and uniform)" : "",
                same ? "yes" : "NO");
    const double valid = double(ro[E]);
    for (size_t i = 0; i < runs.size(); ++i) {
      std::sort(ms[i].begin(), ms[i].end());
      const float med = ms[i][ms[i].size() / 2];
      const double bytes = valid * C * (std::strcmp(runs[i].first, "rows only") ? 4 : 3);
      std::printf("  %-10s %8.1f us  %5.2f TB/s\n", runs[i].first, med * 1e3, bytes / (med * 1e-3) / 1e12);
    }
    for (int k = 0; k < 2; ++k) cudaFree(rows[k]), cudaFree(cols[k]);
    cudaFree(v), cudaFree(d_ro), cudaFree(d_co), cudaFree(amax);
  }
  return 0;
}
