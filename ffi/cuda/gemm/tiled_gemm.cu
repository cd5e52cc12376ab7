// The tiled grouped GEMM's dispatch (see tiled_gemm.h): whether the kernel (tiled_kernel.cuh) can run
// here, and RunTiledGemms, which lays out a launch's products over the grid and picks the pipeline depth.
#include "cuda/gemm/tiled_gemm.h"

#include <string>
#include <type_traits>

#include "cuda/elements.cuh"
#include "cuda/launch.cuh"
#include "cuda/gemm/tiled_kernel.cuh"

namespace jaxmlp {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Which MMA the kernel's code for the current device uses, for TiledPathAvailable's report: each
// compilation for a device architecture has its own value, and a module holds the one of its code.
__device__ const bool kTiledUsesWgmma =
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    true;
#else
    false;
#endif

// Whether `s` can run here: 16-bit inputs, any float output, K and N multiples of 8.
bool TiledGemmSupports(const GemmSpec& s) {
  const bool sixteen_bit = s.in_type == ffi::DataType::BF16 || s.in_type == ffi::DataType::F16;
  return sixteen_bit && IsFloat(s.out_type) && s.K % kVec == 0 && s.N % kVec == 0;
}

}  // namespace

bool TiledPathAvailable(int device, std::string* reason) {
  int major = 0, minor = 0;
  cudaFuncAttributes attrs{};
  ScopedDevice on(device);  // cudaFuncGetAttributes and the symbol copy below ask about the current device
  if (!on.ok() ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaFuncGetAttributes(&attrs, TiledGemmKernel<__nv_bfloat16, __nv_bfloat16, 4>) != cudaSuccess) {
    cudaGetLastError();  // clear it: the call is only a query
    return *reason = "no CUDA device, or the tiled kernel has no code for it", false;
  }
  if (major < 8)
    return *reason = "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
                     ": the tiled kernel needs 8.0 or newer", false;
  // The code that runs was compiled for compute capability ptxVersion / 10 (a build for 7.5 alone, JIT
  // compiled for this device, would hold the empty kernel).
  if (attrs.ptxVersion < 80)
    return *reason = "the tiled kernel was compiled for compute capability " + std::to_string(attrs.ptxVersion / 10) +
                     "." + std::to_string(attrs.ptxVersion % 10) + " (rebuild with CMAKE_CUDA_ARCHITECTURES "
                     "including 80 or newer)", false;
  bool wgmma = false;
  if (cudaMemcpyFromSymbol(&wgmma, kTiledUsesWgmma, sizeof(wgmma)) != cudaSuccess) cudaGetLastError();
  return *reason = std::string("jaxmlp's tiled tensor-core kernel (") + (wgmma ? "wgmma" : "mma.sync") + ")", true;
}

