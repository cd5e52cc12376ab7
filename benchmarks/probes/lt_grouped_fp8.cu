// Feasibility probe: does cuBLASLt grouped GEMM (device-side shapes) run FP8 e4m3 on this GPU, with which
// scale modes, and how fast vs bf16 grouped and FP8 dense? Not project code.
// Layout (col-major view of row-major MoE tensors), FP8 on Hopper needs "TN": both operands K-contiguous.
//   fwd:   Y[m_g, n] = X[m_g, k] @ W_g[k, n]; A = W_g^T stored [n, k] (op T), B = X_g [m_g, k] (op N), D = Y_g.
//   wgrad: dW_g[k, n] = X_g^T @ dY_g; A = dY^T stored [n, M] (op T, ld M), B = X^T stored [k, M] (op N, ld M).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cmath>
#include <random>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
#define BK(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { snprintf(why, sizeof why, "cuBLAS %d line %d", (int)s, __LINE__); return -1.f;} } while (0)
static char why[128];

template <class T> __global__ void fill(T* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)(i * 2654435761u) ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = T(((h & 0xffff) / 65535.f - 0.5f) * scale);
  }
}
__global__ void fillf(float* p, size_t n, float v) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v; }

// per-group arrays: pointers + dims, written on device from device group sizes (as the real op would)
__global__ void setup(const int* gs, int G, int k, int n, int M, int esz, bool wgrad, const char* A0, const char* B0, char* D0,
                      const void** Ap, const void** Bp, void** Dp, int64_t* dims) {
  int g = threadIdx.x; if (g >= G) return;
  long off = 0; for (int i = 0; i < g; ++i) off += gs[i];
  int m = gs[g];
  int64_t *ar = dims, *ac = dims + G, *al = dims + 2 * G, *br = dims + 3 * G, *bc = dims + 4 * G, *bl = dims + 5 * G,
          *dr = dims + 6 * G, *dc = dims + 7 * G, *dl = dims + 8 * G;
  if (!wgrad) {  // A = W_g^T [n,k] -> col-major k x n, op T; B = X_g -> k x m, op N; D = Y_g -> n x m (bf16)
    Ap[g] = A0 + (size_t)g * k * n * esz; ar[g] = k; ac[g] = n; al[g] = k;
    Bp[g] = B0 + off * k * esz;            br[g] = k; bc[g] = m; bl[g] = k;
    Dp[g] = D0 + off * n * 2;              dr[g] = n; dc[g] = m; dl[g] = n;
  } else {       // A = dY^T [n, M] -> col-major M x n, op T (rows m); B = X^T [k, M] -> col-major M x k, op N; D = dW_g n x k
    Ap[g] = A0 + off * esz; ar[g] = m; ac[g] = n; al[g] = M;
    Bp[g] = B0 + off * esz; br[g] = m; bc[g] = k; bl[g] = M;
    Dp[g] = D0 + (size_t)g * k * n * 2; dr[g] = n; dc[g] = k; dl[g] = n;
  }
}

typedef cublasStatus_t (*CreateFn)(cublasLtMatrixLayout_t*, cudaDataType, int, const void*, const void*, const void*);

