"""grouped_mlp with an FP8 recipe: the custom_vjp, on the CUDA handlers or the emulation (jaxmlp.fp8).

On a GPU each direction is one custom call (jaxmlp_mlp_fp8_fwd / _bwd, ffi/cuda/fp8_mlp_cuda.cu). On the
CPU, and in jaxmlp.reference, the same recipe is emulated: quantize-dequantize in JAX around float32
grouped products (jaxmlp's CPU handlers there, jax.lax.ragged_dot in the reference). Both directions
carry the same residuals on every platform: the FC1 output h, the forward's four amaxes and its e4m3
copies of x, w1 and w2 (not x itself: the backward needs only q(x), at half the bytes).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _ffi, fp8
from .activations import Activation


def grouped_mlp(x, w1, w2, group_sizes, scales, act: Activation, recipe: fp8.Fp8Recipe, shape: _checks.MlpShape):
  """grouped_mlp's FP8 path for checked operands (see jaxmlp.grouped_mlp); no biases."""
  return _mlp(x, w1, w2, group_sizes, scales, act, recipe, shape)


def reference_mlp(x, w1, w2, group_sizes, scales, act: Activation, recipe: fp8.Fp8Recipe):
  """The FP8 recipe's definition: the emulation around jax.lax.ragged_dot, with the same VJP."""
  return _reference(x, w1, w2, group_sizes, scales, act, recipe)


def check(x, b1, b2, recipe: fp8.Fp8Recipe, shape: _checks.MlpShape) -> None:
  """Trace-time checks of an FP8 call, with the reason in the error."""
  if b1 is not None or b2 is not None:
    raise NotImplementedError(f"fp8={recipe.name!r}: biases (b1, b2) are not supported with FP8 yet")
  if jnp.result_type(x) == jnp.float32:
    raise TypeError("fp8: x.dtype float32 is not supported; FP8 training takes bfloat16 or float16 operands")
  if shape.d % 16 or shape.f % 16:
    raise ValueError(f"fp8: d = {shape.d} and f = {shape.f} must be multiples of 16 (FP8 rows are 16-byte "
                     "aligned for the tensor cores)")
  # The weight gradients read transposed copies with every group's rows rounded up to 16, M + 15 E rows
  # in all (ffi/cuda/grouped_gemm.h PaddedRows), indexed with int32.
  padded_rows = (shape.M + 15 * shape.E + 15) // 16 * 16
  if padded_rows >= _checks.INDEX_LIMIT:
    raise ValueError(f"fp8: x has M = {shape.M} rows and w1 E = {shape.E} experts; M + 15 E must stay below 2^31 "
                     "(the weight gradients pad each group's rows to a multiple of 16)")


def _valid_rows(sizes, m: int):
  return jnp.arange(m) < jnp.sum(_checks.clamp_group_sizes(sizes, m))


# ---- the emulation's grouped products ---------------------------------------------------------------------
def _cpu_gemm(op, lhs, rhs, sizes):
  """jaxmlp's CPU grouped GEMM handler on float32 operands."""
  if op == "tn":
    out_shape = (sizes.shape[0], lhs.shape[1], rhs.shape[1])
  else:
    out_shape = (lhs.shape[0], rhs.shape[2] if op == "nn" else rhs.shape[1])
  return _ffi.cpu_grouped_gemm(op, lhs, rhs, sizes, out_shape)


def _ragged_dot_gemm(op, lhs, rhs, sizes):
  hi = jax.lax.Precision.HIGHEST
  sizes = _checks.clamp_group_sizes(sizes, lhs.shape[0])
  if op == "nn":
    return jax.lax.ragged_dot(lhs, rhs, sizes, precision=hi, preferred_element_type=jnp.float32)
  if op == "nt":
    return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), sizes, precision=hi, preferred_element_type=jnp.float32)
  numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers, precision=hi, preferred_element_type=jnp.float32)


def _emulated(gemm, forward: bool):
  """The emulation of one direction: the forward takes (x, w1, w2, ...), the backward (xq, w1q, w2q, ...)."""
  def run(*args):
    x, w1, w2, sizes, scales, act = args[:6]
    valid = _valid_rows(sizes, x.shape[0])
    if forward:
      return fp8.emulated_forward(gemm, x, w1, w2, sizes, scales, valid, act)
    return fp8.emulated_backward(gemm, x, w1, w2, sizes, scales, valid, act, *args[6:])
  return run


# ---- the custom_vjp of the op -------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _mlp(x, w1, w2, group_sizes, scales, act, recipe, shape):
  return _mlp_fwd(x, w1, w2, group_sizes, scales, act, recipe, shape)[0]


def _mlp_fwd(x, w1, w2, group_sizes, scales, act, recipe, shape):
  def cpu(x, w1, w2, sizes, scales):
    return _emulated(_cpu_gemm, True)(x, w1, w2, sizes, scales, act)

  def cuda(x, w1, w2, sizes, scales):
    return _ffi.mlp_fp8_forward(x, w1, w2, sizes, scales, act, recipe, shape)

  y, h, amaxes, xq, w1q, w2q = jax.lax.platform_dependent(x, w1, w2, group_sizes, scales, cpu=cpu, cuda=cuda)
  return y, (xq, w1q, w2q, group_sizes, scales, h, amaxes)


def _mlp_bwd(act, recipe, shape, res, dy):
  xq, w1q, w2q, group_sizes, scales, h, amaxes = res

  def cpu(*a):
    return _emulated(_cpu_gemm, False)(*a[:5], act, *a[5:])

  def cuda(xq, w1q, w2q, sizes, scales, h, amaxes, dy):
    return _ffi.mlp_fp8_backward(xq, w1q, w2q, sizes, scales, h, amaxes, dy, act, shape)

  dx, dw1, dw2, dscales = jax.lax.platform_dependent(xq, w1q, w2q, group_sizes, scales, h, amaxes, dy.astype(h.dtype),
                                                     cpu=cpu, cuda=cuda)
  return dx, dw1, dw2, np.zeros(np.shape(group_sizes), jax.dtypes.float0), dscales


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _reference(x, w1, w2, group_sizes, scales, act, recipe):
  return _reference_fwd(x, w1, w2, group_sizes, scales, act, recipe)[0]


def _reference_fwd(x, w1, w2, group_sizes, scales, act, recipe):
  y, h, amaxes, xq, w1q, w2q = _emulated(_ragged_dot_gemm, True)(x, w1, w2, group_sizes, scales, act)
  return y, (xq, w1q, w2q, group_sizes, scales, h, amaxes)


def _reference_bwd(act, recipe, res, dy):
  xq, w1q, w2q, group_sizes, scales, h, amaxes = res
  dx, dw1, dw2, dscales = _emulated(_ragged_dot_gemm, False)(xq, w1q, w2q, group_sizes, scales, act, h, amaxes, dy)
  return dx, dw1, dw2, np.zeros(np.shape(group_sizes), jax.dtypes.float0), dscales


_reference.defvjp(_reference_fwd, _reference_bwd)