ffi::Error RunTiledGemms(cudaStream_t stream, int device, const TiledGroups& groups, const GemmSpec* const* specs,
                         int n, bool follows_own_kernel) {
  if (n < 1 || n > kMaxGemms) return ffi::Error::Internal("jaxmlp: 1 to 4 products per tiled launch");
  Params p{};
  p.groups = groups;
  p.n = n;
  p.early = follows_own_kernel;
  int64_t blocks = 0;
  // Row tiles of kNN/kNT: the groups use sum over groups of ceil(count / kBM) <= floor(R / kBM) + (groups
  // with rows), R being the rows in groups. The unused ones zero the padding rows, and there is one
  // whenever there is padding: row_tiles - used >= ceil(M / kBM) - floor(R / kBM) >= 1 when R < M.
  p.row_tiles = CeilDiv(groups.M, kBM) + std::min(groups.E, groups.M);
  int64_t split_tiles = 0, split_slots = 0;  // taken in the split-K scratch
  for (int i = 0; i < n; ++i) {
    const GemmSpec& s = *specs[i];
    if (!TiledGemmSupports(s) || s.in_type != specs[0]->in_type || s.out_type != specs[0]->out_type)
      return ffi::Error::InvalidArgument("jaxmlp: the tiled GEMM path needs 16-bit inputs, one dtype per launch "
                                         "and row lengths that are multiples of 8; got op " + std::to_string(int(s.op)) +
                                         ", K=" + std::to_string(s.K) + ", N=" + std::to_string(s.N));
    Product& q = p.prod[i];
    q.s = s;
    q.first_block = blocks;
    q.tiles_i = s.op == GemmOp::kTN ? int32_t(CeilDiv(s.K, kBM)) : 1;
    q.tiles_j = int32_t(CeilDiv(s.op == GemmOp::kNT ? s.K : s.N, kBN));
    q.out_bytes = int32_t(ffi::ByteWidth(s.out_type));
    q.splits = 1;
    if (s.op == GemmOp::kTN) {
      blocks += groups.E * q.tiles_i * q.tiles_j;
      continue;
    }
    // A long reduction over few tiles is the critical path of its launch (the FC1 dgrad, 16 k-steps at
    // the host-overhead layer). Split, its k-steps run in parallel blocks, and the last of them adds up
    // the partial sums, which go through L2 and cost about as much as several k-steps; hence a split only
    // per kStepsPerSplit steps, so that it saves more than it adds (docs/performance.md, "Kernel
    // measurements"). The arrival counters are zeroed by the call's first launch, so only the later
    // launches split.
    const int64_t tiles = p.row_tiles * q.tiles_j, steps = CeilDiv(s.op == GemmOp::kNN ? s.K : s.N, kBK);
    const int64_t splits = std::min<int64_t>(kMaxSplits, steps / kStepsPerSplit);
    if (follows_own_kernel && groups.split_partials && splits >= kMinSplits &&
        split_slots + tiles * splits <= kTiledSplitSlots) {
      q.splits = int32_t(splits);
      q.split_tile0 = int32_t(split_tiles), q.split_slot0 = int32_t(split_slots);
      split_tiles += tiles, split_slots += tiles * splits;
    }
    blocks += tiles * q.splits;
  }
  if (blocks > 0x7fffffff) return ffi::Error::InvalidArgument("jaxmlp: problem too large for the tiled GEMM");
  cudaError_t e = cudaSuccess;
  ByType(specs[0]->in_type, [&](auto in) {
    ByType(specs[0]->out_type, [&](auto out) {
      using T = decltype(in);
      if constexpr (!std::is_same_v<T, float>) {  // 16-bit inputs only (TiledGemmSupports)
        using OutT = decltype(out);
        // How many of the kernel's blocks fit on the GPU at once. Setting its shared memory (above 48 KiB,
        // dynamic shared memory is opt-in per kernel and device) is part of the first query.
        auto resident_blocks = [device](auto kernel, int smem) {
          return OncePerDeviceAndKernel(device, reinterpret_cast<const void*>(kernel),
                                        [&](int device) -> std::optional<int64_t> {
            int sms = 0, per_sm = 0;
            ScopedDevice on(device);  // the attribute and the occupancy are the current device's
            if (!on.ok() || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
                cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) != cudaSuccess) {
              cudaGetLastError();   // the launch reports its own failure; leave no error for a later check
              return std::nullopt;  // the next call sets and asks again
            }
            return int64_t(sms) * per_sm;
          });
        };
        // A launch of more blocks than fit on the GPU at once with 4 stages takes 3 where that fits more
        // blocks per SM (on Hopper 4 instead of 3, at the wgmma kernel's 128 registers): its later waves
        // gain more from occupancy than from the deeper pipeline. A launch of one wave keeps 4 stages
        // (docs/performance.md, "Kernel measurements").
        const int64_t resident_deep = resident_blocks(TiledGemmKernel<T, OutT, 4>, kSmemBytes<4>);
        if (blocks > resident_deep && resident_blocks(TiledGemmKernel<T, OutT, 3>, kSmemBytes<3>) > resident_deep)
          e = LaunchOverlapped(TiledGemmKernel<T, OutT, 3>, unsigned(blocks), kThreads, kSmemBytes<3>, stream, device,
                               p);
        else
          e = LaunchOverlapped(TiledGemmKernel<T, OutT, 4>, unsigned(blocks), kThreads, kSmemBytes<4>, stream, device,
                               p);
      }
    });
  });
  return CheckCuda(e, "launching the tiled GEMM");
}

}  // namespace jaxmlp
