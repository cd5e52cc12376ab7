"""Pure-JAX reference: defines what jaxmlp.grouped_mlp and jaxmlp.ragged_dot compute.

Written independently of the FFI path, on top of jax.lax.ragged_dot, and differentiated by JAX autodiff
(FP8: by the recipe's own backward, which is part of its definition). It is also "the ragged_dot path" that
benchmarks and the Flax example compare against. Intermediates are rounded to the input dtype where the
fast path stores them (the FC1 output and the activation output), with float32 accumulation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _checks, _groups
from ._autodiff import integer_cotangent
from .activations import Activation, resolve
from .fp8 import delayed
from .fp8 import recipe as fp8_recipe


def grouped_mlp(x, w1, w2, group_sizes, *, activation: str | Activation = "swiglu", b1=None, b2=None,
                scales=None, fp8=None, zero_padding: bool = True, fp8_history=None):
  """Reference for jaxmlp.grouped_mlp (same arguments and semantics; it writes zeros in the rows past the
  groups whatever zero_padding says, as zero_padding=False allows; fp8_history's gradient is its update).

  Pure JAX: without fp8 it takes float64 operands under jax_enable_x64, and JAX differentiates it in
  forward mode and to higher orders (jax.jvp, grad of grad, Hessian-vector products), where
  jaxmlp.grouped_mlp stops. Not under jax.jacfwd, jax.jacrev or jax.hessian: they vmap
  jax.lax.ragged_dot over an axis its batching rule does not take (jax 0.10: "ragged_dot vmap over any
  dim but 0 - NYI").
  """
  act = resolve(activation)
  recipe = fp8_recipe.resolve_with_weights(fp8, w1, w2)
  delayed.check(fp8_history, None if recipe is None else recipe.scaling)
  if recipe is not None:
    dtype = jnp.result_type(x)
    s = _checks.check_mlp(x, fp8_recipe.checked_as(w1, dtype), fp8_recipe.checked_as(w2, dtype), group_sizes, act,
                          b1, b2, scales)
    fp8_recipe.check_call(x, recipe, s, w1, w2)
    recipe = fp8_recipe.as_run(recipe, s, w1, w2)
    if recipe is None or 0 in (s.M, s.d, s.f):  # the recipe's `when`, or an empty problem: in x's dtype
      w1, w2 = (fp8_recipe.weights_of(w).astype(dtype) for w in (w1, w2))
      y = grouped_mlp(x, w1, w2, group_sizes, activation=act, b1=b1, b2=b2, scales=scales)
      return y if fp8_history is None else delayed.unchanged(y, fp8_history)  # nothing observed
    (w1, w1q), (w2, w2q) = (fp8_recipe.split_weights(w, dtype) for w in (w1, w2))
    return _fp8_mlp(x, w1, w2, w1q, w2q, _groups.host_sizes_as_int32(group_sizes, s.M), b1, b2, scales, fp8_history,
                    act, recipe)
  s = _checks.check_mlp(x, w1, w2, group_sizes, act, b1, b2, scales, float64=True)
  acc = jnp.promote_types(x.dtype, jnp.float32)  # the accumulation dtype: float32, or float64
  groups = _groups.Groups.of(_groups.host_sizes_as_int32(group_sizes, s.M), s.M)
  valid = groups.valid[:, None]
  expert = jnp.minimum(groups.row_group, s.E - 1)

  # h is stored in x.dtype twice, as the fast path does: FC1's output, then with b1 added.
  h = jax.lax.ragged_dot(x, w1, groups.sizes, preferred_element_type=acc).astype(x.dtype)
  if b1 is not None:
    h = (h.astype(acc) + b1[expert].astype(acc)).astype(x.dtype)
  a = act(h.astype(acc))
  scale = scales.astype(acc)[:, None] if scales is not None else 1.0
  # The scale is applied to the activation output (where the fast path fuses it) and to b2: it weighs
  # the whole expert output, y = s * (act(h) @ w2 + b2).
  a = jnp.where(valid, a * scale, 0).astype(x.dtype)
  y = jax.lax.ragged_dot(a, w2, groups.sizes, preferred_element_type=acc)
  if b2 is not None:
    y = y + jnp.where(valid, scale * b2[expert].astype(acc), 0)
  return jnp.where(valid, y, 0).astype(x.dtype)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
  """Reference for jaxmlp.ragged_dot: jax.lax.ragged_dot under jaxmlp's group_sizes policy, in any dtype it
  takes (float64 too, under jax_enable_x64)."""
  if group_offset is not None:
    raise NotImplementedError("group_offset is not supported by jaxmlp.ragged_dot")
  _checks.check_ragged_dot(lhs, rhs, group_sizes, preferred_element_type)
  sizes = _groups.clamp_group_sizes(_groups.host_sizes_as_int32(group_sizes, lhs.shape[0]), lhs.shape[0])
  return jax.lax.ragged_dot(lhs, rhs, sizes, precision=precision, preferred_element_type=preferred_element_type)


# ---- FP8: the recipe's definition around jax.lax.ragged_dot, with the recipe's own backward ----------------
def _ragged_dot_gemm(op, lhs, rhs, sizes):
  """The float32 grouped products of the recipes (jaxmlp.fp8.quantize.Gemm) on jax.lax.ragged_dot."""
  hi = jax.lax.Precision.HIGHEST
  if op == "nn":
    return jax.lax.ragged_dot(lhs, rhs, sizes, precision=hi, preferred_element_type=jnp.float32)
  if op == "nt":
    return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), sizes, precision=hi, preferred_element_type=jnp.float32)
  numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers, precision=hi, preferred_element_type=jnp.float32)


# history: None, or delayed scaling's amax history [4, H], whose "gradient" is its update (jaxmlp.fp8.delayed).
@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _fp8_mlp(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe):
  return _fp8_mlp_fwd(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe)[0]


def _fp8_mlp_fwd(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe):
  emulation = recipe.scheme.emulation(_ragged_dot_gemm)
  w1q = recipe.scheme.quantize_weights(w1) if w1q is None else w1q
  w2q = recipe.scheme.quantize_weights(w2) if w2q is None else w2q
  groups = _groups.Groups.of(group_sizes, x.shape[0])
  y, residuals = emulation.forward(x, w1q, w2q, groups, b1, b2, scales, act, recipe, None, True, True,
                                   **delayed.given(history))
  return y, (residuals, groups, b1, b2, scales, history)


def _fp8_mlp_bwd(act, recipe, saved, dy):
  residuals, groups, b1, b2, scales, history = saved
  emulation = recipe.scheme.emulation(_ragged_dot_gemm)
  dx, dw1, dw2, db1, db2, dscales, *seen = emulation.backward(
      residuals, groups, b1, b2, scales, act, recipe, None, dy.astype(residuals[0].dtype), True,
      **delayed.given(history))
  new_history = None if history is None else delayed.updated(history, seen[0])
  return dx, dw1, dw2, None, None, integer_cotangent(groups.given), db1, db2, dscales, new_history


_fp8_mlp.defvjp(_fp8_mlp_fwd, _fp8_mlp_bwd)
