"""Pure-JAX reference: defines what jaxmlp.grouped_mlp and jaxmlp.ragged_dot compute.

Written independently of the FFI path, on top of jax.lax.ragged_dot, and differentiated by JAX autodiff.
It is also "the ragged_dot path" that benchmarks and the Flax example compare against. Intermediates
are rounded to the input dtype where the fast path stores them (the FC1 output and the activation
output), with float32 accumulation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _checks, fp8_mlp
from . import fp8 as fp8_recipes
from .activations import Activation, resolve


def grouped_mlp(x, w1, w2, group_sizes, *, activation: str | Activation = "swiglu", b1=None, b2=None,
                scales=None, fp8=None):
  """Reference for jaxmlp.grouped_mlp (same arguments and semantics).

  Pure JAX: without fp8 it takes float64 operands under jax_enable_x64, and JAX differentiates it in
  forward mode and to higher orders (jax.jvp, grad of grad, Hessian-vector products), where
  jaxmlp.grouped_mlp stops. Not under jax.jacfwd, jax.jacrev or jax.hessian: they vmap
  jax.lax.ragged_dot over an axis its batching rule does not take (jax 0.10: "ragged_dot vmap over any
  dim but 0 - NYI").
  """
  act = resolve(activation)
  recipe = fp8_recipes.resolve_with_weights(fp8, w1, w2)
  if recipe is not None:
    dtype = jnp.result_type(x)
    s = _checks.check_mlp(x, fp8_recipes.checked_as(w1, dtype), fp8_recipes.checked_as(w2, dtype), group_sizes, act,
                          b1, b2, scales)
    fp8_mlp.check(x, recipe, s, w1, w2)
    return fp8_mlp.reference_mlp(x, w1, w2, _checks.host_sizes_as_int32(group_sizes, s.M), b1, b2, scales, act,
                                 recipe)
  s = _checks.check_mlp(x, w1, w2, group_sizes, act, b1, b2, scales, float64=True)
  acc = jnp.promote_types(x.dtype, jnp.float32)  # the accumulation dtype: float32, or float64
  sizes = _checks.clamp_group_sizes(_checks.host_sizes_as_int32(group_sizes, s.M), s.M)
  rows = _checks.row_groups(sizes, s.M)  # E for padding rows
  valid = (rows < s.E)[:, None]
  expert = jnp.minimum(rows, s.E - 1)

  # h is stored in x.dtype twice, as the fast path does: FC1's output, then with b1 added.
  h = jax.lax.ragged_dot(x, w1, sizes, preferred_element_type=acc).astype(x.dtype)
  if b1 is not None:
    h = (h.astype(acc) + b1[expert].astype(acc)).astype(x.dtype)
  a = act(h.astype(acc))
  scale = scales.astype(acc)[:, None] if scales is not None else 1.0
  # The scale is applied to the activation output (where the fast path fuses it) and to b2: it weighs
  # the whole expert output, y = s * (act(h) @ w2 + b2).
  a = jnp.where(valid, a * scale, 0).astype(x.dtype)
  y = jax.lax.ragged_dot(a, w2, sizes, preferred_element_type=acc)
  if b2 is not None:
    y = y + jnp.where(valid, scale * b2[expert].astype(acc), 0)
  return jnp.where(valid, y, 0).astype(x.dtype)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
  """Reference for jaxmlp.ragged_dot: jax.lax.ragged_dot under jaxmlp's group_sizes policy (float64 too,
  under jax_enable_x64)."""
  if group_offset is not None:
    raise NotImplementedError("group_offset is not supported by jaxmlp.ragged_dot")
  _checks.check_ragged_dot(lhs, rhs, group_sizes, preferred_element_type, float64=True)
  sizes = _checks.clamp_group_sizes(_checks.host_sizes_as_int32(group_sizes, lhs.shape[0]), lhs.shape[0])
  return jax.lax.ragged_dot(lhs, rhs, sizes, precision=precision, preferred_element_type=preferred_element_type)
