"""jaxmlp.ragged_dot and the grouped product it is made of, one custom call per product.

  ragged_dot -> _ragged_dot (custom_vjp) -> grouped_gemm -> "jaxmlp_gemm" (ffi/cpu/mlp_cpu.cc; on CUDA one
  handler per GEMM path, ffi/cuda/gemm/). jaxmlp.reference.ragged_dot defines what it computes. The FP8
  emulations multiply on grouped_gemm too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _gemm_path, _groups, _library, reference
from ._autodiff import gathered, integer_cotangent, not_differentiable, refuse_forward_mode, summed_like


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
               out_sharding=None, *, check_group_sizes: bool = False):
  """Drop-in for jax.lax.ragged_dot: lhs [m, k], rhs [g, k, n], group_sizes [g] -> [m, n].

  float32, bfloat16 and float16 operands run on jaxmlp's grouped GEMM, with its own grouped VJP: rows past
  sum(group_sizes) are 0; `precision` is accepted for compatibility (float32 inputs are multiplied in
  float32 and 16-bit inputs accumulate in float32 whatever it says); the backward multiplies in the
  operands' dtype, so a float32 output gradient of 16-bit operands is rounded to their dtype first. Other
  dtypes (float64 under jax_enable_x64, int8 x int8 -> int32, ...) and extents past int32 run on
  jax.lax.ragged_dot itself, under jaxmlp's group_sizes policy (jaxmlp.reference.ragged_dot). Shape
  errors raise TypeError, as jax.lax's. group_offset and out_sharding are not supported
  (NotImplementedError).
  """
  for name, value in (("group_offset", group_offset), ("out_sharding", out_sharding)):
    if value is not None:
      raise NotImplementedError(f"jaxmlp.ragged_dot: {name} is not supported; use jax.lax.ragged_dot")
  dtype, out_dtype = _checks.check_ragged_dot(lhs, rhs, group_sizes, preferred_element_type)
  m, k, n = *np.shape(lhs), np.shape(rhs)[2]
  if check_group_sizes:
    _groups.check_at_run_time(group_sizes, m)
  if _checks.ragged_dot_unservable(lhs, rhs, dtype, out_dtype) or 0 in (m, k, n):
    # XLA's own op: no custom call takes these dtypes, or sizes, and an empty product has nothing to run
    return reference.ragged_dot(lhs.astype(dtype), rhs.astype(dtype), group_sizes, precision=precision,
                                preferred_element_type=out_dtype)
  refuse_forward_mode(lhs, rhs)
  group_sizes = _groups.host_sizes_as_int32(group_sizes, m)
  return _ragged_dot(*gathered(lhs.astype(dtype), rhs.astype(dtype)), group_sizes, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot(lhs, rhs, group_sizes, out_dtype):
  m, n = lhs.shape[0], rhs.shape[2]
  return not_differentiable(grouped_gemm, "nn", lhs, rhs, group_sizes, (m, n), out_dtype)


def _ragged_dot_fwd(lhs, rhs, group_sizes, out_dtype):
  return _ragged_dot(lhs, rhs, group_sizes, out_dtype), (lhs, rhs, group_sizes)


def _ragged_dot_bwd(out_dtype, res, dout):
  lhs, rhs, group_sizes = res
  dout = dout.astype(lhs.dtype)
  dlhs = not_differentiable(grouped_gemm, "nt", dout, rhs, group_sizes, lhs.shape, lhs.dtype)
  drhs = not_differentiable(grouped_gemm, "tn", lhs, dout, group_sizes, rhs.shape, rhs.dtype)
  return summed_like(dlhs, lhs), summed_like(drhs, rhs), integer_cotangent(group_sizes)


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _gemm_dtypes(path: str, dtype, out_dtype) -> tuple:
  """(input, output) dtypes of a CUDA GEMM handler asked for `dtype` inputs' product in out_dtype. Where
  the path cannot write out_dtype from those inputs, the handler multiplies in a wider dtype (an exact
  upcast) and the caller rounds its result once to out_dtype: cublasGemmGroupedBatchedEx takes one dtype
  in and out, and cuBLASLt's grouped GEMM writes a 16-bit product only in its own dtype or float32
  (float16 to bfloat16 "is not supported", cuBLAS 13.10); on the CUTLASS path cuBLASLt's grouped GEMM runs
  the products whose output dtype is not the input's (on the fused path, every plain product)."""
  dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
  if path == "fallback":
    wide = jnp.promote_types(dtype, out_dtype)
    return wide, wide
  if path in ("grouped", "cutlass", "fused") and out_dtype not in (dtype, jnp.float32):
    return dtype, jnp.dtype(jnp.float32)
  return dtype, out_dtype


def grouped_gemm(op: str, lhs, rhs, group_sizes, out_shape, out_dtype):
  """One grouped product (ffi GemmOp): "nn" lhs @ rhs[g], "nt" lhs @ rhs[g].T, "tn" out[g] = lhs[rows of
  g].T @ rhs[rows of g]."""
  args = (lhs, rhs, _groups.handler_sizes(group_sizes, lhs.shape[0]))
  attrs = dict(op=_library.gemm_op(op))
  E = group_sizes.shape[0]
  K, N = (lhs.shape[1], rhs.shape[-1]) if op != "nt" else (rhs.shape[1], lhs.shape[1])

  def cpu(*a):
    return _library.call("jaxmlp_gemm", [(out_shape, out_dtype)], *a, **attrs)[0]

  def cuda(lhs, rhs, sizes):
    path = _gemm_path.cuda_path(lhs.dtype, K, N, problem=(E, lhs.shape[0], K, N))
    ws = _library.cuda_module().gemm_workspace_bytes(path, E)
    in_dtype, handler_out = _gemm_dtypes(path, lhs.dtype, out_dtype)
    out = _library.call(f"jaxmlp_gemm_{path}", [(out_shape, handler_out)], lhs.astype(in_dtype),
                        rhs.astype(in_dtype), sizes, workspace=ws, **attrs)[0]
    return out.astype(out_dtype)

  return _library.on_platforms(*args, cpu=cpu, cuda=cuda)
