"""jaxmlp.backend_info(): which backend and GEMM path each platform uses, and why."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _gemm_path, _library
from .fp8.cuda import fp8_status


def backend_info() -> dict:
  """Per platform, the handlers in use and the GEMM path a bf16 call with aligned shapes takes: large
  problems (`gemm_path`), and small ones (`small_gemm_path`, e.g. E=8, M=256, d=256, f=512; the limits
  are `tiled_max_weights` expert-weight elements and `tiled_max_macs` multiply-adds per product).

  Example (H200, cuBLAS 13.10): {"cpu": {...}, "cuda": {"built": True, "gemm_path": "grouped",
  "why": "cuBLASLt grouped GEMM ...", "small_gemm_path": "tiled", "cublaslt_version": 131000,
  "compute_capability": "9.0", "fp8_available": True, ...}}; FP8 (grouped_mlp(fp8=...)) runs on the CPU
  emulation; on a GPU both recipes run on FP8 tensor cores where `fp8_available` says so (`fp8_blockwise`
  says how the blockwise recipe runs).
  """
  info = {"jax": jax.__version__,
          "cpu": {"backend": "jaxmlp C++ FFI handlers (float32 arithmetic)", "gemm_path": "OpenBLAS sgemm per group"}}
  cuda = {"built": _library._cuda is not None, "devices": [str(d) for d in _library.cuda_devices()]}
  if _library._cuda is None:
    cuda["why"] = _library.CUDA_BUILD_ERROR
  elif cuda["devices"]:
    cuda.update(_library.cuda_status())
    try:
      path, why = _gemm_path.gemm_path(jnp.bfloat16, 8)
      small_path, small_why = _gemm_path.gemm_path(jnp.bfloat16, 8, problem=(8, 256, 256, 1024))
      cuda.update(gemm_path=path, why=why, small_gemm_path=small_path, small_why=small_why,
                  float32_gemm_path=_gemm_path.gemm_path(jnp.float32, 8)[0])
    except RuntimeError as e:  # JAXMLP_GEMM_PATH forces a path this GPU cannot run: every call would raise
      cuda.update(gemm_path=None, why=str(e))
    cuda.update(tiled_max_weights=_gemm_path.TILED_MAX_WEIGHTS, tiled_max_macs=_gemm_path.TILED_MAX_MACS)
    fp8_ok, fp8_why = fp8_status()
    cuda.update(fp8_available=fp8_ok, fp8_why=fp8_why,
                fp8_blockwise="jaxmlp's CUDA quantizers, products on cuBLASLt's block-scaled FP8 grouped GEMM")
  else:
    cuda["why"] = "no CUDA device visible to JAX"
  info["cuda"] = cuda
  return info
