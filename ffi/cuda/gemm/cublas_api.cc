#include "cuda/gemm/cublas_api.h"

#include <dlfcn.h>

#include <mutex>

namespace jaxmlp {
namespace {

// An already-mapped copy first (JAX's plugin loads cuBLAS from the nvidia-cublas wheel), then lib_dirs,
// then the loader's search path. On failure `error` holds the loader's message for the last try (taken
// at once: a later successful dlopen clears it).
void* Open(const char* soname, const std::vector<std::string>& lib_dirs, std::string* path, std::string* error) {
  void* h = dlopen(soname, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  for (size_t i = 0; !h && i < lib_dirs.size(); ++i) {
    std::string p = lib_dirs[i] + "/" + soname;
    if ((h = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL))) *path = p;
  }
  if (!h) h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = dlerror();
    *error = why ? why : std::string(soname) + " not found";
  }
  if (h && path->empty()) *path = soname;
  return h;
}

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* fn, std::string* error) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!*fn && error->empty()) *error = std::string("symbol ") + name + " not found";
  return *fn != nullptr;
}

CublasApi Load(const std::vector<std::string>& lib_dirs) {
  CublasApi api;
  std::string blas_path, why;
  void* lt = Open("libcublasLt.so.13", lib_dirs, &api.lt_path, &why);
  void* blas = lt ? Open("libcublas.so.13", lib_dirs, &blas_path, &why) : nullptr;
  if (!lt || !blas) {
    api.error = "cannot open cuBLAS 13 (libcublasLt.so.13 / libcublas.so.13): " + why;
    return api;
  }
  std::string& e = api.error;
  Resolve(lt, "cublasLtGetVersion", &api.LtGetVersion, &e);
  Resolve(lt, "cublasLtGetStatusString", &api.LtGetStatusString, &e);
  Resolve(lt, "cublasLtCreate", &api.LtCreate, &e);
  Resolve(lt, "cublasLtMatmulDescCreate", &api.LtMatmulDescCreate, &e);
  Resolve(lt, "cublasLtMatmulDescSetAttribute", &api.LtMatmulDescSetAttribute, &e);
  Resolve(lt, "cublasLtMatmulDescDestroy", &api.LtMatmulDescDestroy, &e);
  Resolve(lt, "cublasLtMatrixLayoutDestroy", &api.LtMatrixLayoutDestroy, &e);
  Resolve(lt, "cublasLtMatmulPreferenceCreate", &api.LtMatmulPreferenceCreate, &e);
  Resolve(lt, "cublasLtMatmulPreferenceSetAttribute", &api.LtMatmulPreferenceSetAttribute, &e);
  Resolve(lt, "cublasLtMatmulPreferenceDestroy", &api.LtMatmulPreferenceDestroy, &e);
  Resolve(lt, "cublasLtMatmulAlgoGetHeuristic", &api.LtMatmulAlgoGetHeuristic, &e);
  Resolve(lt, "cublasLtMatmul", &api.LtMatmul, &e);
  Resolve(blas, "cublasCreate_v2", &api.Create, &e);
  Resolve(blas, "cublasSetStream_v2", &api.SetStream, &e);
  Resolve(blas, "cublasSetWorkspace_v2", &api.SetWorkspace, &e);
  Resolve(blas, "cublasGemmGroupedBatchedEx", &api.GemmGroupedBatchedEx, &e);
  std::string optional_error;  // the grouped layout is optional: its absence selects the fallback path
  Resolve(lt, "cublasLtGroupedMatrixLayoutCreate", &api.LtGroupedMatrixLayoutCreate, &optional_error);
  if (api.LtGetVersion) api.lt_version = api.LtGetVersion();
  return api;
}

}  // namespace

const CublasApi& LoadCublas(const std::vector<std::string>& lib_dirs) {
  static std::once_flag once;
  static CublasApi api;
  std::call_once(once, [&] { api = Load(lib_dirs); });
  return api;
}

std::string CublasStatusString(cublasStatus_t s) {
  const CublasApi& api = LoadCublas();
  std::string name = api.LtGetStatusString ? api.LtGetStatusString(s) : "";
  return name + " (" + std::to_string(int(s)) + ")";
}

}  // namespace jaxmlp
