// Probe (not a benchmark): QuantizeTileKernel (x's and dy's e4m3 rows and transposed copy, the weight
// gradients' operands) timed with cudaEvents (medians of rounds) on the activations' padded layout, with
// balanced groups (multiples of 16: its chunks path), skewed and uneven ones (its windows path):
//   production  the kernel as built;
//   uniform     the same with groups of group_rows (no group lookups: the weights' path), where the groups
//               are equal (the same output);
//   rows only   QuantizeElementwiseKernel (the same reads, no transposed bytes: the bandwidth to aim at).
// Its transposed output is checked against the host's transposition of its rows, byte for byte, in the
// padded layout (and as the weights' path takes them where the groups are equal), from poisoned buffers: an
// unwritten byte differs. Measured on an H200 (benchmarks/RESULTS-fp8.md): with chunks alone, 2.5-2.8 TB/s
// balanced and 0.6-0.8 skewed (3.5x the time at dsv3's x); windows alone 20% slower balanced.
// It compiles the kernels' file into itself (their anonymous namespace), on a Hopper GPU with jaxlib's
// headers:
//
//   nvcc -O3 -DNDEBUG -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -Iffi -I<jaxlib>/include \
//     benchmarks/probes/quantize_tile.cu -o quantize_tile && ./quantize_tile [rounds]
#include "cuda/fp8/fp8_quantize_kernels.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

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

static std::vector<int64_t> Uneven(int E, int least, int most, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int64_t> sizes(E);
  for (auto& s : sizes) s = std::uniform_int_distribution<int>(least, most)(g);
  return sizes;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  const std::vector<Case> cases = {
      {"dsv3 x (32768 x 7168, 32 groups of 1024)", 32768, 7168, Balanced(32, 1024)},
      {"dsv3 x, skewed", 32768, 7168, Skewed(32, 32768, 1)},
      {"qwen3 x (32768 x 2048, 128 groups of 256)", 32768, 2048, Balanced(128, 256)},
      {"qwen3 x, skewed", 32768, 2048, Skewed(128, 32768, 2)},
      {"qwen3 x, ragged (220-284 rows a group)", 32768, 2048, Uneven(128, 220, 284, 4)},
      {"gptoss x (16384 x 2880, 32 groups of 512)", 16384, 2880, Balanced(32, 512)},
      {"groups of 1000 rows (16000 x 512)", 16000, 512, Balanced(16, 1000)},
      {"1000 small groups, 0-40 rows (32768 x 256)", 32768, 256, Uneven(1000, 0, 40, 3)},
  };
  for (const Case& c : cases) {
    const int64_t E = c.sizes.size(), R = c.R, C = c.C;
    std::vector<int64_t> ro(E + 1, 0), co(E, 0);
    for (int64_t e = 0; e < E; ++e) ro[e + 1] = ro[e] + c.sizes[e];
    if (ro[E] > R) {
      std::fprintf(stderr, "%s: groups of %lld rows in all past R\n", c.name, (long long)ro[E]);
      return 1;
    }
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
    uint8_t *rows, *cols;
    CHECK(cudaMalloc(&v, R * C * 2));
    CHECK(cudaMemcpy(v, host.data(), R * C * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&d_ro, (E + 1) * 8));
    CHECK(cudaMalloc(&d_co, E * 8));
    CHECK(cudaMemcpy(d_ro, ro.data(), (E + 1) * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_co, co.data(), E * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&amax, 4));
    const float four = 4.0f;
    CHECK(cudaMemcpy(amax, &four, 4, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&rows, R * C));
    CHECK(cudaMalloc(&cols, C * ld));
    auto outputs = [&](bool uniform) {
      Fp8Outputs o;
      o.rows_out = rows;
      o.cols_out = cols;
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
      QuantizeTileKernel<Bf16><<<grid, kTileThreads>>>(v, R, C, amax, nullptr, outputs(false), Fp8Rows{}, nullptr);
    };
    auto uniform = [&] {
      QuantizeTileKernel<Bf16><<<grid, kTileThreads>>>(v, R, C, amax, nullptr, outputs(true), Fp8Rows{}, nullptr);
    };
    auto rows_only = [&] {
      Fp8Outputs o = outputs(false);
      o.cols_out = nullptr;
      QuantizeElementwiseKernel<Bf16, 8><<<unsigned(std::clamp<int64_t>(R * C / 2048, 1, 16384)), kElementwiseThreads>>>(
          v, R, C, amax, nullptr, o, nullptr);
    };
    // The transposed output against the host's transposition of the rows (each group's rows from its column
    // offset, zeros to the next multiple of 16; as the weights' path takes equal groups, the plain
    // transposition), from poisoned buffers: every other byte keeps the poison.
    auto transposed_right = [&](bool uniform_groups) {
      CHECK(cudaMemset(rows, 0x7f, R * C));
      CHECK(cudaMemset(cols, 0x7f, C * ld));
      QuantizeTileKernel<Bf16><<<grid, kTileThreads>>>(v, R, C, amax, nullptr, outputs(uniform_groups), Fp8Rows{},
                                                       nullptr);
      CHECK(cudaDeviceSynchronize());
      std::vector<uint8_t> q(R * C), t(C * ld), want(C * ld, 0x7f);
      CHECK(cudaMemcpy(q.data(), rows, R * C, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(t.data(), cols, C * ld, cudaMemcpyDeviceToHost));
      for (int64_t e = 0; e < E; ++e) {
        const int64_t size = ro[e + 1] - ro[e], start = uniform_groups ? ro[e] : co[e];
        for (int64_t c = 0; c < C; ++c) {
          for (int64_t i = 0; i < size; ++i) want[c * ld + start + i] = q[(ro[e] + i) * C + c];
          if (!uniform_groups)
            for (int64_t i = size; i % 16; ++i) want[c * ld + start + i] = 0;
        }
      }
      return t == want;
    };
    const bool equal = std::all_of(c.sizes.begin(), c.sizes.end(), [&](int64_t s) { return s == c.sizes[0]; }) &&
                       ro[E] == R;
    const bool right = transposed_right(false) && (!equal || transposed_right(true));
    std::vector<std::pair<const char*, std::function<void()>>> runs = {
        {"production", production}, {"rows only", rows_only}};
    if (equal) runs.insert(runs.begin() + 1, {"uniform", uniform});
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
    std::printf("%s: transposed right byte for byte%s: %s\n", c.name, equal ? " (and uniform)" : "",
                right ? "yes" : "NO");
    const double valid = double(ro[E]);
    for (size_t i = 0; i < runs.size(); ++i) {
      std::sort(ms[i].begin(), ms[i].end());
      const float med = ms[i][ms[i].size() / 2];
      const double bytes = valid * C * (std::strcmp(runs[i].first, "rows only") ? 4 : 3);
      std::printf("  %-10s %8.1f us  %5.2f TB/s\n", runs[i].first, med * 1e3, bytes / (med * 1e-3) / 1e12);
    }
    cudaFree(rows), cudaFree(cols), cudaFree(v), cudaFree(d_ro), cudaFree(d_co), cudaFree(amax);
  }
  return 0;
}
