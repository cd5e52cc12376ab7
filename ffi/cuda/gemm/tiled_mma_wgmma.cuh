// The tiled kernel's k-step on Hopper's warpgroup MMA (sm_90a): FenceForTensorCores and MmaStep, as
// tiled_mma_sync.cuh defines them for other devices. tiled_kernel.cuh includes one of the two.
#pragma once

#include <type_traits>

#include "cuda/elements.cuh"
#include "cuda/gemm/tiled_staging.cuh"

namespace jaxmlp {
namespace {

// Hopper's warpgroup MMA (sm_90a): a k-step is 4 instructions for the warpgroup instead of 32 MMAs and
// 20 ldmatrix per warp (where a k-step's time goes: docs/performance.md, "Kernel measurements").

// The shared-memory matrix descriptor of a staged operand tile (Swizzled's layout: 128-byte swizzling,
// kSwizzleAtom bytes between groups of 8 rows; the leading offset is unused, as a tile row is one swizzle row).
__device__ __forceinline__ uint64_t Descriptor(const void* tile) {
  return uint64_t((SharedAddress(tile) & 0x3ffff) >> 4) | uint64_t(1) << 16 | uint64_t(kSwizzleAtom >> 4) << 32 |
         uint64_t(1) << 62;
}

// Keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs' fences.
__device__ __forceinline__ void PinAccumulators(Accumulators& d) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(d[n][r])::"memory");
}

// d (64 x 64) += A (64 x 16) B (16 x 64), A and B from shared memory; kTransA / kTransB: the operand's
// tile is MN-major (its rows run along the reduction).
template <typename T, bool kTransA, bool kTransB>
__device__ __forceinline__ void Wgmma(Accumulators& d, uint64_t a, uint64_t b) {
  // Operands: the 32 accumulators, A's and B's descriptors, scale-d (1: accumulate), the transposes.
#define JAXMLP_WGMMA(type)                                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type " "                              \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                    \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "          \
               "%32, %33, p, 1, 1, %35, %36;\n}"                                                            \
               : JAXMLP_ACC(0), JAXMLP_ACC(1), JAXMLP_ACC(2), JAXMLP_ACC(3),                                \
                 JAXMLP_ACC(4), JAXMLP_ACC(5), JAXMLP_ACC(6), JAXMLP_ACC(7)                                 \
               : "l"(a), "l"(b), "r"(1), "n"(int(kTransA)), "n"(int(kTransB)))
#define JAXMLP_ACC(n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
  if constexpr (std::is_same_v<T, __nv_bfloat16>) JAXMLP_WGMMA("bf16");
  else JAXMLP_WGMMA("f16");
#undef JAXMLP_ACC
#undef JAXMLP_WGMMA
}

// Orders this thread's writes to shared memory (cp.async copies that have landed, zero stores) before
// the tensor cores' reads of it, which go through the async proxy.
__device__ __forceinline__ void FenceForTensorCores() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// acc += A B over one kBK-deep step. kAKMajor / kBKMajor: the operand's tile has the reduction along
// its columns (else along its rows: read transposed).
template <bool kAKMajor, bool kBKMajor, typename T>
__device__ __forceinline__ void MmaStep(Accumulators& acc, const T* a, const T* b) {
  // The next 16 of k, in the descriptor's 16-byte units: 2 chunks along a row (K-major), or 16 rows.
  constexpr uint64_t kAk16 = kAKMajor ? 2 : 16 * 128 / 16, kBk16 = kBKMajor ? 2 : 16 * 128 / 16;
  const uint64_t da = Descriptor(a), db = Descriptor(b);
  PinAccumulators(acc);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) Wgmma<T, !kAKMajor, !kBKMajor>(acc, da + kAk16 * kk, db + kBk16 * kk);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  PinAccumulators(acc);
}

}  // namespace
}  // namespace jaxmlp