// mode: -1 = bf16; else FP8 scale mode for A and B (amode, bmode)
float run(cublasLtHandle_t lt, int G, int k, int n, int M, const int* d_gs, bool wgrad, bool fp8, int amode, int bmode,
          const void* A0, const void* B0, void* D0, const float* sa, const float* sb, void* ws, size_t wss,
          const void** pA, const void** pB, void** pD, int64_t* dims, int iters, bool fast_accum) {
  CreateFn create = (CreateFn)(void*)&cublasLtGroupedMatrixLayoutCreate;
  int esz = fp8 ? 1 : 2;
  setup<<<1, 1024>>>(d_gs, G, k, n, M, esz, wgrad, (const char*)A0, (const char*)B0, (char*)D0, pA, pB, pD, dims);
  CK(cudaGetLastError());
  cudaDataType ab = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatrixLayout_t la, lb, ld_;
  BK(create(&la, ab, G, dims, dims + G, dims + 2 * G));
  BK(create(&lb, ab, G, dims + 3 * G, dims + 4 * G, dims + 5 * G));
  BK(create(&ld_, CUDA_R_16BF, G, dims + 6 * G, dims + 7 * G, dims + 8 * G));
  int w64 = CUBLASLT_INTEGER_WIDTH_64;
  for (auto l : {la, lb, ld_}) {
    BK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_GROUPED_MATRIX_LAYOUT_ROWS_COLS_ARRAY_INTEGER_WIDTH, &w64, sizeof(w64)));
    BK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_GROUPED_MATRIX_LAYOUT_LD_ARRAY_INTEGER_WIDTH, &w64, sizeof(w64)));
  }
  cublasLtMatmulDesc_t desc; BK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;  // "TN" for every mode: like-for-like with bf16
  BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (fp8) {
    BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &amode, sizeof(amode)));
    BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bmode, sizeof(bmode)));
    BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
    int8_t fa = fast_accum; BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof(fa)));
  }
  cublasLtMatmulPreference_t pref; BK(cublasLtMatmulPreferenceCreate(&pref));
  BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wss, sizeof(wss)));
  int64_t avg_rows = n, avg_cols = wgrad ? k : M / G, avg_red = wgrad ? M / G : k;
  BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_ROWS, &avg_rows, sizeof(avg_rows)));
  BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_COLS, &avg_cols, sizeof(avg_cols)));
  BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_AVERAGE_REDUCTION_DIM, &avg_red, sizeof(avg_red)));
  cublasLtMatmulHeuristicResult_t heur[4]; int nres = 0;
  BK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld_, ld_, pref, 4, heur, &nres));
  if (nres == 0) { snprintf(why, sizeof why, "no algo"); return -1.f; }
  float alpha = 1.f, beta = 0.f;
  for (int it = 0; it < 3; ++it) BK(cublasLtMatmul(lt, desc, &alpha, pA, la, pB, lb, &beta, pD, ld_, pD, ld_, &heur[0].algo, ws, wss, 0));
  cudaError_t e = cudaDeviceSynchronize(); if (e != cudaSuccess) { printf(" FAULT %s\n", cudaGetErrorString(e)); exit(2); }
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1); cudaEventRecord(e0);
  for (int it = 0; it < iters; ++it) BK(cublasLtMatmul(lt, desc, &alpha, pA, la, pB, lb, &beta, pD, ld_, pD, ld_, &heur[0].algo, ws, wss, 0));
  cudaEventRecord(e1); CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1);
  cublasLtMatmulPreferenceDestroy(pref); cublasLtMatmulDescDestroy(desc);
  cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld_);
  return ms / iters;
}

