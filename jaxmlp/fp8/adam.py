"""jaxmlp.fp8_adam_step: optax's adam (or adamw) step of float32 master expert weights that also quantizes the
new weights for the next step's FP8 calls, in the same pass over the weights.

An FP8 call needs its weights in e4m3 (jaxmlp.fp8_weights): a pass that reads the master weights and writes
two e4m3 layouts, once per step even with the weights quantized once for all micro-batches (and for
tensorwise a pass before it for their maximum). The optimizer's update already reads and writes every
weight; on a GPU this step writes the e4m3 layouts of the new weights in that pass (one CUDA kernel: a
128 x 128 tile is updated, held in registers, and quantized), so the quantizer's reads of the weights are
gone. The blockwise recipe quantizes a tile by its own scale. The tensorwise recipe's one scale needs the
whole tensor's maximum before the first value is quantized: the step quantizes by the last weights' maximum
(delayed scaling, as TransformerEngine's optimizers update FP8 weights) and returns the new weights' maximum
for the next step.

Semantics, per element, in float32 with each operation rounded once as optax computes it (t = count + 1,
saturating at the count's maximum as optax.safe_increment):

    mu' = (1 - b1) g + b1 mu            nu' = (1 - b2) g^2 + b2 nu
    u   = (mu' / (1 - b1^t)) / (sqrt(nu' / (1 - b2^t) + eps_root) + eps)  [+ weight_decay w]
    w'  = w + u (-learning_rate)
    blockwise:  quantized = jaxmlp.fp8_weights(w', "blockwise", dtype)
    tensorwise: r = w'.astype(dtype); q = e4m3(r * 448 / A) rounded to nearest even and saturating at +-448,
                scales = A, amax = max |r|, where A is the amax of the last weights' Fp8Weights

which is optax.adam(learning_rate, b1, b2, eps, eps_root=eps_root) (with weight_decay, optax.adamw without a
mask) applied to w. Under delayed scaling an element past the last weights' maximum saturates: it is off by
at most what this step moved it past that maximum (a step of adam moves a weight by about the learning rate).
A last maximum of 0 (weights initialised to zeros) quantizes by scale 1, as tensorwise.quantize_e4m3 does:
the first step's small weights then lie among e4m3's subnormals or round to 0, for that one step. A NaN
weight makes the JAX code's maximum NaN (scale 1 the next step); the kernel's passes NaN over.
On the CPU this module's JAX code computes it, as optax does; on a GPU the kernels
(ffi/cuda/fp8/fp8_adam_kernels.cu) round the same operations in the same order (no fused multiply-adds).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import expert_parallel
from .._library import on_platforms
from . import blockwise, cuda, quantize, tensorwise
from .recipe import Fp8Recipe, Fp8Weights


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
  """adam's constants (the learning rate and the step count travel as arrays: schedules trace them)."""
  b1: float
  b2: float
  eps: float
  eps_root: float
  weight_decay: float


