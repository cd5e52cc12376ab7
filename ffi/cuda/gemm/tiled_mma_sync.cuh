// The tiled kernel's k-step on mma.sync (compute capability 8.0+, and Hopper built without the 90a
// target): FenceForTensorCores and MmaStep, as tiled_mma_wgmma.cuh defines them for sm_90a.
// tiled_kernel.cuh includes one of the two.
#pragma once

#include <type_traits>

#include "cuda/elements.cuh"
#include "cuda/gemm/tiled_staging.cuh"

namespace jaxmlp {
namespace {

// mma.sync m16n8k16 with ldmatrix (compute capability 8.0+), where wgmma is not available, rather than
// WMMA's fragments, which were slower on the small layers this kernel is for (docs/performance.md,
// "Kernel measurements").

// Four 8x8 matrices of 16-bit elements, lane l giving the shared address of row l % 8 of matrix l / 8;
// kTrans transposes each. Register i of every lane holds its two elements of matrix i.
template <bool kTrans>
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], uint32_t address) {
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// acc (16 x 8, float) += A (16 x 16, row-major fragment a) * B (16 x 8, column-major fragment b0, b1).
template <typename T>
__device__ __forceinline__ void Mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void FenceForTensorCores() {}  // ldmatrix reads through the generic proxy

// acc += A B over one kBK-deep step (see the wgmma version).
template <bool kAKMajor, bool kBKMajor, typename T>
__device__ __forceinline__ void MmaStep(Accumulators& acc, const T* a, const T* b) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, j = lane / 8, r = lane % 8;
  // Lane l points at row l % 8 of matrix j = l / 8, the matrices in the order of mma.sync's fragment
  // registers. A (rows 16 warp ..., 16 of k): matrix j at rows + 8 (j % 2), k + 8 (j / 2). B (16 of k,
  // 16 columns, two 8-column fragments): k + 8 (j % 2), columns + 8 (j / 2). An MN-major tile (k along
  // its rows) is read transposed, which swaps the lane's row and column.
  const int a_m = 16 * warp + j % 2 * 8, a_k = j / 2 * 8, b_k = j % 2 * 8, b_n = j / 2 * 8;
  const uint32_t a_base = SharedAddress(a), b_base = SharedAddress(b);
  auto a_at = [&](int k) {  // bytes, at k
    return sizeof(T) * (kAKMajor ? Swizzled(a_m + r, (k + a_k) / 8) : Swizzled(k + a_k + r, a_m / 8));
  };
  auto b_at = [&](int k, int n) {  // bytes, at k and column n
    return sizeof(T) * (kBKMajor ? Swizzled(n + b_n + r, (k + b_k) / 8) : Swizzled(k + b_k + r, (n + b_n) / 8));
  };
#pragma unroll
  for (int kk = 0; kk < kBK; kk += 16) {
    uint32_t fa[4];
    LoadMatrices<!kAKMajor>(fa, a_base + a_at(kk));
#pragma unroll
    for (int p = 0; p < kBN / 16; ++p) {
      uint32_t fb[4];
      LoadMatrices<!kBKMajor>(fb, b_base + b_at(kk, 16 * p));
      Mma<T>(acc[2 * p], fa, fb[0], fb[1]);
      Mma<T>(acc[2 * p + 1], fa, fb[2], fb[3]);
    }
  }
}

}  // namespace
}  // namespace jaxmlp
