// Probe: the per-group layout of cuBLASLt's FP8 block scales (VEC128_32F, BLK128x128_32F) in grouped
// mode on Hopper, with varying scales, group sizes that are not multiples of 128 and an empty group.
// Scale pointers are device arrays of per-group pointers (a contiguous buffer faulted earlier). For each
// operand under test its scales are random and the other operand's are all 1; the result is compared
// with a host reference under each candidate layout. Not project code.
//   ./lt_block_layout fwd|wgrad|dgrad AMODE BMODE TEST [empty]
//   AMODE/BMODE: vec | blk; TEST: a (A's scales random), b (B's), ab (both, with the layouts found).
// Operand convention (TN, both K-contiguous): D[oa, ob] = sum_j A[oa, j] sA(oa, j) * B[ob, j] sB(ob, j),
// A stored [O_A, ldA] rows (op T), B stored [O_B, ldB] rows (op N), D col-major O_A x O_B (bf16).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
#define BK(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS status %d at line %d\n", (int)s, __LINE__); exit(1);} } while (0)

typedef cublasStatus_t (*CreateFn)(cublasLtMatrixLayout_t*, cudaDataType, int, const void*, const void*, const void*);
static const size_t kScaleStride = 1 << 16;  // floats per group's scale region

struct Group { long a_off, b_off, d_off; int oa, ob, K; long lda, ldb, ldd; };

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static int round4(int a) { return (a + 3) / 4 * 4; }

// Candidate index of the scale of element (o, j) of an operand with O rows and K columns.
static const char* kVecNames[] = {"kb*O+o", "o*KB+kb", "kb*round4(O)+o"};
static const char* kBlkNames[] = {"kb*OB+ob", "ob*KB+kb", "kb*round4(OB)+ob", "ob*round4(KB)+kb"};
static long scale_index(bool blk, int cand, int o, int j, int O, int K) {
  int kb = j / 128, KB = ceil_div(K, 128);
  if (!blk) {
    if (cand == 0) return (long)kb * O + o;
    if (cand == 1) return (long)o * KB + kb;
    return (long)kb * round4(O) + o;
  }
  int ob = o / 128, OB = ceil_div(O, 128);
  if (cand == 0) return (long)kb * OB + ob;
  if (cand == 1) return (long)ob * KB + kb;
  if (cand == 2) return (long)kb * round4(OB) + ob;
  return (long)ob * round4(KB) + kb;
}