def fp8_adam_step(w, g, state, *, learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0, weight_decay: float = 0.0, dtype=jnp.bfloat16, expert_axis: str | None = None,
                  fp8: str | Fp8Recipe | Fp8Weights = "blockwise"):
  """One adam step of float32 master expert weights, and the new weights quantized for an FP8 recipe: (new
  w, new state, jaxmlp.Fp8Weights of the new w).

  The step of optax.adam (with weight_decay > 0, of optax.adamw) on w; the Fp8Weights are written on a GPU
  in the same pass over the weights as the update (module docstring). Blockwise, they equal
  jaxmlp.fp8_weights(new w, "blockwise", dtype); tensorwise, the new weights are quantized by the last
  weights' maximum (delayed scaling: `fp8`). Pass them to the next step's grouped_mlp calls in place of w, with their
  `weights` field the master weights being differentiated (dataclasses.replace(w_fp8, weights=w); the
  Flax modules: fp8_weights(quantized)), so that the step quantizes nothing: see docs/fp8.md, "Weights
  written by the optimizer". Only where the step gains (Fp8Recipe.optimizer_writes_fp8(M, E)): below, the
  calls run in x's dtype and leave the FP8 copy unread, or gain less than this step's kernel gives back
  against optax's step writing a 16-bit copy (docs/fp8.md).

  Args:
    w: [E, K, N] float32 master weights (w1 [E, d, F1] or w2 [E, f, d]); K and N multiples of 16.
    g: w's gradient [E, K, N], float32 or in `dtype`: the 16-bit gradient an FP8 call gives, taken as its
      float32 value (the step of optax on g.astype(float32), not on g: optax would compute the moments'
      terms in g's dtype) without the conversion pass XLA would run for a float32 one: differentiate the
      call with respect to the weights cast to dtype (see docs/fp8.md).
    state: adam's state of w, a NamedTuple with `count` (int32 scalar), `mu` and `nu` (float32 like w):
      optax.ScaleByAdamState (optax.scale_by_adam().init(w)) or any with those fields; returned with them
      replaced (`_replace`).
    learning_rate: a scalar (a traced one too: a schedule's value at state.count, where optax evaluates
      its schedules, before the step's increment).
    b1, b2, eps, eps_root, weight_decay: adam's constants, as optax.adam / optax.adamw take them.
    dtype: the computation dtype of the calls (x's: bfloat16 or float16) that the new weights are rounded to
      before they are quantized, as fp8_weights' dtype.
    expert_axis: the axis of the current mesh (jax.set_mesh) that the experts are split over, as the MoE
      layer's expert_axis: each device then steps and quantizes its own experts inside a jax.shard_map (a
      128 x 128 tile lies in one expert: the results are those of the whole tensor), and the results come
      back split over that axis (alone: under Explicit axes, w's other axes are gathered). Without it, or
      without a current mesh (as the layer, which then runs on one device), the step takes its operands
      whole: on a GPU its kernel would run on them gathered.
    fp8: "blockwise" (or its Fp8Recipe): each 128 x 128 block quantized by its own scale. For tensorwise the
      Fp8Weights of w (the last step's fp8_adam_step, or jaxmlp.fp8_weights(w, "tensorwise", dtype) before
      the first): the new weights are quantized by its `amax`, w's maximum, and the result carries the new
      weights' maximum for the next step.
  """
  hyper = _check(w, g, state, learning_rate, b1, b2, eps, eps_root, weight_decay, dtype)
  delayed = _delayed_amax(fp8, np.shape(w))
  try:  # no tokens here: 0 splits over any axis
    expert_parallel.axis_size(expert_axis, np.shape(w)[0], 0, experts_name="w")
  except ValueError as e:
    raise ValueError(f"fp8_adam_step: {e}") from None
  split = expert_axis is not None and not jax.sharding.get_abstract_mesh().empty  # an axis of size 1 too
  mu, nu, count = state.mu, state.nu, jnp.asarray(state.count)
  # optax.safe_increment, then optax's bias corrections and its scaling by the negative learning rate,
  # computed as optax computes them: the same values on the CPU and for the GPU's kernel.
  count = jnp.where(count < jnp.iinfo(count.dtype).max, count + 1, count)
  scalars = jnp.stack([-1 * jnp.asarray(learning_rate, jnp.float32), 1 - b1 ** count, 1 - b2 ** count])
  scalars = scalars.astype(jnp.float32)
  # The [E, ...] operands and results split by their leading dimension over the axis, the scalars whole.
  split_specs = lambda whole_in, whole_out: ((P(expert_axis),) * 4 + (P(),) * whole_in,
                                             tuple(P() if i in whole_out else P(expert_axis) for i in range(6)))
  if delayed is None:
    step = functools.partial(_block_step_on_platforms, hyper=hyper, dtype=jnp.dtype(dtype))
    if split:
      step = expert_parallel.split_over(step, expert_axis, *split_specs(1, ()))
    w, mu, nu, q, e, qt = step(w, g, mu, nu, scalars)
    return w, state._replace(count=count, mu=mu, nu=nu), Fp8Weights(w, q, e, qt, recipe="blockwise")
  step = functools.partial(_tensor_step_on_platforms, hyper=hyper, dtype=jnp.dtype(dtype),
                           axis=expert_axis if split else None)
  if split:  # the new amax is the maximum over the devices' experts (a pmax): whole
    step = expert_parallel.split_over(step, expert_axis, *split_specs(2, (4,)))
  w, mu, nu, q, amax, qt = step(w, g, mu, nu, scalars, delayed)
  return (w, state._replace(count=count, mu=mu, nu=nu),
          Fp8Weights(w, q, delayed, qt, recipe="tensorwise", amax=amax))


