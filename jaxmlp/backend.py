"""jaxmlp.backend_info(): which backend and GEMM path each platform uses, and why."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _gemm_path, _library
from .fp8.cuda import fp8_status
from .fp8.recipe import fp8_when


def backend_info() -> dict:
  """Per platform, the handlers in use and the GEMM path a bf16 call with aligned shapes takes: large
  problems (`gemm_path`), and small ones (`small_gemm_path`, e.g. E=8, M=256, d=256, f=512; the limits
  are `tiled_max_weights` expert-weight elements and `tiled_max_macs` multiply-adds per product); the
  forward of a gated MLP at Qwen3-30B-A3B's shape (`mlp_forward_path`; E 128, 256 rows per expert, d 2048,
  f 768): "cutlass" where jaxmlp's engine runs grouped_mlp (within `engine_rows_per_group` and
  `engine_max_expert_weights`), "fused" where only FC1 does, with the activation in its epilogue (within
  `fused_rows_per_group`); `gather_in_fc1`, when grouped_mlp(gather=...) reads its rows in FC1's loads;
  `summary`, one sentence on what runs where; `fp8_when`, at which shapes a call with an FP8 recipe runs in
  FP8 (jaxmlp.Fp8Recipe's `when`).

  Example (H200, cuBLAS 13.10): {"summary": "CUDA (NVIDIA H200): ...", "cpu": {...}, "cuda": {"built":
  True, "gemm_path": "grouped", "why": "cuBLASLt grouped GEMM ...", "small_gemm_path": "tiled",
  "cublaslt_version": 131000, "compute_capability": "9.0", "fp8_available": True, ...}}.
  """
  info = {"jax": jax.__version__, "default_backend": jax.default_backend(),
          "cpu": {"backend": "jaxmlp C++ FFI handlers (float32 arithmetic)", "gemm_path": "OpenBLAS sgemm per group",
                  "fp8": "emulated: each recipe's definition in JAX around the CPU grouped GEMM, the values a GPU "
                         "computes up to the order of float32 sums",
                  "ragged_dot": RAGGED_DOT},
          "fp8_when": fp8_when()}
  cuda = {"built": _library._cuda is not None, "devices": [str(d) for d in _library.cuda_devices()]}
  if _library._cuda is None and not cuda["devices"]:
    cuda["why"] = (f"no CUDA device, and a CPU-only install: nothing is missing to run on the CPU "
                   f"({_library.CUDA_BUILD_ERROR})")
  elif _library._cuda is None:
    cuda["why"] = _library.CUDA_BUILD_ERROR
  elif cuda["devices"]:
    cuda.update(_library.cuda_status())
    try:
      path, why = _gemm_path.gemm_path(jnp.bfloat16, 8)
      small_path, small_why = _gemm_path.gemm_path(jnp.bfloat16, 8, problem=(8, 256, 256, 1024))
      mlp_path, mlp_why = _gemm_path.gemm_path(jnp.bfloat16, 8, problem=(128, 32768, 2048, 1536), mlp="forward",
                                               fusable=True)
      cuda.update(gemm_path=path, why=why, small_gemm_path=small_path, small_why=small_why,
                  mlp_forward_path=mlp_path, mlp_forward_why=mlp_why,
                  float32_gemm_path=_gemm_path.gemm_path(jnp.float32, 8)[0])
    except RuntimeError as e:  # JAXMLP_GEMM_PATH forces a path this GPU cannot run: every call would raise
      cuda.update(gemm_path=None, why=str(e))
    cuda.update(tiled_max_weights=_gemm_path.TILED_MAX_WEIGHTS, tiled_max_macs=_gemm_path.TILED_MAX_MACS,
                fused_rows_per_group=_gemm_path.FUSED_ROWS_PER_GROUP,
                engine_rows_per_group=_gemm_path.ENGINE_ROWS_PER_GROUP,
                engine_max_expert_weights=_gemm_path.ENGINE_MAX_EXPERT_WEIGHTS,
                gather_in_fc1=_gemm_path.GATHER_IN_FC1_WHY)
    fp8_ok, fp8_why = fp8_status()
    cuda.update(fp8_available=fp8_ok, fp8_why=fp8_why,
                fp8_blockwise="jaxmlp's CUDA quantizers, products on cuBLASLt's block-scaled FP8 grouped GEMM",
                ragged_dot=RAGGED_DOT)
  else:
    cuda["why"] = "the CUDA handlers are built, but no CUDA device is visible to JAX"
  info["cuda"] = cuda
  info["summary"] = _summary(cuda)
  return info


RAGGED_DOT = ("float32, bfloat16 and float16 on jaxmlp's grouped GEMM; other dtypes (float64, integers) and "
              "extents past int32 on jax.lax.ragged_dot")


def _summary(cuda: dict) -> str:
  if not cuda["devices"]:
    return ("CPU: jaxmlp's C++ handlers run every op, and the FP8 recipes are emulated; no CUDA device is "
            "visible" + ("" if cuda["built"] else " and this install has no CUDA handlers (a CPU install)"))
  if not cuda["built"]:
    return f"CUDA devices are visible, but jaxmlp's CUDA handlers are not, so its ops raise on them: {cuda['why']}"
  fp8 = "FP8 on FP8 tensor cores" if cuda["fp8_available"] else f"FP8 unavailable ({cuda['fp8_why']})"
  return (f"CUDA ({cuda.get('device_name', 'unknown device')}): the grouped products on the {cuda['gemm_path']} "
          f"path ({cuda['why']}), small ones on the {cuda.get('small_gemm_path')} path, a gated MLP's forward at "
          f"Qwen3-30B-A3B's shape on the {cuda.get('mlp_forward_path')} path; {fp8}")
