// cuBLAS and cuBLASLt, opened at run time.
//
// jaxmlp links no cuBLAS: it uses the copy JAX's CUDA plugin loaded (or the nvidia-cublas wheel's), so
// one library is mapped and one binary runs with cuBLAS 13.1 (fallback path only) and with the releases
// that have the grouped GEMM (13.4+ on Hopper, 13.3+ on Blackwell). The grouped-GEMM entry points are
// experimental and absent from older releases: they are optional here, declared by hand with their ABI
// constants so that older headers also compile.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <cublasLt.h>
#include <cublas_api.h>

namespace jaxmlp {

// ABI values of the cuBLASLt grouped API (cublasLt.h of cuBLAS 13.2+).
constexpr uint32_t kBatchModeGrouped = 2;                                        // CUBLASLT_BATCH_MODE_GROUPED
constexpr auto kPrefGroupedAvgReductionDim = static_cast<cublasLtMatmulPreferenceAttributes_t>(13);
constexpr auto kPrefGroupedAvgRowsD = static_cast<cublasLtMatmulPreferenceAttributes_t>(14);
constexpr auto kPrefGroupedAvgColsD = static_cast<cublasLtMatmulPreferenceAttributes_t>(15);

using GroupedLayoutCreateFn = cublasStatus_t (*)(cublasLtMatrixLayout_t*, cudaDataType, int, const void* rows,
                                                 const void* cols, const void* ld);

struct CublasApi {
  // cuBLASLt
  decltype(&::cublasLtGetVersion) LtGetVersion = nullptr;
  decltype(&::cublasLtGetStatusString) LtGetStatusString = nullptr;
  decltype(&::cublasLtCreate) LtCreate = nullptr;
  decltype(&::cublasLtMatmulDescCreate) LtMatmulDescCreate = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) LtMatmulDescSetAttribute = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) LtMatmulDescDestroy = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) LtMatrixLayoutDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) LtMatmulPreferenceCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) LtMatmulPreferenceSetAttribute = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) LtMatmulPreferenceDestroy = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) LtMatmulAlgoGetHeuristic = nullptr;
  decltype(&::cublasLtMatmul) LtMatmul = nullptr;
  GroupedLayoutCreateFn LtGroupedMatrixLayoutCreate = nullptr;  // optional (cuBLAS >= 13.2)
  // cuBLAS (fallback path)
  decltype(&::cublasCreate_v2) Create = nullptr;
  decltype(&::cublasSetStream_v2) SetStream = nullptr;
  decltype(&::cublasSetWorkspace_v2) SetWorkspace = nullptr;
  decltype(&::cublasGemmGroupedBatchedEx) GemmGroupedBatchedEx = nullptr;

  size_t lt_version = 0;  // cublasLtGetVersion(): 10000 * major + 100 * minor + patch
  std::string lt_path;    // the file that was opened
  std::string error;      // why loading failed; empty on success
};

// Loads the libraries once per process; later calls return the same table. `lib_dirs` are searched
// after a copy already mapped into the process and before the default search path.
const CublasApi& LoadCublas(const std::vector<std::string>& lib_dirs = {});

// Human-readable cuBLAS status.
std::string CublasStatusString(cublasStatus_t s);

}  // namespace jaxmlp
