"""jaxmlp's native library: loading the extensions, registering their XLA FFI targets, and `call`, the one
helper through which every op makes its custom calls.

The targets (ffi/targets.inc) and their handlers live in two extensions: `_cpu` (always built) and `_cuda`
(built where a CUDA compiler was found; see CUDA_BUILD_ERROR otherwise). The enums and codes the handlers
take (activations, GEMM ops, dtypes) are read from `_cpu`, which exports the C++ definitions
(ffi/codes.h): the two languages keep no table by hand.
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

from ._checks import is_static
from .activations import Activation

_openblas = ctypes.CDLL(  # the CPU handlers' sgemm: loaded here so that _cpu finds it by its soname
    os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(fullname=True)))
if "OPENBLAS_NUM_THREADS" not in os.environ:
  # One thread per sgemm call: the CPU handlers spread their blocks of rows and columns over XLA's own
  # intra-op thread pool (ffi/cpu/parallel.h), and OpenBLAS's pool, which spins between calls, would
  # compete with it for the cores (docs/build.md, "What the install does").
  _openblas.scipy_openblas_set_num_threads(1)
from . import _cpu  # noqa: E402

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

def gemm_op(op: str) -> np.int32:
  """The handlers' code of a grouped product: "nn", "nt", "tn" or "tn_padded" (ffi/codes.h GemmOp)."""
  return np.int32(_cpu.GemmOp[op])


def dtype_code(dtype) -> int:
  """The code of a float dtype (float32, bfloat16, float16) that the CUDA module's workspace functions
  take (ffi/codes.h DType)."""
  return int(_cpu.DType[jnp.dtype(dtype).name])


def activation_attrs(act: Activation) -> dict:
  """The attributes of an activation that the MLP handlers take: its code by name (ffi/codes.h Act, whose
  members the extension exports under the activations' names) and its parameters."""
  return dict(activation=np.int32(_cpu.Act[act.name]), alpha=np.float32(act.alpha), limit=np.float32(act.limit))


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


def cuda_module():
  """The CUDA extension, for a CUDA branch (which on_platforms traces only where a CUDA device is visible);
  RuntimeError where it is unavailable."""
  if _cuda is None:
    raise RuntimeError(f"jaxmlp's CUDA handlers are unavailable: {CUDA_BUILD_ERROR}")
  return _cuda


def on_platforms(*args, cpu, cuda):
  """jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda), the CUDA branch only where a CUDA device is
  visible and the shapes are concrete: a CUDA branch sizes its scratch and picks its GEMM path from the
  device's facts and the shapes at trace time, so without a device there is nothing it could be lowered
  for, and a symbolic shape (jax.export) could not size it."""
  concrete = all(is_static(n) for a in jax.tree.leaves(args) for n in np.shape(a))
  return jax.lax.platform_dependent(*args, cpu=cpu, **(dict(cuda=cuda) if cuda_devices() and concrete else {}))


def export_disabled_checks() -> list:
  """jax.export's `disabled_checks` for every jaxmlp custom call target:

      jax.export.export(jax.jit(f), disabled_checks=jaxmlp.export_disabled_checks())(*args)

  JAX serializes only custom calls whose targets promise a stable ABI, and jaxmlp's targets promise none
  across jaxmlp versions: an exported function runs in a process that has imported the same jaxmlp
  (which registers the targets), on a platform this process could lower for (CUDA only where a CUDA
  device is visible). Shapes may be symbolic (jax.export.symbolic_shape) on the CPU; the CUDA handlers
  size their scratch at trace time and take concrete shapes."""
  names = set(_cpu.registrations()) | (set(_cuda.registrations()) if _cuda is not None else set())
  return [jax.export.DisabledSafetyCheck.custom_call(name) for name in sorted(names)]


# The shape of an optional operand or result that is absent (no b1, b2 or scales; an unweighted combine):
# a scalar, which the handlers leave alone (ffi/checks.h Present). Not a 0-element array: jax 0.11.2's
# partitioner crashed (segmentation fault) compiling those inside a loop under shard_map (gradient
# accumulation over the expert-parallel layer).
ABSENT = ()


def optional(a, dtype):
  """An optional operand as the handlers take it: `a`, or an ABSENT scalar of `dtype` where it is None."""
  return jnp.zeros(ABSENT, dtype) if a is None else a


def result_types(*args):
  """The type of a call's results on `args`, as a function of (shape, dtype). Inside jax.shard_map they
  vary over every mesh axis an operand varies over, as the result of JAX's own ops would (JAX makes the
  operands vary alike before the call); untyped, JAX would take per-device results for replicated ones
  and reject the gradients of varying inputs."""
  varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in jax.tree.leaves(args)))
  if not varying:
    return jax.ShapeDtypeStruct
  # A type that names manual axes needs the mesh they belong to: the current one, with no dimension
  # partitioned (P() fits any rank).
  on_mesh = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), jax.P())
  mat = jax.sharding.ManualAxisType(varying=varying)
  return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_mesh, manual_axis_type=mat)


def call(target: str, outs, *args, workspace: int | None = None, input_output_aliases=None, **attrs) -> tuple:
  """One XLA FFI custom call of `target` on `args`, with the attributes `attrs`: its results `outs`, a list
  of (shape, dtype), typed by result_types. With `workspace` (the CUDA handlers), one more result of that
  many bytes follows them: the handler's scratch memory, which XLA plans so that no call allocates, dropped
  from what this returns."""
  sds = result_types(*args)
  results = [sds(shape, dtype) for shape, dtype in outs]
  if workspace is not None:
    results.append(sds((max(int(workspace), 1),), jnp.uint8))
  aliases = {} if input_output_aliases is None else dict(input_output_aliases=input_output_aliases)
  values = jax.ffi.ffi_call(target, results, vmap_method="sequential", **aliases)(*args, **attrs)
  return tuple(values[:len(outs)])
