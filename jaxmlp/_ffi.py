"""The XLA FFI calls: target registration, and one function per custom call that picks the CPU or CUDA
handler when XLA lowers for that platform.

CUDA targets come in three variants, chosen here at trace time (see `gemm_path`):
  *_grouped   cuBLASLt grouped GEMM, group sizes read on the device: no host sync, and the handlers are
              declared command-buffer compatible, so XLA may capture them in CUDA graphs;
  *_tiled     jaxmlp's own tensor-core grouped GEMM (ffi/cuda/tiled_gemm.cu) for small problems, where
              cuBLAS's fixed cost per product dominates: fewer launches, also sync-free;
  *_fallback  cublasGemmGroupedBatchedEx, which needs the group sizes on the host (one device-to-host
              copy and stream sync per call).
CUDA handlers take their scratch memory (cuBLAS workspace, pointer arrays, intermediates) as an extra
result buffer, so XLA plans it and no call allocates.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import scipy_openblas32

_openblas = ctypes.CDLL(  # the CPU handlers' sgemm: loaded here so that _cpu finds it by its soname
    os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(fullname=True)))
if "OPENBLAS_NUM_THREADS" not in os.environ:
  # One thread per sgemm call: the CPU handlers spread their blocks of rows and columns over XLA's own
  # intra-op thread pool (ffi/cpu/parallel.h), and OpenBLAS's pool, which spins between calls, would
  # compete with it for the cores (6 to 35x slower on 2 busy cores).
  _openblas.scipy_openblas_set_num_threads(1)
from . import _cpu  # noqa: E402
from . import fp8  # noqa: E402
from ._checks import MlpShape, sizes_as_int32
from .activations import Activation

try:
  _cuda = importlib.import_module("._cuda", __package__)
  CUDA_BUILD_ERROR = None
except ImportError as e:  # CPU only. `from . import` would word a missing module as a circular import.
  _cuda = None
  if isinstance(e, ModuleNotFoundError) and e.name == f"{__package__}._cuda":
    try:  # the reason CMakeLists.txt wrote at build time
      from ._build_info import CUDA_NOT_BUILT_BECAUSE
    except ImportError:
      CUDA_NOT_BUILT_BECAUSE = "reason not recorded"
    CUDA_BUILD_ERROR = (f"the jaxmlp._cuda extension was not built ({CUDA_NOT_BUILT_BECAUSE}). Without a CUDA "
                        "toolkit, install with JAXMLP_CUDA=pip pip install \".[cuda13]\" (README, Install)")
  else:  # a broken build or a missing shared library
    CUDA_BUILD_ERROR = f"the jaxmlp._cuda extension failed to load: {e}"

for _name, _capsule in _cpu.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
if _cuda is not None:
  for _name, _capsule in _cuda.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")

GEMM_OPS = {"nn": 0, "nt": 1, "tn": 2}
_DTYPE_CODE = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}


@functools.cache
def cuda_devices() -> tuple:
  try:
    return tuple(jax.devices("cuda"))
  except RuntimeError:
    return ()


@functools.cache
def cuda_status() -> dict:
  """cuBLAS and device facts from the CUDA module (loads cuBLAS on first use)."""
  if _cuda is None or not cuda_devices():
    return {}
  # Prefer the cuBLAS that JAX's CUDA plugin uses (the nvidia-cublas wheel), so one copy is mapped.
  lib_dirs = [d for p in sys.path if p for d in glob.glob(os.path.join(p, "nvidia", "cu1*", "lib"))]
  return dict(_cuda.status(lib_dirs))


# The tiled kernel beats the cuBLAS grouped GEMM (~7 us per product however small, plus setup and
# zeroing kernels) while a product's expert weights (E * K * N elements) and its work (M * K * N
# multiply-adds) are both small: on an H200, at E=8, d=256, f=512 for M up to 4096, fwd+bwd in 45-85% of
# cuBLAS's time. With larger weights its many small weight-gradient tiles lose: 1.5x cuBLAS's time at
# E=8, d=1024, f=2048 already for M=16 (docs/performance.md, "The tiled path"). Limits at the largest
# measured win.
TILED_MAX_WEIGHTS = 1 << 21
TILED_MAX_MACS = 1 << 30


def gemm_path(dtype, *row_lengths: int, problem: tuple[int, int, int, int] | None = None) -> tuple[str, str]:
  """Which CUDA GEMM path a call takes, and why: ("grouped" | "tiled" | "fallback", reason).

  row_lengths: the K and N of the call's products (the tiled and grouped paths need multiples of 8);
  problem: (E, M, K, N) of its largest product (None: a large one). JAXMLP_GEMM_PATH=grouped|tiled
  forces that path for every call it can serve (`unservable`); the others take the fallback.
  """
  forced = os.environ.get("JAXMLP_GEMM_PATH", "auto")
  if forced not in ("auto", "grouped", "tiled", "fallback"):
    raise ValueError(f"JAXMLP_GEMM_PATH={forced!r}: expected auto, grouped, tiled or fallback")
  status = cuda_status()  # first, even for the fallback: it loads cuBLAS, searching the wheel's folder
  if forced == "fallback":
    return "fallback", "forced by JAXMLP_GEMM_PATH=fallback"
  if forced == "tiled" and not status.get("tiled_available"):
    raise RuntimeError(f"JAXMLP_GEMM_PATH=tiled, but the tiled kernel cannot run: "
                       f"{status.get('tiled_reason', 'no CUDA device')}")
  if forced == "grouped" and not status.get("grouped_available"):
    raise RuntimeError("JAXMLP_GEMM_PATH=grouped, but the cuBLASLt grouped GEMM is unavailable: "
                       f"{status.get('grouped_reason', 'no CUDA device')}")
  why_not = unservable(dtype, *row_lengths)
  if why_not:
    return "fallback", f"{why_not}: cublasGemmGroupedBatchedEx serves it"
  if forced != "auto":
    return forced, f"forced by JAXMLP_GEMM_PATH={forced}"
  if status.get("tiled_available") and problem is not None and _small(*problem):
    return "tiled", f"small problem (E, M, K, N) = {problem}: jaxmlp's tiled kernel"
  if not status.get("grouped_available"):
    return "fallback", status.get("grouped_reason", "no CUDA device")
  return "grouped", "cuBLASLt grouped GEMM (device-side group sizes, no host sync)"


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


# The shape of an optional operand or result that is absent (no b1, b2 or scales; an unweighted combine):
# a scalar, which the handlers leave alone (ffi/common.h Present). Not a 0-element array: jax 0.11.2's
# partitioner crashed (segmentation fault) compiling those inside a loop under shard_map (gradient
# accumulation over the expert-parallel layer).
ABSENT = ()


def optional(a, dtype):
  """An optional operand as the handlers take it: `a`, or an ABSENT scalar of `dtype` where it is None."""
  return jnp.zeros(ABSENT, dtype) if a is None else a


def _cuda_path(dtype, *row_lengths: int, problem: tuple[int, int, int, int]) -> str:
  if not cuda_devices():
    # platform_dependent traces the CUDA branch everywhere; without a CUDA device it is never lowered.
    return "fallback"
  if _cuda is None:
    raise RuntimeError(f"jaxmlp's CUDA handlers are unavailable: {CUDA_BUILD_ERROR}")
  return gemm_path(dtype, *row_lengths, problem=problem)[0]


def _result_types(*args):
  """The type of a call's results on `args`, as a function of (shape, dtype). Inside jax.shard_map they
  vary over every mesh axis an operand varies over, as the result of JAX's own ops would (JAX makes the
  operands vary alike before the call); untyped, JAX would take per-device results for replicated ones
  and reject the gradients of varying inputs."""
  varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in args))
  if not varying:
    return jax.ShapeDtypeStruct
  # A type that names manual axes needs the mesh they belong to: the current one, with no dimension
  # partitioned (P() fits any rank).
  on_mesh = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), jax.P())
  mat = jax.sharding.ManualAxisType(varying=varying)
  return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_mesh, manual_axis_type=mat)


def _workspace(nbytes: int, sds) -> jax.ShapeDtypeStruct:
  return sds((max(int(nbytes), 1),), jnp.uint8)


def _act_attrs(act: Activation) -> dict:
  return dict(activation=np.int32(act.id), alpha=np.float32(act.alpha), limit=np.float32(act.limit))


def _handler_sizes(group_sizes, m: int):
  """group_sizes as the handlers take them, int32. They clamp each size to [0, m] themselves (the policy:
  ffi/common.h, ffi/cuda/group_scan.cuh), so int32 sizes go in as they are, with no XLA kernel ahead of
  the call (one launch and ~3 us per step on an H200); other dtypes are clamped in their own dtype first,
  so that the cast cannot wrap."""
  return group_sizes if jnp.result_type(group_sizes) == jnp.int32 else sizes_as_int32(group_sizes, m)


def _mlp_path_and_workspace(dtype, s: MlpShape, forward: bool, biases: bool) -> tuple[str, int]:
  path = _cuda_path(dtype, s.d, s.f, s.F1, problem=(s.E, s.M, s.d, s.F1))
  ws = _cuda.mlp_workspace_bytes(path, forward, s.M, s.d, s.f, s.F1, s.E, _DTYPE_CODE[dtype], biases) if _cuda else 0
  return path, ws


def mlp_forward(x, w1, w2, group_sizes, b1, b2, scales, act: Activation, s: MlpShape):
  """One custom call: FC1, activation, FC2. Returns (y [M, d], h [M, F1]), h being the saved FC1 output."""
  dt = x.dtype
  args = (x, w1, w2, _handler_sizes(group_sizes, s.M), optional(b1, dt), optional(b2, dt), optional(scales, dt))
  sds = _result_types(*args)
  outs = [sds((s.M, s.d), dt), sds((s.M, s.F1), dt)]
  attrs = _act_attrs(act)

  def cpu(*a):
    return tuple(jax.ffi.ffi_call("jaxmlp_mlp_fwd", outs, vmap_method="sequential")(*a, **attrs))

  def cuda(*a):
    path, ws = _mlp_path_and_workspace(dt, s, forward=True, biases=b1 is not None or b2 is not None)
    call = jax.ffi.ffi_call(f"jaxmlp_mlp_fwd_{path}", outs + [_workspace(ws, sds)], vmap_method="sequential")
    return tuple(call(*a, **attrs)[:2])

  return jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda)


def mlp_backward(x, w1, w2, group_sizes, b1, b2, scales, h, dy, act: Activation, s: MlpShape):
  """One custom call for the whole backward: (dx, dw1, dw2, db1, db2, dscales), None where absent."""
  dt = x.dtype
  args = (x, w1, w2, _handler_sizes(group_sizes, s.M), optional(b1, dt), optional(b2, dt), optional(scales, dt),
          h, dy.astype(dt))
  sds = _result_types(*args)
  outs = [sds((s.M, s.d), dt), sds((s.E, s.d, s.F1), dt), sds((s.E, s.f, s.d), dt),
          sds((s.E, s.F1) if b1 is not None else ABSENT, dt), sds((s.E, s.d) if b2 is not None else ABSENT, dt),
          sds((s.M,) if scales is not None else ABSENT, dt)]
  attrs = _act_attrs(act)

  def cpu(*a):
    return tuple(jax.ffi.ffi_call("jaxmlp_mlp_bwd", outs, vmap_method="sequential")(*a, **attrs))

  def cuda(*a):
    path, ws = _mlp_path_and_workspace(dt, s, forward=False, biases=b1 is not None or b2 is not None)
    # dh is written over the residual h (dead after this call): one [M, F1] buffer less at the peak.
    dh = sds((s.M, s.F1), dt)
    call = jax.ffi.ffi_call(f"jaxmlp_mlp_bwd_{path}", outs + [dh, _workspace(ws, sds)], vmap_method="sequential",
                            input_output_aliases={7: 6})
    return tuple(call(*a, **attrs)[:6])

  dx, dw1, dw2, db1, db2, ds = jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda)
  return (dx, dw1, dw2, db1 if b1 is not None else None, db2 if b2 is not None else None,
          ds if scales is not None else None)


def _gemm_dtypes(path: str, dtype, out_dtype) -> tuple:
  """(input, output) dtypes of a CUDA GEMM handler asked for `dtype` inputs' product in out_dtype. Where
  the path cannot write out_dtype from those inputs, the handler multiplies in a wider dtype (an exact
  upcast) and the caller rounds its result once to out_dtype: cublasGemmGroupedBatchedEx takes one dtype
  in and out, and cuBLASLt's grouped GEMM writes a 16-bit product only in its own dtype or float32
  (float16 to bfloat16 "is not supported", measured on an H200 with cuBLAS 13.10)."""
  dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
  if path == "fallback":
    wide = jnp.promote_types(dtype, out_dtype)
    return wide, wide
  if path == "grouped" and out_dtype not in (dtype, jnp.float32):
    return dtype, jnp.dtype(jnp.float32)
  return dtype, out_dtype


def grouped_gemm(op: str, lhs, rhs, group_sizes, out_shape, out_dtype):
  """One grouped product (see GemmOp in ffi/common.h): "nn" lhs @ rhs[g], "nt" lhs @ rhs[g].T,
  "tn" out[g] = lhs[rows of g].T @ rhs[rows of g]."""
  args = (lhs, rhs, _handler_sizes(group_sizes, lhs.shape[0]))
  sds = _result_types(*args)
  out = sds(out_shape, out_dtype)
  attrs = dict(op=np.int32(GEMM_OPS[op]))
  E = group_sizes.shape[0]
  K, N = (lhs.shape[1], rhs.shape[-1]) if op != "nt" else (rhs.shape[1], lhs.shape[1])

  def cpu(*a):
    return jax.ffi.ffi_call("jaxmlp_gemm", out, vmap_method="sequential")(*a, **attrs)

  def cuda(lhs, rhs, sizes):
    path = _cuda_path(lhs.dtype, K, N, problem=(E, lhs.shape[0], K, N))
    ws = _cuda.gemm_workspace_bytes(path, E) if _cuda else 0
    in_dtype, handler_out = _gemm_dtypes(path, lhs.dtype, out_dtype)
    call = jax.ffi.ffi_call(f"jaxmlp_gemm_{path}", [sds(out_shape, handler_out), _workspace(ws, sds)],
                            vmap_method="sequential")
    return call(lhs.astype(in_dtype), rhs.astype(in_dtype), sizes, **attrs)[0].astype(out_dtype)

  return jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda)


def fp8_tensor_weights(w):
  """fp8.quantize_weights on the GPU: (q [E, K, N] e4m3, amax float32 [], q transposed [E, N, K])."""
  _fp8_path_or_raise()
  E, K, N = w.shape
  sds = _result_types(w)
  e4m3 = jnp.float8_e4m3fn
  call = jax.ffi.ffi_call("jaxmlp_fp8_tensor_weights", [sds((E, K, N), e4m3), sds((1,), jnp.float32),
                                                        sds((E, N, K), e4m3)], vmap_method="sequential")
  q, amax, qt = call(w)
  return q, amax[0], qt


def mlp_fp8_forward(x, w1q, w2q, group_sizes, b1, b2, scales, act: Activation, recipe, s: MlpShape,
                    residuals: bool):
  """The FP8 forward's custom call (CUDA only), for weights quantized by fp8_tensor_weights: (y [M, d],
  h [M, F1], amax [4] float32 of x, w1, w2, a, and with `residuals` x's e4m3 copy that the backward takes,
  xt [d, L] (fp8.transposed_padded's layout), else None)."""
  _fp8_path_or_raise()
  dt, e4m3 = x.dtype, jnp.float8_e4m3fn
  (w1, aw1, w1t), (w2, aw2, w2t) = w1q, w2q
  weight_amax = jnp.stack([aw1, aw2])
  args = (x, w1, w2, _handler_sizes(group_sizes, s.M), optional(b1, dt), optional(b2, dt),
          optional(scales, dt), w1t, w2t, weight_amax)
  sds = _result_types(x, w1, w2, group_sizes, w1t, w2t, weight_amax, *(a for a in (b1, b2, scales) if a is not None))
  ws = _cuda.mlp_fp8_workspace_bytes(True, s.M, s.d, s.f, s.F1, s.E, _DTYPE_CODE[dt], False, False) if _cuda else 0
  xt = (s.d, fp8.padded_length(s.M, s.E)) if residuals else ABSENT
  outs = [sds((s.M, s.d), dt), sds((s.M, s.F1), dt), sds((4,), jnp.float32), sds(xt, e4m3), _workspace(ws, sds)]
  call = jax.ffi.ffi_call("jaxmlp_mlp_fp8_fwd", outs, vmap_method="sequential")
  y, h, amax, xt = call(*args, **_act_attrs(act), fast_accumulation=bool(recipe.fast_accumulation))[:4]
  return y, h, amax, xt if residuals else None


def mlp_fp8_backward(xt, w1q, w2q, group_sizes, b1, b2, scales, h, amax, dy, act: Activation, recipe, s: MlpShape):
  """The FP8 backward's custom call (CUDA only), from the forward's residuals: (dx, dw1, dw2, db1, db2,
  dscales), None where absent."""
  _fp8_path_or_raise()
  dt = h.dtype
  args = (xt, w1q, w2q, _handler_sizes(group_sizes, s.M), optional(b1, dt), optional(b2, dt),
          optional(scales, dt), h, dy, amax)
  sds = _result_types(xt, w1q, w2q, group_sizes, h, dy, amax, *(a for a in (b1, b2, scales) if a is not None))
  ws = (_cuda.mlp_fp8_workspace_bytes(False, s.M, s.d, s.f, s.F1, s.E, _DTYPE_CODE[dt], b1 is not None,
                                      b2 is not None) if _cuda else 0)
  outs = [sds((s.M, s.d), dt), sds((s.E, s.d, s.F1), dt), sds((s.E, s.f, s.d), dt),
          sds((s.E, s.F1) if b1 is not None else ABSENT, dt), sds((s.E, s.d) if b2 is not None else ABSENT, dt),
          sds((s.M,) if scales is not None else ABSENT, dt), _workspace(ws, sds)]
  dx, dw1, dw2, db1, db2, dscales = jax.ffi.ffi_call("jaxmlp_mlp_fp8_bwd", outs, vmap_method="sequential")(
      *args, **_act_attrs(act), fast_accumulation=bool(recipe.backward_fast_accumulation))[:6]
  return (dx, dw1, dw2, db1 if b1 is not None else None, db2 if b2 is not None else None,
          dscales if scales is not None else None)


def gemm_fp8_blocks(op: str, lhs, lhs_scales, rhs, rhs_scales, group_sizes, rows: int, out_dtype):
  """The blockwise recipe's product on FP8 tensor cores (CUDA only; ffi/cuda/fp8_block_gemm_cuda.cu has the
  operands' layouts): "nt" out [rows, K] = lhs @ rhs[g].T per group of rows, "tn" out [E, K, N] = lhs [K, L]
  @ rhs [N, L].T per group's padded columns. Scales are float32 powers of two."""
  _fp8_path_or_raise()
  E = group_sizes.shape[0]
  args = (lhs, lhs_scales, rhs, rhs_scales, _handler_sizes(group_sizes, rows))
  sds = _result_types(*args)
  code = {"nt": 1, "tn": 3}[op]
  out_shape = (rows, rhs.shape[1]) if op == "nt" else (E, lhs.shape[0], rhs.shape[0])
  ws = _cuda.gemm_fp8_blocks_workspace_bytes(code, rows, E, lhs.shape[1]) if _cuda else 0
  call = jax.ffi.ffi_call("jaxmlp_gemm_fp8_blocks", [sds(out_shape, out_dtype), _workspace(ws, sds)],
                          vmap_method="sequential")
  return call(*args, op=np.int32(code), rows=np.int64(rows))[0]


def fp8_block_rows_and_columns(v, first, rows, total):
  """fp8_blockwise.quantize_rows_and_columns on the GPU, from the column blocks' (first row, rows) [B], in
  one pass: ((q [R, C] e4m3, exponents [R, ceil(C / 128)] int32), (qt [C, 128 B] e4m3, exponents [B, C]
  int32)); `total` [1] int32: the rows in the groups (those the blocks hold)."""
  _fp8_path_or_raise()
  (R, C), B = v.shape, first.shape[0]
  sds = _result_types(v, first, rows, total)
  e4m3 = jnp.float8_e4m3fn
  call = jax.ffi.ffi_call("jaxmlp_fp8_block_rows_and_columns",
                          [sds((R, C), e4m3), sds((R, -(-C // 128)), jnp.int32), sds((C, 128 * B), e4m3),
                           sds((B, C), jnp.int32)], vmap_method="sequential")
  q, e, qt, ec = call(v, first, rows, total)
  return (q, e), (qt, ec)


def fp8_block_activation(h, da, scales, first, rows, total, act: Activation):
  """fp8_blockwise.activation_rows_and_columns (da None) or activation_grad_rows_and_columns on the GPU:
  fp8_block_rows_and_columns of a = act(h) * scales [R, f] or of dh [R, F1], computed from h (and da) on the
  way into the quantizer; scales may be None."""
  _fp8_path_or_raise()
  (R, F1), B = h.shape, first.shape[0]
  C = F1 if da is not None else (F1 // 2 if act.gated else F1)
  sds = _result_types(h, first, rows, total, *[a for a in (da, scales) if a is not None])
  e4m3 = jnp.float8_e4m3fn
  call = jax.ffi.ffi_call("jaxmlp_fp8_block_activation",
                          [sds((R, C), e4m3), sds((R, -(-C // 128)), jnp.int32), sds((C, 128 * B), e4m3),
                           sds((B, C), jnp.int32)], vmap_method="sequential")
  q, e, qt, ec = call(h, optional(da, h.dtype), optional(scales, h.dtype), first, rows, total, **_act_attrs(act))
  return (q, e), (qt, ec)


def fp8_block_weights(w):
  """fp8_blockwise.quantize_weights on the GPU: (q [E, K, N] e4m3, exponents [E, ceil(K / 128),
  ceil(N / 128)] int32, q transposed [E, N, K])."""
  _fp8_path_or_raise()
  E, K, N = w.shape
  sds = _result_types(w)
  q = sds((E, K, N), jnp.float8_e4m3fn)
  call = jax.ffi.ffi_call("jaxmlp_fp8_block_weights", [q, sds((E, N, K), jnp.float8_e4m3fn),
                                                       sds((E, -(-K // 128), -(-N // 128)), jnp.int32)],
                          vmap_method="sequential")
  q, qt, e = call(w)
  return q, e, qt


def fp8_status() -> tuple[bool, str]:
  """Whether this process's CUDA device and cuBLAS run the FP8 grouped MLP, and why (not)."""
  if _cuda is None:
    return False, CUDA_BUILD_ERROR
  status = cuda_status()
  if not status:
    return False, "no CUDA device"
  if not status.get("grouped_available"):
    return False, "FP8 runs on the cuBLASLt grouped GEMM, which is unavailable: " + status.get("grouped_reason", "")
  major = int(status.get("compute_capability", "0.0").split(".")[0])
  if major != 9:
    return False, (f"compute capability {status['compute_capability']}: the FP8 path is built and tested for "
                   "Hopper (9.x) only")
  return True, "cuBLASLt grouped GEMM, FP8 e4m3 with one scale per tensor (tensorwise) or per block (blockwise)"


def _fp8_path_or_raise() -> None:
  if not cuda_devices():
    return  # platform_dependent traces the CUDA branch everywhere; without a CUDA device it is never lowered
  ok, why = fp8_status()
  if not ok:
    raise RuntimeError(f"fp8: this GPU cannot run the FP8 grouped MLP: {why}")