// sampled check of fwd: Y[r, c] = s * sum_j X[r, j] * Wt[g, c, j]
double check(int G, int k, int n, int M, const std::vector<int>& gs, bool fp8, const void* X, const void* Wt, const __nv_bfloat16* Y, double s) {
  std::mt19937 rng(1); double worst = 0;
  int esz = fp8 ? 1 : 2;
  std::vector<unsigned char> xr(k * esz), wr(k * esz);
  for (int t = 0; t < 48; ++t) {
    int r = rng() % M, c = rng() % n, g = 0; long off = 0;
    while (off + gs[g] <= r) { off += gs[g]; ++g; }
    CK(cudaMemcpy(xr.data(), (const char*)X + (size_t)r * k * esz, k * esz, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(wr.data(), (const char*)Wt + ((size_t)g * n + c) * k * esz, k * esz, cudaMemcpyDeviceToHost));
    double acc = 0, mag = 0;
    for (int j = 0; j < k; ++j) {
      double a, b;
      if (fp8) { a = (float)((const __nv_fp8_e4m3*)xr.data())[j]; b = (float)((const __nv_fp8_e4m3*)wr.data())[j]; }
      else { a = __bfloat162float(((const __nv_bfloat16*)xr.data())[j]); b = __bfloat162float(((const __nv_bfloat16*)wr.data())[j]); }
      acc += a * b; mag += fabs(a * b);
    }
    __nv_bfloat16 y; CK(cudaMemcpy(&y, Y + (size_t)r * n + c, 2, cudaMemcpyDeviceToHost));
    worst = std::max(worst, fabs(__bfloat162float(y) - s * acc) / (s * mag + 1e-9));
  }
  return worst;
}

int main(int argc, char** argv) {
  bool block = argc > 1;  // block scaling mode alone (it may fault the context)
  bool ptr_array = argc > 2;  // block scales passed as device arrays of per-group pointers
  printf("cublasLt %zu; ", cublasLtGetVersion());
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0)); printf("%s sm_%d%d\n", prop.name, prop.major, prop.minor);
  struct Shape { const char* name; int G, d, f, M; };
  Shape shapes[] = {{"small", 8, 1024, 2048, 4096}, {"qwen3", 128, 2048, 768, 32768}, {"dsv3", 32, 7168, 2048, 32768},
                    {"gptoss", 32, 2880, 2880, 16384}, {"mixtral", 8, 4096, 14336, 16384}};
  struct Mode { const char* name; bool fp8; int am, bm; bool fast; };
  Mode modes[] = {{"bf16", false, 0, 0, false},
                  {"fp8 scalar", true, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, false},
                  {"fp8 scalar fastacc", true, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, true},
                  {"fp8 per-batch A", true, CUBLASLT_MATMUL_MATRIX_SCALE_PER_BATCH_SCALAR_32F, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, false},
                  {"fp8 outer-vec", true, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, false},
                  {"fp8 blk128/vec128", true, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, false},
                  {"fp8 vec128/vec128", true, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, false}};
  cublasLtHandle_t lt; cublasLtCreate(&lt);
  size_t wss = 64 << 20; void* ws; CK(cudaMalloc(&ws, wss));
  const void **pA, **pB; void** pD; int64_t* dims;
  CK(cudaMalloc(&pA, 8192)); CK(cudaMalloc(&pB, 8192)); CK(cudaMalloc(&pD, 8192)); CK(cudaMalloc(&dims, 9 * 8192));
  float *sa, *sb; size_t nscale = (size_t)64 << 20;  // generous: any layout of per-row / per-block scales fits
  CK(cudaMalloc(&sa, nscale * 4)); CK(cudaMalloc(&sb, nscale * 4));
  fillf<<<1024, 256>>>(sa, nscale, 0.5f); fillf<<<1024, 256>>>(sb, nscale, 0.25f);
  for (auto& s : shapes) {
    int k = s.d, n = 2 * s.f, M = s.M, G = s.G;
    std::vector<int> gs(G, M / G);
    int* d_gs; CK(cudaMalloc(&d_gs, G * 4)); CK(cudaMemcpy(d_gs, gs.data(), G * 4, cudaMemcpyHostToDevice));
    void *X, *W, *Y;  // sized for bf16; fp8 uses the first half
    CK(cudaMalloc(&X, (size_t)M * k * 2)); CK(cudaMalloc(&W, (size_t)G * k * n * 2)); CK(cudaMalloc(&Y, (size_t)std::max((size_t)M * n, (size_t)G * k * n) * 2));
    double flops = 2.0 * M * k * n;
    for (int wgrad = 0; wgrad < 2; ++wgrad) {
      printf("%-8s %s G=%3d M=%6d k=%5d n=%5d |", s.name, wgrad ? "wgrad" : "fwd  ", G, M, k, n);
      for (auto& md : modes) {
        bool block_mode = md.am == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F || md.am == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        if (md.fp8 && block_mode != block) continue;
        if (block && !md.fp8) continue;
        if (md.fp8) { fill<<<1024, 256>>>((__nv_fp8_e4m3*)X, (size_t)M * k, 1, 8.f); fill<<<1024, 256>>>((__nv_fp8_e4m3*)W, (size_t)G * k * n, 2, 8.f); }
        else { fill<<<1024, 256>>>((__nv_bfloat16*)X, (size_t)M * k, 1, 2.f); fill<<<1024, 256>>>((__nv_bfloat16*)W, (size_t)G * k * n, 2, 0.1f); }
        // wgrad operands: A = dY^T [n, M] (use W buffer, needs n*M <= G*k*n), B = X^T [k, M]
        const void* A0 = W; const void* B0 = X;
        if (wgrad && (size_t)n * M > (size_t)G * k * n) { printf(" %s skip |", md.name); continue; }
        const float *psa = sa, *psb = sb;
        if (ptr_array && md.fp8) {
          std::vector<const float*> ha(G, sa), hb(G, sb);
          float **da, **db; CK(cudaMalloc(&da, G * 8)); CK(cudaMalloc(&db, G * 8));
          CK(cudaMemcpy(da, ha.data(), G * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(db, hb.data(), G * 8, cudaMemcpyHostToDevice));
          psa = (const float*)da; psb = (const float*)db;
        }
        float ms = run(lt, G, k, n, M, d_gs, wgrad, md.fp8, md.am, md.bm, A0, B0, Y, psa, psb, ws, wss, pA, pB, pD, dims, 20, md.fast);
        if (ms < 0) { printf(" %s: %s |", md.name, why); continue; }
        double err = wgrad ? -1 : check(G, k, n, M, gs, md.fp8, X, W, (const __nv_bfloat16*)Y, md.fp8 ? 0.125 : 1.0);
        printf(" %s %.0f TF err %.1e |", md.name, flops / ms / 1e9, err);
      }
      printf("\n"); fflush(stdout);
    }
    cudaFree(X); cudaFree(W); cudaFree(Y); cudaFree(d_gs);
  }
  return 0;
}