def _block_step_on_platforms(w, g, mu, nu, scalars, hyper: Hyperparameters, dtype):
  return on_platforms(w, g, mu, nu, scalars, cpu=functools.partial(_block_step, hyper=hyper, dtype=dtype),
                      cuda=functools.partial(cuda.block_adam, hyper=hyper, dtype=dtype))


def _tensor_step_on_platforms(w, g, mu, nu, scalars, delayed, hyper: Hyperparameters, dtype, axis):
  """(w, mu, nu, q, amax of the new weights, qt); with `axis` (inside the expert axis's shard_map) the amax
  over all devices' experts."""
  w, mu, nu, q, amax, qt = on_platforms(w, g, mu, nu, scalars, delayed,
                                        cpu=functools.partial(_tensor_step, hyper=hyper, dtype=dtype),
                                        cuda=functools.partial(cuda.tensor_adam, hyper=hyper, dtype=dtype))
  return w, mu, nu, q, amax if axis is None else jax.lax.pmax(amax, axis), qt


def _block_step(w, g, mu, nu, scalars, hyper: Hyperparameters, dtype):
  w, mu, nu = _adam(w, g, mu, nu, scalars, hyper)
  q, e, qt = blockwise.quantize_weights(w.astype(dtype))
  return w, mu, nu, q, e, qt


def _tensor_step(w, g, mu, nu, scalars, delayed, hyper: Hyperparameters, dtype):
  w, mu, nu = _adam(w, g, mu, nu, scalars, hyper)
  rounded = w.astype(dtype)
  q = tensorwise.quantize_e4m3(rounded, delayed)
  return w, mu, nu, q, quantize.amax(rounded), jnp.swapaxes(q, 1, 2)


def _adam(w, g, mu, nu, scalars, hyper: Hyperparameters):
  """The step in JAX operations, in optax's order (scale_by_adam, add_decayed_weights, scale_by_learning_rate,
  apply_updates); scalars: [-learning rate, 1 - b1^t, 1 - b2^t]."""
  neg_lr, c1, c2 = scalars[0], scalars[1], scalars[2]
  g = g.astype(jnp.float32)
  mu = (1 - hyper.b1) * g + hyper.b1 * mu
  nu = (1 - hyper.b2) * (g * g) + hyper.b2 * nu
  u = (mu / c1) / (jnp.sqrt(nu / c2 + hyper.eps_root) + hyper.eps)
  if hyper.weight_decay != 0.0:  # optax adds nothing for a zero decay
    u = u + hyper.weight_decay * w
  return w + u * neg_lr, mu, nu


