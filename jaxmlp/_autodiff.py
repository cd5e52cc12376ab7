"""What the ops' custom_vjp rules share: the guards against differentiating a custom call in forward mode or
again, and the operands' and gradients' types inside jax.shard_map and under Explicit mesh axes."""
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
  """Arrays, None, and tuples of them (a dispatch Plan)."""
  if isinstance(a, tuple):
    return all(_is_operand(b) for b in a)
  return a is None or isinstance(a, (jax.Array, np.ndarray, np.generic))


def summed_like(grad, primal):
  """Inside jax.shard_map, the gradient of an operand that is the same on every device along a mesh axis
  (weights replicated over a data-parallel axis) is the sum of the devices' gradients, as JAX makes it
  for its own ops; the custom calls' gradients vary over every axis any operand varies over."""
  if grad is None:
    return None
  axes = tuple(jax.typeof(grad).manual_axis_type.varying - jax.typeof(primal).manual_axis_type.varying)
  return jax.lax.psum(grad, axes) if axes else grad


def gathered(*operands):
  """The operands, those sharded over Explicit mesh axes (outside jax.shard_map) gathered whole onto every
  device: a custom call takes whole operands, and JAX requires a custom_vjp's gradients to have its
  operands' types, which a custom call's unsharded results have only for unsharded operands. The gather is
  jax.sharding.reshard, which JAX differentiates back to each operand's own sharding. None passes."""
  def whole(a):
    if a is None or all(p is None for p in jax.typeof(a).sharding.spec):
      return a
    return jax.sharding.reshard(a, jax.P())
  return tuple(whole(a) for a in operands)


def integer_cotangent(a):
  """The cotangent of an integer operand (group_sizes): float0 zeros."""
  return np.zeros(np.shape(a), dtype=jax.dtypes.float0)
