// Probe: how fast W warps of one CTA per SM can load gathered rows into shared memory by cp.async, the A
// operand of the engine's FC1 with x's rows gathered in its loads (cutlass_varlen_mainloop.cuh, kGatherA).
// Not project code. Per SM, tiles of 128 rows of 128 bytes (a 128x64 bf16 k-tile of A, 16 KB) taken from
// T = 8192 tokens of 4096 bytes by an index array (random, or sorted with `sorted`), 32 k-tiles a tile, into
// a ring of 6 stages of the 128B-swizzled layout (chunk c of row r at chunk c ^ (r % 8)), at most 5 stages'
// copies in flight a thread. Nothing consumes the stages: the rate is the copies' ceiling, against the
// ~0.35 us a 128x128x64 wgmma k-tile takes at ~790 TFLOP/s over 132 SMs. Layouts:
//   lane-per-row     each thread loads whole rows (8 copies of 16 bytes each);
//   8-lanes-per-row  8 consecutive threads share a row, a warp instruction covering 4 whole rows.
// Build and run (a Hopper GPU): nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o cp_async_rate cp_async_rate.cu
//   ./cp_async_rate; ./cp_async_rate sorted
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kTokens = 8192, kRowBytes = 4096, kTileRows = 128, kKTiles = 32, kTilesPerSm = 4, kStages = 6;
constexpr int kSms = 132, kStageBytes = kTileRows * 128;

__device__ void Copy(bool cache_global, unsigned smem, const char* gmem) {
  if (cache_global) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem));
}

template <int kWarps, bool kCacheGlobal, bool kEightLanesPerRow>
__global__ void LoadTiles(const char* x, const int* rows) {
  extern __shared__ __align__(1024) char stages[];
  __shared__ int tile_rows[kTileRows];
  const int t = threadIdx.x, threads = kWarps * 32;
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(stages));
  int step = 0;
  for (int q = 0; q < kTilesPerSm; ++q) {
    const int first = (blockIdx.x + kSms * q) * kTileRows;
    __syncthreads();
    for (int r = t; r < kTileRows; r += threads) tile_rows[r] = rows[first + r];
    __syncthreads();
    for (int kt = 0; kt < kKTiles; ++kt, ++step) {
      const unsigned stage = base + (step % kStages) * kStageBytes;
      const char* column = x + kt * 128;
      auto copy = [&](int r, int c) {
        Copy(kCacheGlobal, stage + r * 128 + ((c ^ (r & 7)) << 4), column + size_t(tile_rows[r]) * kRowBytes + c * 16);
      };
      if (kEightLanesPerRow) {
        for (int j = t; j < kTileRows * 8; j += threads) copy(j >> 3, j & 7);
      } else {
        for (int r = t; r < kTileRows; r += threads) {
#pragma unroll
          for (int c = 0; c < 8; ++c) copy(r, c);
        }
      }
      asm volatile("cp.async.commit_group;\ncp.async.wait_group 5;");
    }
  }
  asm volatile("cp.async.wait_all;");
}

const char* g_x;
const int* g_rows;

template <int kWarps, bool kCacheGlobal, bool kEightLanesPerRow>
void Run() {
  auto kernel = LoadTiles<kWarps, kCacheGlobal, kEightLanesPerRow>;
  // As the engine's kernel: about all of the SM's 228 KB as shared memory, leaving L1 little.
  const int smem = 220 * 1024;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  constexpr int kRepeats = 20;
  kernel<<<kSms, kWarps * 32, smem>>>(g_x, g_rows);
  cudaEventRecord(start);
  for (int i = 0; i < kRepeats; ++i) kernel<<<kSms, kWarps * 32, smem>>>(g_x, g_rows);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  const double k_tiles = double(kRepeats) * kTilesPerSm * kKTiles;  // per SM
  printf("warps=%d %s %s: %.3f us per k-tile per SM (%.2f TB/s) %s\n", kWarps, kCacheGlobal ? "cg" : "ca",
         kEightLanesPerRow ? "8-lanes-per-row" : "lane-per-row", ms * 1e3 / k_tiles,
         kSms * k_tiles * kStageBytes / (ms * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
}

}  // namespace

int main(int argc, char** argv) {
  const bool sorted = argc > 1;
  const int rows = kSms * kTilesPerSm * kTileRows;
  char* x;
  int* index;
  cudaMalloc(&x, size_t(kTokens) * kRowBytes);
  cudaMemset(x, 1, size_t(kTokens) * kRowBytes);
  int* host = static_cast<int*>(malloc(rows * sizeof(int)));
  for (int i = 0; i < rows; ++i) host[i] = sorted ? int(long(i) * kTokens / rows) : rand() % kTokens;
  cudaMalloc(&index, rows * sizeof(int));
  cudaMemcpy(index, host, rows * sizeof(int), cudaMemcpyHostToDevice);
  g_x = x, g_rows = index;
  printf("%s rows\n", sorted ? "sorted" : "random");
  Run<1, false, false>(), Run<1, true, false>(), Run<1, false, true>(), Run<1, true, true>();
  Run<2, false, false>(), Run<2, true, true>();
  Run<4, false, false>(), Run<4, true, false>(), Run<4, false, true>(), Run<4, true, true>();
  return 0;
}
