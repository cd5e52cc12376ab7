"""The GEMM-path policy: which CUDA engine serves a call, chosen at trace time, and why.

CUDA targets of the grouped products come in five variants (ffi/targets.inc):
  *_grouped   cuBLASLt grouped GEMM, group sizes read on the device: no host sync, and the handlers are
              declared command-buffer compatible, so XLA may capture them in CUDA graphs;
  *_cutlass   jaxmlp's CUTLASS grouped GEMM engine on Hopper (sm_90a), also sync-free, for the 16-bit
              products ragged in their rows whose output dtype is the input's (cuBLASLt's grouped GEMM
              runs the others: the weight gradients, the blockwise FP8 products); grouped_mlp's FC1, f a
              multiple of 64, adds b1 and computes the activation in its epilogue; forced, also the
              tensorwise FP8 MLP's row products (`fp8_on_engine`);
  *_fused     cuBLASLt's grouped GEMM, except that such an FC1 runs on the engine with the activation in
              its epilogue;
  *_tiled     jaxmlp's own tensor-core grouped GEMM for small problems, where cuBLAS's fixed cost per
              product dominates: fewer launches, also sync-free;
  *_fallback  cublasGemmGroupedBatchedEx, which needs the group sizes on the host (one device-to-host copy
              and stream sync per call).
`auto` runs a grouped_mlp whose FC1 the engine fuses (`fc1_fusable`) on the engine where it measured faster
than cuBLASLt (ENGINE_ROWS_PER_GROUP and ENGINE_MAX_EXPERT_WEIGHTS: small experts, skewed routing included),
else its forward on the fused path (FUSED_ROWS_PER_GROUP), else on cuBLASLt, whose plain products the
engine's trail by 1-6% at larger experts; by the rows a call is expected to have in use (`padded_buffers`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings

import jax.numpy as jnp

from . import _checks
from ._library import cuda_module, cuda_status

# The tiled kernel beats the cuBLAS grouped GEMM while a product's expert weights (E * K * N elements) and
# its work (M * K * N multiply-adds) are both small; with larger weights its many small weight-gradient
# tiles lose. The limits sit at the largest measured win (docs/performance.md, "The tiled path").
TILED_MAX_WEIGHTS = 1 << 21
TILED_MAX_MACS = 1 << 30

# The rows per group (M / E) where `auto` runs a fusable forward on the fused path: measured 1-4% faster
# forwards than cuBLASLt's FC1 and activation pass at gptoss's 512 and dsv3's 1024 rows a group, nothing
# gained at mixtral's 2048; from 128, where a group fills a tile (docs/engine-performance.md, "The cluster").
FUSED_ROWS_PER_GROUP = (128, 1024)
# Where `auto` runs a fusable grouped_mlp's forward and backward on the engine: more than one 128-row tile a
# group, at most 1024 rows, and FC1's weights at most this many elements an expert, where the engine runs
# without clusters (kSmallExpertWeights, cutlass_grouped_kernel.cuh, the same number) and measured ahead of
# cuBLASLt, most with skewed routing (docs/engine-performance.md, "The cluster"). Calls with b1 or an ungated
# activation take the same bounds: measured within 1% of cuBLASLt (b1, qwen3 balanced: 0.989x) to 10% ahead
# over a step ("b1 and ungated activations in FC1's epilogue").
ENGINE_ROWS_PER_GROUP = (129, 1024)
ENGINE_MAX_EXPERT_WEIGHTS = 4 << 20

PATHS = ("grouped", "cutlass", "fused", "tiled", "fallback")


def forced_path() -> str:
  """JAXMLP_GEMM_PATH, "auto" where unset (gemm_path checks its value)."""
  return os.environ.get("JAXMLP_GEMM_PATH", "auto")


def gemm_path(dtype, *row_lengths: int, problem: tuple[int, int, int, int] | None = None, mlp: str | None = None,
              fusable: bool = False) -> tuple[str, str]:
  """Which CUDA GEMM path a call takes, and why: ("grouped" | "cutlass" | "fused" | "tiled" | "fallback",
  reason).

  row_lengths: the K and N of the call's products (the sync-free paths need multiples of 8);
  problem: (E, M, K, N) of its largest product (None: a large one), M the rows the call is expected to have
  in use (`expected_rows`); mlp: "forward" or "backward" for grouped_mlp's calls; fusable: its FC1 is one
  the engine computes with its activation (`fc1_fusable`).
  JAXMLP_GEMM_PATH=grouped|cutlass|fused|tiled forces that path for every call it can serve (`unservable`);
  the others take the fallback.
  """
  forced = forced_path()
  if forced not in ("auto", *PATHS):
    raise ValueError(f"JAXMLP_GEMM_PATH={forced!r}: expected auto, {', '.join(PATHS[:-1])} or fallback")
  status = cuda_status()  # first, even for the fallback: it loads cuBLAS, searching the wheel's folder
  if forced == "fallback":
    return "fallback", "forced by JAXMLP_GEMM_PATH=fallback"
  if forced == "tiled" and not status.get("tiled_available"):
    raise RuntimeError(f"JAXMLP_GEMM_PATH=tiled, but the tiled kernel cannot run: "
                       f"{status.get('tiled_reason', 'no CUDA device')}")
  if forced in ("grouped", "cutlass", "fused") and not status.get("grouped_available"):
    raise RuntimeError(f"JAXMLP_GEMM_PATH={forced}, but the cuBLASLt grouped GEMM is unavailable: "
                       f"{status.get('grouped_reason', 'no CUDA device')}")
  if forced in ("cutlass", "fused") and not status.get("cutlass_available"):
    raise RuntimeError(f"JAXMLP_GEMM_PATH={forced}, but jaxmlp's CUTLASS engine cannot run: "
                       f"{status.get('cutlass_reason', 'no CUDA device')}")
  why_not = unservable(dtype, *row_lengths)
  if why_not:
    return "fallback", f"{why_not}: cublasGemmGroupedBatchedEx serves it"
  if forced != "auto":
    return forced, f"forced by JAXMLP_GEMM_PATH={forced}"
  if status.get("tiled_available") and problem is not None and _small(*problem):
    return "tiled", f"small problem (E, M, K, N) = {problem}: jaxmlp's tiled kernel"
  if not status.get("grouped_available"):
    return "fallback", status.get("grouped_reason", "no CUDA device")
  engine = status.get("cutlass_available") and problem is not None and mlp is not None and fusable
  if engine and _engine_pays(*problem):
    return "cutlass", (f"jaxmlp's CUTLASS engine (rows per group within {ENGINE_ROWS_PER_GROUP}, experts of at "
                       f"most {ENGINE_MAX_EXPERT_WEIGHTS} weights)")
  if engine and mlp == "forward" and _fusion_pays(*problem):
    return "fused", ("cuBLASLt grouped GEMM, FC1 with its activation on jaxmlp's CUTLASS engine (rows per group "
                     f"within {FUSED_ROWS_PER_GROUP})")
  return "grouped", "cuBLASLt grouped GEMM (device-side group sizes, no host sync)"


def fp8_on_engine(dtype, *row_lengths: int) -> bool:
  """Whether the tensorwise FP8 MLP runs its row products (FC1, FC2, the data gradients; the weight gradients
  stay cuBLASLt's) on jaxmlp's CUTLASS engine: where JAXMLP_GEMM_PATH=cutlass forces the engine (with its
  errors where it cannot run). `auto` keeps them on cuBLASLt's FP8 grouped GEMM, which the engine's FP8
  kernels are measured against first (docs/engine-performance.md, "FP8 on the engine")."""
  return gemm_path(dtype, *row_lengths)[0] == "cutlass"


# Within `padded_buffers`: how many times the rows a grouped_mlp call will have in use its buffer may hold.
_BUFFER_OVER_ROWS = contextvars.ContextVar("jaxmlp_buffer_over_rows", default=1.0)


@contextlib.contextmanager
def padded_buffers(factor: float):
  """Within it, the grouped_mlp calls traced hold up to `factor` times the rows they will have in use on
  average (the expert-parallel layer sizes its buffers for every token choosing this device's experts):
  the path policy decides by the average (`expected_rows`), not by the buffer."""
  token = _BUFFER_OVER_ROWS.set(max(1.0, float(factor)))
  try:
    yield
  finally:
    _BUFFER_OVER_ROWS.reset(token)


def expected_rows(M: int) -> int:
  """The rows a grouped_mlp call over a buffer of M rows is expected to have in use (padded_buffers)."""
  factor = _BUFFER_OVER_ROWS.get()
  # Rounded, not floored: a factor made as M / rows gives back rows (M / (M / rows) may fall an ulp short).
  return M if factor == 1.0 or not _checks.is_static(M) else round(M / factor)


def fc1_fusable(f: int) -> bool:
  """Whether the engine can compute an MLP forward's activation (and add b1) in FC1's epilogue
  (CutlassFusesActivation, ffi/cuda/gemm/cutlass_grouped.cu): whole 64-column pieces of f (gated: so FC1's
  width 2f is a multiple of the 128-column tile)."""
  return f % 64 == 0


# grouped_mlp(..., gather=plan) with FC1 reading the rows from the tokens in the engine's loads (cp.async from
# the producer warpgroup) runs the forward slower than XLA's gather followed by TMA loads of the copied rows
# at Qwen3's shape, and its step no faster (docs/engine-performance.md, "Rows gathered in FC1's loads").
# So `auto` gathers the rows with XLA first, and only JAXMLP_GEMM_PATH=cutlass or fused, which ask for the
# engine, takes the gathered loads.
GATHER_IN_FC1_WHY = ("only with JAXMLP_GEMM_PATH=cutlass or fused: the engine's cp.async loads of the gathered "
                     "rows make the MLP's forward slower than XLA's gather followed by TMA loads")


def gathers_in_fc1(path: str, act, f: int) -> bool:
  """Whether a grouped_mlp forward with `gather` on CUDA path `path` reads its rows in FC1's loads
  (GATHER_IN_FC1_WHY), else XLA gathers them first."""
  return (forced_path() in ("cutlass", "fused") and path in ("cutlass", "fused") and act.gated
          and fc1_fusable(f))


def _rows_within(bounds: tuple[int, int], E: int, M: int) -> bool:
  return bounds[0] * E <= M <= bounds[1] * E


def _fusion_pays(E: int, M: int, K: int, N: int) -> bool:
  return _rows_within(FUSED_ROWS_PER_GROUP, E, M)


def _engine_pays(E: int, M: int, K: int, N: int) -> bool:
  return _rows_within(ENGINE_ROWS_PER_GROUP, E, M) and K * N <= ENGINE_MAX_EXPERT_WEIGHTS


def unservable(dtype, *row_lengths: int) -> str | None:
  """Why the grouped and tiled paths cannot serve a call, or None: both take 16-bit inputs, with row
  lengths that are multiples of 8 (16-byte aligned group pointers)."""
  if jnp.dtype(dtype) == jnp.float32:
    return "float32 inputs"
  if any(n % 8 for n in row_lengths):
    return f"row lengths {row_lengths} not all multiples of 8"
  return None


def _small(E: int, M: int, K: int, N: int) -> bool:
  return E * K * N <= TILED_MAX_WEIGHTS and M * K * N <= TILED_MAX_MACS


def cuda_path(dtype, *row_lengths: int, problem: tuple[int, int, int, int], mlp: str | None = None,
              fusable: bool = False) -> str:
  """gemm_path's choice inside a CUDA branch (RuntimeError where the CUDA handlers are unavailable). The
  fallback taken for a call the fast paths cannot serve, without JAXMLP_GEMM_PATH asking for it, is
  warned of once per reason: it copies the group sizes to the host and syncs on every call."""
  cuda_module()
  path = gemm_path(dtype, *row_lengths, problem=problem, mlp=mlp, fusable=fusable)[0]
  unserved = unservable(dtype, *row_lengths)
  if path == "fallback" and unserved and forced_path() == "auto":
    _warn_once(unserved)
  return path


@functools.cache
def _warn_once(unserved: str) -> None:
  warnings.warn(f"jaxmlp: {unserved}: the call runs on the fallback GEMM path, which copies group_sizes to the "
                "host and syncs the stream on every call (cast to bfloat16 or float16, with row lengths that "
                "are multiples of 8, for the sync-free paths; JAXMLP_GEMM_PATH=fallback silences this)",
                RuntimeWarning, stacklevel=2)
