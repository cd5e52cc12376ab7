"""jaxmlp's PEP 517 build backend: scikit-build-core's, plus NVIDIA's CUDA 13 toolchain wheels as build
requirements when JAXMLP_CUDA=pip, and CUTLASS's headers (the nvidia-cutlass wheel, for the CUTLASS engine)
when JAXMLP_CUDA=pip or ON.

Build requirements are static in pyproject.toml, and a CPU-only install must not download 130 MB of
compiler and 440 MB of cuBLAS (whose headers the build needs); so they are added here, on request only.
Those wheels (nvcc, cicc, the CUDA runtime and CCCL headers, cuBLAS's headers) unpack into one toolkit
root, site-packages/nvidia/cu13, where CMakeLists.txt finds them. They are the wheels `jax[cuda13]` installs anyway, so pip's cache usually holds them.
"""
from __future__ import annotations

import os

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F403  (every hook this module does not override)

# One CUDA major version for the compiler and every header, as the cuBLAS headers include the runtime's.
CUDA_TOOLCHAIN = ["nvidia-cuda-nvcc>=13,<14", "nvidia-nvvm>=13,<14", "nvidia-cuda-crt>=13,<14",
                  "nvidia-cuda-runtime>=13,<14", "nvidia-cuda-cccl>=13,<14", "nvidia-cublas>=13,<14"]


# Headers only (cutlass_library/source/include); its Python dependencies come along, unused.
CUTLASS = ["nvidia-cutlass==4.2.*"]


def _toolchain() -> list[str]:
  mode = os.environ.get("JAXMLP_CUDA", "").lower()
  return (CUDA_TOOLCHAIN if mode == "pip" else []) + (CUTLASS if mode in ("pip", "on") else [])


def get_requires_for_build_wheel(config_settings=None):
  return _scikit_build.get_requires_for_build_wheel(config_settings) + _toolchain()


def get_requires_for_build_editable(config_settings=None):
  return _scikit_build.get_requires_for_build_editable(config_settings) + _toolchain()
