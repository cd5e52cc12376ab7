"""The public ops: jaxmlp.grouped_mlp and jaxmlp.ragged_dot, each a custom_vjp around FFI calls."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _ffi, fp8_mlp, reference
from . import fp8 as fp8_recipes
from .activations import Activation, resolve


def grouped_mlp(x, w1, w2, group_sizes, *, activation: str | Activation = "swiglu", b1=None, b2=None,
                scales=None, check_group_sizes: bool = False, fp8: str | fp8_recipes.Fp8Recipe | None = None):
  """Mixture-of-Experts expert MLP over rows sorted by expert: `scales * (act(x @ w1[g] + b1[g]) @ w2[g] + b2[g])`.

  Args:
    x: [M, d] rows sorted by group; group g owns rows [offset_g, offset_g + group_sizes[g]).
    w1: [E, d, 2f] for gated activations (first f columns gate, last f linear part), else [E, d, f].
    w2: [E, f, d].
    group_sizes: [E] integer, on the device. Negative sizes count as 0 and the running total is capped
      at M; rows past the total are padding: output 0, gradient 0.
    activation: a name (swiglu, geglu, reglu, gelu, relu, silu, squared_relu, clamped_swiglu) or a
      jaxmlp.Activation with parameters.
    b1: optional [E, 2f] or [E, f] FC1 bias. b2: optional [E, d] FC2 bias.
    scales: optional [M] per-row factor on the row's whole expert output, b2 included (an MoE's
      router weights); differentiable.
    check_group_sizes: raise ValueError if group_sizes holds negative sizes or sums past M. Concrete
      sizes (NumPy, or a jax.Array outside jit) are checked at once; traced ones (under jit) at run time,
      by a host callback, whose ValueError JAX reports as jax.errors.JaxRuntimeError with the same message
      (costs a device-to-host copy; for debugging).
    fp8: None (x's dtype throughout), "tensorwise", "blockwise" or a jaxmlp.Fp8Recipe: FC1 and FC2,
      forward and backward, as FP8 e4m3 products (the recipes: jaxmlp.fp8, jaxmlp.fp8_blockwise; biases
      and their gradients stay in x's dtype); bfloat16 or float16 operands, d and f multiples of 16. w1
      and w2 may then be jaxmlp.Fp8Weights (jaxmlp.fp8_weights): weights quantized once and reused over
      calls, with the same results; where fp8 is None, theirs is the recipe.

  Returns:
    [M, d] in x.dtype (float32, bfloat16 or float16; accumulation in float32).

  Differentiable once, in reverse mode (grad, vjp, value_and_grad, jacrev). Forward mode (jax.jvp,
  jax.jacfwd) and derivatives of the gradient (grad of grad, jax.hessian) are not implemented: use
  jaxmlp.reference.grouped_mlp there.
  """
  act = resolve(activation)
  recipe = fp8_recipes.resolve_with_weights(fp8, w1, w2)
  dtype = jnp.result_type(x)
  shape = _checks.check_mlp(x, fp8_recipes.checked_as(w1, dtype), fp8_recipes.checked_as(w2, dtype), group_sizes,
                            act, b1, b2, scales)
  if recipe is not None:
    fp8_mlp.check(x, recipe, shape, w1, w2)
  if check_group_sizes:
    _check_group_sizes_at_run_time(group_sizes, shape.M)
  group_sizes = _checks.host_sizes_as_int32(group_sizes, shape.M)
  if 0 in (shape.M, shape.d, shape.f):
    # An empty problem leaves only biases and zeros to compute, and the handlers take no zero-sized
    # operands (they launch kernels sized by them): the reference, which defines the semantics, does it.
    w1, w2 = (fp8_recipes.weights_of(w).astype(dtype) for w in (w1, w2))
    return reference.grouped_mlp(x, w1, w2, group_sizes, activation=act, b1=b1, b2=b2, scales=scales)
  if recipe is not None:
    return fp8_mlp.grouped_mlp(x, w1, w2, group_sizes, b1, b2, scales, act, recipe, shape)
  return _mlp(x, w1, w2, group_sizes, b1, b2, scales, act, shape)


def fp8_weights(w, fp8: str | fp8_recipes.Fp8Recipe = "tensorwise", dtype=None) -> fp8_recipes.Fp8Weights:
  """Expert weights quantized for an FP8 recipe, once: grouped_mlp(..., fp8=...) takes them in place of w1
  or w2 and then skips their quantization (two passes over the weights per call).

  Quantize once per optimizer step and reuse over the step's micro-batches (gradient accumulation), as
  TransformerEngine caches FP8 weights on the first micro-batch: the results equal those of passing
  w.astype(dtype). The gradient of a grouped_mlp call for these weights flows to `w` (Fp8Weights.weights)
  in w's dtype; the quantization itself is not differentiated (the weights are constants of the step).

  Args:
    w: [E, K, N] weights (w1 [E, d, F1] or w2 [E, f, d]) as the optimizer holds them, float32 master
      weights too; K and N multiples of 16.
    fp8: the recipe: "tensorwise", "blockwise" or a jaxmlp.Fp8Recipe.
    dtype: the computation dtype the calls take (x's: bfloat16 or float16), which w is rounded to before
      it is quantized, as grouped_mlp would take it; default w's dtype.
  """
  recipe = fp8_recipes.resolve(fp8)
  if recipe is None:
    raise ValueError("fp8_weights: fp8 must name a recipe (tensorwise or blockwise), got None")
  shape = np.shape(w)
  if len(shape) != 3 or shape[1] % 16 or shape[2] % 16:
    raise ValueError(f"fp8_weights: w has shape {list(shape)}, expected [E, K, N] with K and N multiples of 16")
  dtype = jnp.dtype(jnp.result_type(w) if dtype is None else dtype)
  if dtype not in (jnp.bfloat16, jnp.float16):
    raise TypeError(f"fp8_weights: computation dtype {dtype} is not supported; FP8 weights are quantized from "
                    "bfloat16 or float16 (pass dtype= for wider weights)")
  if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
    raise TypeError(f"fp8_weights: w.dtype {jnp.result_type(w)} is not a floating-point type")
  return fp8_mlp.fp8_weights(w, recipe, dtype)


# The operands were checked once, in grouped_mlp: the rules get their sizes (`shape`, static and
# hashable) instead of checking them again.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _mlp(x, w1, w2, group_sizes, b1, b2, scales, act, shape):
  return _mlp_fwd(x, w1, w2, group_sizes, b1, b2, scales, act, shape)[0]


def _mlp_fwd(x, w1, w2, group_sizes, b1, b2, scales, act, shape):
  y, h = _not_differentiable(_ffi.mlp_forward, x, w1, w2, group_sizes, b1, b2, scales, act, shape)
  # Residuals: the inputs and the FC1 output; the activation output is recomputed in the backward.
  return y, (x, w1, w2, group_sizes, b1, b2, scales, h)


def _mlp_bwd(act, shape, res, dy):
  x, w1, w2, group_sizes, b1, b2, scales, h = res
  grads = _not_differentiable(_ffi.mlp_backward, x, w1, w2, group_sizes, b1, b2, scales, h, dy, act, shape)
  dx, dw1, dw2, db1, db2, dscales = map(_summed_like, grads, (x, w1, w2, b1, b2, scales))
  return dx, dw1, dw2, _integer_cotangent(group_sizes), db1, db2, dscales


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
               out_sharding=None, *, check_group_sizes: bool = False):
  """Drop-in for jax.lax.ragged_dot: lhs [m, k], rhs [g, k, n], group_sizes [g] -> [m, n].

  Rows past sum(group_sizes) are 0. `precision` is accepted for compatibility: float32 inputs are
  multiplied in float32 and 16-bit inputs accumulate in float32 whatever it says. The backward
  multiplies in the operands' dtype, so a float32 output gradient of 16-bit operands is rounded to
  their dtype first. group_offset and out_sharding are not supported (NotImplementedError).
  """
  for name, value in (("group_offset", group_offset), ("out_sharding", out_sharding)):
    if value is not None:
      raise NotImplementedError(f"jaxmlp.ragged_dot: {name} is not supported; use jax.lax.ragged_dot")
  del precision
  dtype, out_dtype = _checks.check_ragged_dot(lhs, rhs, group_sizes, preferred_element_type)
  m, k, n = *np.shape(lhs), np.shape(rhs)[2]
  if check_group_sizes:
    _check_group_sizes_at_run_time(group_sizes, m)
  group_sizes = _checks.host_sizes_as_int32(group_sizes, m)
  if 0 in (m, k, n):  # an empty product: zeros, without a custom call (see grouped_mlp)
    return reference.ragged_dot(lhs.astype(dtype), rhs.astype(dtype), group_sizes, preferred_element_type=out_dtype)
  return _ragged_dot(lhs.astype(dtype), rhs.astype(dtype), group_sizes, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot(lhs, rhs, group_sizes, out_dtype):
  m, n = lhs.shape[0], rhs.shape[2]
  return _not_differentiable(_ffi.grouped_gemm, "nn", lhs, rhs, group_sizes, (m, n), out_dtype)


def _ragged_dot_fwd(lhs, rhs, group_sizes, out_dtype):
  return _ragged_dot(lhs, rhs, group_sizes, out_dtype), (lhs, rhs, group_sizes)


def _ragged_dot_bwd(out_dtype, res, dout):
  lhs, rhs, group_sizes = res
  dout = dout.astype(lhs.dtype)
  dlhs = _not_differentiable(_ffi.grouped_gemm, "nt", dout, rhs, group_sizes, lhs.shape, lhs.dtype)
  drhs = _not_differentiable(_ffi.grouped_gemm, "tn", lhs, dout, group_sizes, rhs.shape, rhs.dtype)
  return _summed_like(dlhs, lhs), _summed_like(drhs, rhs), _integer_cotangent(group_sizes)


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


SECOND_ORDER_ERROR = (
    "jaxmlp's custom calls have a first derivative only, in reverse mode: a derivative of the gradient "
    "(grad of grad, jax.hessian) is not implemented. Use jaxmlp.reference.grouped_mlp or "
    "jaxmlp.reference.ragged_dot: pure JAX, which differentiates them again (grad of grad, "
    "Hessian-vector products, jax.jvp), in float64 too under jax_enable_x64.")


def _not_differentiable(call, *args):
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


def _summed_like(grad, primal):
  """Inside jax.shard_map, the gradient of an operand that is the same on every device along a mesh axis
  (weights replicated over a data-parallel axis) is the sum of the devices' gradients, as JAX makes it
  for its own ops; the custom calls' gradients vary over every axis any operand varies over."""
  if grad is None:
    return None
  axes = tuple(jax.typeof(grad).manual_axis_type.varying - jax.typeof(primal).manual_axis_type.varying)
  return jax.lax.psum(grad, axes) if axes else grad


def _integer_cotangent(a):
  return np.zeros(np.shape(a), dtype=jax.dtypes.float0)


def _check_group_sizes_at_run_time(group_sizes, m: int) -> None:
  def check(sizes):
    sizes = np.asarray(sizes, dtype=np.int64)
    wrong = []
    if (sizes < 0).any():
      wrong.append("negative entries")
    if sizes.clip(0).sum() > m:  # what the policy would cap
      wrong.append(f"sizes sum to {sizes.clip(0).sum()} > M = {m}")
    if wrong:
      raise ValueError(f"group_sizes {sizes.tolist()}: {' and '.join(wrong)} (check_group_sizes=True)")

  if not isinstance(group_sizes, jax.core.Tracer):
    # Concrete: check now, a ValueError at the call (a NumPy array before JAX could narrow an int64
    # array by wrapping).
    check(np.asarray(group_sizes))
  else:
    # Under jit: at run time, from a host callback; JAX reports its ValueError as a JaxRuntimeError.
    jax.debug.callback(check, group_sizes)