def _delayed_amax(fp8, shape):
  """The maximum the tensorwise recipe quantizes the new weights by (fp8's amax), or None for blockwise."""
  if isinstance(fp8, Fp8Weights):
    if fp8.recipe != "tensorwise":
      raise ValueError(f"fp8_adam_step: fp8: Fp8Weights of the {fp8.recipe} recipe; pass fp8={fp8.recipe!r} "
                       "(each block is quantized by its own scale)")
    if fp8.amax is None:
      raise ValueError("fp8_adam_step: fp8: tensorwise Fp8Weights without their maximum (amax is None); pass "
                       "those of jaxmlp.fp8_weights or of the last fp8_adam_step")
    if np.shape(fp8.q) != shape:
      raise ValueError(f"fp8_adam_step: fp8: Fp8Weights of shape {list(np.shape(fp8.q))}, expected w's "
                       f"{list(shape)}")
    if np.shape(fp8.amax) != ():
      raise ValueError(f"fp8_adam_step: fp8.amax must be a scalar, got shape {list(np.shape(fp8.amax))}")
    if jnp.result_type(fp8.amax) != jnp.float32:
      raise TypeError(f"fp8_adam_step: fp8.amax must be float32, got {jnp.result_type(fp8.amax)}")
    return jnp.asarray(fp8.amax, jnp.float32)
  name = fp8.name if isinstance(fp8, Fp8Recipe) else fp8
  if name == "blockwise":
    return None
  if name == "tensorwise":
    raise ValueError("fp8_adam_step: fp8='tensorwise' quantizes the new weights by the last weights' maximum "
                     "(delayed scaling): pass their Fp8Weights (the last step's fp8_adam_step, or "
                     "jaxmlp.fp8_weights(w, 'tensorwise', dtype) before the first)")
  error = ValueError if isinstance(fp8, str) else TypeError
  raise error(f"fp8_adam_step: fp8: expected 'blockwise', its Fp8Recipe or the tensorwise Fp8Weights of w, got "
              f"{fp8!r}")


def _check(w, g, state, learning_rate, b1, b2, eps, eps_root, weight_decay, dtype) -> Hyperparameters:
  """Trace-time checks, with the argument's name in the error: ValueError for shapes and values, TypeError
  for dtypes and types (as grouped_mlp)."""
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    raise TypeError(f"fp8_adam_step: dtype {jnp.dtype(dtype)} is not supported; FP8 weights are quantized from "
                    "bfloat16 or float16")
  shape = np.shape(w)
  if len(shape) != 3 or shape[1] % 16 or shape[2] % 16:
    raise ValueError(f"fp8_adam_step: w has shape {list(shape)}, expected [E, K, N] with K and N multiples of 16")
  for field in ("count", "mu", "nu"):
    if not hasattr(state, field):
      raise TypeError(f"fp8_adam_step: state has no field {field!r}; expected adam's state (count, mu, nu), "
                      "e.g. optax.scale_by_adam().init(w)")
  if not hasattr(state, "_replace"):
    raise TypeError("fp8_adam_step: state must be a NamedTuple (count, mu, nu), e.g. optax.ScaleByAdamState")
  for name, v in (("w", w), ("g", g), ("state.mu", state.mu), ("state.nu", state.nu)):
    if np.shape(v) != shape:
      raise ValueError(f"fp8_adam_step: {name} has shape {list(np.shape(v))}, expected w's {list(shape)}")
    if jnp.result_type(v) != jnp.float32 and not (name == "g" and jnp.result_type(v) == jnp.dtype(dtype)):
      raise TypeError(f"fp8_adam_step: {name}.dtype is {jnp.result_type(v)}, expected float32 (master weights and "
                      f"their moments; the gradient float32 or dtype {jnp.dtype(dtype)})")
  if np.shape(state.count) != () or not jnp.issubdtype(jnp.result_type(state.count), jnp.integer):
    raise TypeError(f"fp8_adam_step: state.count must be an integer scalar, got {jnp.result_type(state.count)} "
                    f"{list(np.shape(state.count))}")
  if np.shape(learning_rate) != ():
    raise ValueError(f"fp8_adam_step: learning_rate must be a scalar, got shape {list(np.shape(learning_rate))}")
  constants = dict(b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay)
  for name, value in constants.items():
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
      raise TypeError(f"fp8_adam_step: {name} must be a Python float (a constant of the step), got "
                      f"{type(value).__name__}")
  for name in ("b1", "b2"):
    if not 0.0 <= constants[name] < 1.0:
      raise ValueError(f"fp8_adam_step: {name} = {constants[name]} must lie in [0, 1)")
  return Hyperparameters(**{name: float(value) for name, value in constants.items()})