int main(int argc, char** argv) {
  if (argc < 5) { printf("usage: fwd|wgrad|dgrad vec|blk vec|blk a|b|ab[:CA:CB] [empty]\n"); return 2; }
  std::string kind = argv[1], test = argv[4];
  bool a_blk = !strcmp(argv[2], "blk"), b_blk = !strcmp(argv[3], "blk"), empty = argc > 5;
  int ca = -1, cb = -1;  // candidates to use for "ab"
  if (test.rfind("ab:", 0) == 0) { sscanf(test.c_str(), "ab:%d:%d", &ca, &cb); test = "ab"; }
  printf("cublasLt %zu; %s A=%s B=%s test=%s%s\n", cublasLtGetVersion(), kind.c_str(), argv[2], argv[3],
         test.c_str(), empty ? " (with an empty group)" : "");
  // Groups: sizes not multiples of 128 (16-aligned for the wgrad's token pointers), one empty if asked.
  std::vector<int> gs = {256, 208, 48, 400};
  if (empty) gs.insert(gs.begin() + 1, 0);
  if (getenv("ODD")) gs = {256, 203, 49, 397};  // rows not multiples of 4 (fwd and dgrad only: token pointers)
  int G = (int)gs.size(), k = 320, n = 384, M = 0;
  for (int m : gs) M += m;
  std::vector<Group> groups;
  long start = 0;
  for (int g = 0; g < G; ++g) {
    int m = gs[g];
    Group q;
    if (kind == "fwd") q = {(long)g * n * k, start * k, start * n, n, m, k, k, k, n};       // A = W^T [n,k], B = X [m,k]
    else if (kind == "dgrad") q = {(long)g * n * k, start * n, start * k, k, m, n, n, n, k};  // A = W [k,n], B = dY [m,n]
    else q = {start, start, (long)g * n * k, n, k, m, M, M, n};                             // A = dY^T [n,M], B = X^T [k,M]
    groups.push_back(q);
    start += m;
  }
  size_t a_elems = kind == "wgrad" ? (size_t)n * M : (size_t)G * n * k;
  size_t b_elems = kind == "wgrad" ? (size_t)k * M : (size_t)M * (kind == "fwd" ? k : n);
  size_t d_elems = kind == "wgrad" ? (size_t)G * n * k : (size_t)M * (kind == "fwd" ? n : k);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> val(-3.f, 3.f), sc(0.5f, 2.f);
  std::vector<__nv_fp8_e4m3> ha(a_elems), hb(b_elems);
  for (auto& v : ha) v = __nv_fp8_e4m3(val(rng));
  for (auto& v : hb) v = __nv_fp8_e4m3(val(rng));
  bool rand_a = test != "b", rand_b = test != "a";
  std::vector<float> hsa(kScaleStride * G, 1.f), hsb(kScaleStride * G, 1.f);
  if (rand_a) for (auto& v : hsa) v = sc(rng);
  if (rand_b) for (auto& v : hsb) v = sc(rng);

  void *A, *B, *D; float *SA, *SB;
  CK(cudaMalloc(&A, a_elems)); CK(cudaMalloc(&B, b_elems)); CK(cudaMalloc(&D, d_elems * 2));
  CK(cudaMalloc(&SA, hsa.size() * 4)); CK(cudaMalloc(&SB, hsb.size() * 4));
  CK(cudaMemcpy(A, ha.data(), a_elems, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(B, hb.data(), b_elems, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(SA, hsa.data(), hsa.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(SB, hsb.data(), hsb.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(D, 0xff, d_elems * 2));  // NaN: an unwritten element shows

  std::vector<const void*> pa(G), pb(G), psa(G), psb(G); std::vector<void*> pd(G);
  std::vector<int64_t> dims(9 * G);
  for (int g = 0; g < G; ++g) {
    const Group& q = groups[g];
    pa[g] = (const char*)A + q.a_off; pb[g] = (const char*)B + q.b_off; pd[g] = (char*)D + q.d_off * 2;
    psa[g] = SA + g * kScaleStride; psb[g] = SB + g * kScaleStride;
    dims[g] = q.K; dims[G + g] = q.oa; dims[2 * G + g] = q.lda;          // A: rows K, cols O_A (op T)
    dims[3 * G + g] = q.K; dims[4 * G + g] = q.ob; dims[5 * G + g] = q.ldb;  // B: rows K, cols O_B (op N)
    dims[6 * G + g] = q.oa; dims[7 * G + g] = q.ob; dims[8 * G + g] = q.ldd;
  }
  void **dpa, **dpb, **dpd, **dpsa, **dpsb; int64_t* ddims;
  for (auto p : {&dpa, &dpb, &dpd, &dpsa, &dpsb}) CK(cudaMalloc(p, G * 8));
  CK(cudaMalloc(&ddims, dims.size() * 8));
  CK(cudaMemcpy(dpa, pa.data(), G * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dpb, pb.data(), G * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dpd, pd.data(), G * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dpsa, psa.data(), G * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dpsb, psb.data(), G * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ddims, dims.data(), dims.size() * 8, cudaMemcpyHostToDevice));

  cublasLtHandle_t lt; BK(cublasLtCreate(&lt));
  CreateFn create = (CreateFn)(void*)&cublasLtGroupedMatrixLayoutCreate;
  cublasLtMatrixLayout_t la, lb, ld;
  BK(create(&la, CUDA_R_8F_E4M3, G, ddims, ddims + G, ddims + 2 * G));
  BK(create(&lb, CUDA_R_8F_E4M3, G, ddims + 3 * G, ddims + 4 * G, ddims + 5 * G));
  BK(create(&ld, CUDA_R_16BF, G, ddims + 6 * G, ddims + 7 * G, ddims + 8 * G));
  int w64 = CUBLASLT_INTEGER_WIDTH_64;
  for (auto l : {la, lb, ld}) {
    BK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_GROUPED_MATRIX_LAYOUT_ROWS_COLS_ARRAY_INTEGER_WIDTH, &w64, sizeof(w64)));
    BK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_GROUPED_MATRIX_LAYOUT_LD_ARRAY_INTEGER_WIDTH, &w64, sizeof(w64)));
  }
  cublasLtMatmulDesc_t desc; BK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  int am = a_blk ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  int bm = b_blk ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof(am)));
  BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof(bm)));
  BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dpsa, sizeof(dpsa)));
  BK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dpsb, sizeof(dpsb)));
  size_t wss = 32 << 20; void* ws; CK(cudaMalloc(&ws, wss));
  cublasLtMatmulPreference_t pref; BK(cublasLtMatmulPreferenceCreate(&pref));
  BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wss, sizeof(wss)));
  cublasLtMatmulHeuristicResult_t heur[1]; int nres = 0;
  BK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, heur, &nres));
  if (!nres) { printf("no algorithm\n"); return 1; }
  float alpha = 1.f, beta = 0.f;
  BK(cublasLtMatmul(lt, desc, &alpha, dpa, la, dpb, lb, &beta, dpd, ld, dpd, ld, &heur[0].algo, ws, wss, 0));
  CK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> hd(d_elems);
  CK(cudaMemcpy(hd.data(), D, d_elems * 2, cudaMemcpyDeviceToHost));

  // Reference under each candidate pair; report the worst relative error (to the sum of |terms|).
  int na = a_blk ? 4 : 3, nb = b_blk ? 4 : 3;
  for (int ia = 0; ia < na; ++ia) for (int ib = 0; ib < nb; ++ib) {
    if (!rand_a && ia) continue;
    if (!rand_b && ib) continue;
    if (test == "ab" && ca >= 0 && (ia != ca || ib != cb)) continue;
    double worst = 0; long nan = 0, empty_written = 0;
    for (int g = 0; g < G; ++g) {
      const Group& q = groups[g];
      for (int oa = 0; oa < q.oa; ++oa) for (int ob = 0; ob < q.ob; ++ob) {
        double acc = 0, mag = 0;
        for (int j = 0; j < q.K; ++j) {
          double a = (float)ha[q.a_off + (long)oa * q.lda + j], b = (float)hb[q.b_off + (long)ob * q.ldb + j];
          double s = hsa[g * kScaleStride + scale_index(a_blk, ia, oa, j, q.oa, q.K)] *
                     (double)hsb[g * kScaleStride + scale_index(b_blk, ib, ob, j, q.ob, q.K)];
          acc += a * b * s; mag += fabs(a * b * s);
        }
        float got = __bfloat162float(hd[q.d_off + (long)ob * q.ldd + oa]);
        if (std::isnan(got)) { ++nan; continue; }
        if (q.K == 0) { empty_written += got != 0.f; continue; }
        worst = std::max(worst, fabs(got - acc) / (mag + 1e-9));
      }
    }
    printf("  A %-18s B %-18s worst rel err %.2e, unwritten %ld, nonzero in empty-K groups %ld%s\n",
           rand_a ? (a_blk ? kBlkNames[ia] : kVecNames[ia]) : "(ones)", rand_b ? (b_blk ? kBlkNames[ib] : kVecNames[ib]) : "(ones)",
           worst, nan, empty_written, worst < 1e-2 && !nan ? "  <== MATCH" : "");
  }
  return 0;
}
