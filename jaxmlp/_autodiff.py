"""What the ops' custom_vjp rules share: the guard against differentiating a custom call again, and the
gradients' types inside jax.shard_map."""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.interpreters import ad

SECOND_ORDER_ERROR = (
    "jaxmlp's custom calls have a first derivative only, in reverse mode: a derivative of the gradient "
    "(grad of grad, jax.hessian) is not implemented. Use jaxmlp.reference.grouped_mlp or "
    "jaxmlp.reference.ragged_dot: pure JAX, which differentiates them again (grad of grad, "
    "Hessian-vector products, jax.jvp), in float64 too under jax_enable_x64.")
FORWARD_MODE_ERROR = (
    "jaxmlp's custom calls are differentiated in reverse mode only (grad, vjp, jacrev): forward mode "
    "(jax.jvp, jax.jacfwd) is not implemented. Use jaxmlp.reference.grouped_mlp or "
    "jaxmlp.reference.ragged_dot there: pure JAX, which JAX differentiates in every mode.")


def refuse_forward_mode(*operands) -> None:
  """Raises TypeError with FORWARD_MODE_ERROR where an operand is being differentiated in forward mode.

  jax.jvp and jax.jacfwd reach an op as JVP tracers, and JAX would stop at the op's custom_vjp with its own
  message, which names no way on; reverse mode (grad, vjp, linearize) reaches it as linearize tracers."""
  if any(isinstance(leaf, ad.JVPTracer) for leaf in jax.tree.leaves(operands)):
    raise TypeError(FORWARD_MODE_ERROR)


def not_differentiable(call, *args):
  """`call(*args)`, raising SECOND_ORDER_ERROR at trace time where JAX would differentiate it.

  The ops' custom_vjp rules are what JAX differentiates once; it reaches the custom calls inside those
  rules only when differentiating again (grad of grad, jax.hessian), and would then fail with its own
  "cannot be differentiated" message. Non-array arguments (activation, shapes, dtypes) pass through.
  """
  static = tuple(i for i, a in enumerate(args) if not _is_operand(a))

  @functools.partial(jax.custom_jvp, nondiff_argnums=static)
  def guarded(*args):
    return call(*args)

  @guarded.defjvp
  def _(*args_and_tangents):
    raise NotImplementedError(SECOND_ORDER_ERROR)

  return guarded(*args)


def _is_operand(a) -> bool:
  return a is None or isinstance(a, (jax.Array, np.ndarray, np.generic))


def summed_like(grad, primal):
  """The gradient of `primal` as JAX types it for its own ops: inside jax.shard_map, the gradient of an
  operand that is the same on every device along a mesh axis (weights replicated over a data-parallel
  axis) is the sum of the devices' gradients, where the custom calls' gradients vary over every axis any
  operand varies over; and under Explicit mesh axes it is sharded as its primal, where a custom call's
  result is not sharded at all."""
  if grad is None:
    return None
  axes = tuple(jax.typeof(grad).manual_axis_type.varying - jax.typeof(primal).manual_axis_type.varying)
  if axes:
    grad = jax.lax.psum(grad, axes)
  spec = jax.typeof(primal).sharding.spec
  if any(p is not None for p in spec) and spec != jax.typeof(grad).sharding.spec:
    grad = jax.sharding.reshard(grad, spec)
  return grad


def integer_cotangent(a):
  """The cotangent of an integer operand (group_sizes): float0 zeros."""
  return np.zeros(np.shape(a), dtype=jax.dtypes.float0)
